"""Compiling through jaxlib's own clients: executables in the form JAX's persistent cache keeps.

JAX files an executable as jaxlib's client serializes it: an IFRT header (the
program's name, its outputs' shardings and layouts), then the plugin's own
bytes. The native module makes only the plugin's bytes (PJRT_Executable_Serialize),
which equal what follows the header (measured: libtpu 0.0.42.1, v5e:1x1). So a
compile for JAX's cache goes through jaxlib: libtpu loaded by jaxlib's PJRT
loader, the topology made by jaxlib with the same create options, and jaxlib's
compile-only client compiling the module, parsed in an MLIR context of jaxlib's
dialects, with the options JAX uses. Measured: the bytes equal those of JAX's
own deviceless compile of the same jit (a process's later compiles add a few
bytes: a count of its compiles). For the CPU, jaxlib's own CPU client compiles
(compile_for_cpu, on worker.plugin.jaxlib_cpu's clients), with as many devices as the
target's JAX has.

Imports jaxlib, never jax; every jaxlib call it makes is private to jaxlib and
checked on jaxlib 0.10, 0.11 and 0.12 (JaxlibApiError names one that moved).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from worker.errors import JaxlibApiError
from worker.identity.options import assignment_device_ids, read_varint
from worker.plugin.topology import TopologySpec

_loaded_lock = threading.Lock()


def _xla_client() -> Any:
    try:
        from jaxlib import xla_client
    except ImportError as error:
        raise JaxlibApiError(f"jaxlib does not import here ({error})") from None
    return xla_client


_c_apis: dict[str, Any] = {}


def _load_plugin(platform: str, library: str) -> Any:
    """Loads and initializes a PJRT plugin through jaxlib, once per process, for compiling only
    (libtpu: without the host's lock; worker.plugin.runtime.loading_environment); its C API."""
    from worker.plugin.locate import environment_variables
    from worker.plugin.runtime import loading_environment

    xla_client = _xla_client()
    with _loaded_lock, environment_variables(loading_environment(platform, deviceless=True)):
        try:
            if platform not in _c_apis:
                _c_apis[platform] = xla_client.load_pjrt_plugin_dynamically(platform, library)
            if not xla_client.pjrt_plugin_initialized(platform):
                xla_client.initialize_pjrt_plugin(platform)
        except AttributeError as error:
            raise JaxlibApiError(f"jaxlib moved its PJRT plugin loader: {error}") from None
        return _c_apis[platform]


def _context() -> Any:
    """An MLIR context with the dialects of JAX's modules (as JAX makes its own)."""
    from jaxlib.mlir import ir

    context = ir.Context()
    try:
        from jaxlib.mlir._mlir_libs import _jax_mlir_ext

        registry = ir.DialectRegistry()
        _jax_mlir_ext.register_dialects(registry)
        context.append_dialect_registry(registry)
    except (ImportError, AttributeError) as error:
        raise JaxlibApiError(f"jaxlib moved its MLIR dialect registry: {error}") from None
    context.load_all_available_dialects()
    from jaxlib.mlir import dialects

    for name, register in (
        ("sdy", "register_dialect"),
        ("mhlo", "register_mhlo_dialect"),
        ("chlo", "register_dialect"),
        ("stablehlo", "register_dialect"),
    ):
        try:
            module = __import__(f"jaxlib.mlir.dialects.{name}", fromlist=[register])
        except ImportError:  # a jaxlib without this dialect has no modules using it
            continue
        getattr(module, register)(context)
    del dialects
    return context


class CompiledForJax(NamedTuple):
    """An executable compiled through jaxlib, as JAX's cache keeps it."""

    serialized: bytes
    """What jaxlib's LoadedExecutable.serialize gives: the value JAX's cache stores."""

    def plugin_bytes(self) -> bytes:
        """The plugin's own serialized executable: what follows jaxlib's header."""
        return strip_jaxlib_header(self.serialized)


def strip_jaxlib_header(serialized: bytes) -> bytes:
    """The plugin's bytes of an executable jaxlib serialized (its header is a varint length,
    then that many bytes naming "pjrt_ifrt"); raises ValueError for bytes without one."""
    length, index = read_varint(serialized, 0)
    header = serialized[index : index + length]
    if b"pjrt_ifrt" not in header or index + length > len(serialized):
        raise ValueError("not an executable serialized by jaxlib (no IFRT header)")
    return serialized[index + length :]


class JaxlibTopology:
    """A topology of a PJRT plugin, made and compiled for by jaxlib (see the module)."""

    def __init__(self, platform: str, library: str, spec: TopologySpec) -> None:
        c_api = _load_plugin(platform, library)
        xla_client = _xla_client()
        try:
            topology = xla_client.make_c_api_device_topology(
                c_api, spec.name, **spec.create_options()
            )
            self.devices: Sequence[Any] = topology._make_compile_only_devices()
        except AttributeError as error:
            raise JaxlibApiError(f"jaxlib moved its topology bindings: {error}") from None
        self.spec = spec
        self.client = self.devices[0].client

    @property
    def platform_version(self) -> str:
        """The platform version jaxlib's client reports (what JAX's key hashes)."""
        return str(self.client.platform_version)

    def compile(self, code: bytes, options: bytes) -> CompiledForJax:
        """Compiles MLIR bytecode (as JAX hands it to a compiler) with serialized compile
        options for this topology, on the devices of the options' device assignment."""
        xla_client = _xla_client()
        from jaxlib.mlir import ir

        parsed = xla_client.CompileOptions.ParseFromString(options)
        assignment = parsed.device_assignment
        ids = [] if assignment is None else assignment_device_ids(assignment.serialize())
        by_id = {device.id: device for device in self.devices}
        try:
            chosen = [by_id[i] for i in ids] if ids else [self.devices[0]]
        except KeyError as missing:
            raise ValueError(
                f"the program's device assignment names device {missing}, which the "
                f"topology {self.spec} does not have"
            ) from None
        with _context() as context:
            module = ir.Module.parse(code, context=context)
            executable = self.client.compile(
                module,
                executable_devices=xla_client.DeviceList(tuple(chosen)),
                compile_options=parsed,
            )
        return CompiledForJax(bytes(executable.serialize()))


def compile_for_cpu(code: bytes, options: bytes, devices: int) -> CompiledForJax:
    """Compiles MLIR bytecode with serialized compile options on jaxlib's CPU client of
    `devices` devices (JAX's count changes its results), as jax.jit on the CPU does, over the
    devices of the options' device assignment (worker.plugin.jaxlib_cpu makes and keeps the
    clients, the ones the cpu platform runs on)."""
    from worker.plugin.jaxlib_cpu.client import serialized_for_jax

    assignment = _xla_client().CompileOptions.ParseFromString(options).device_assignment
    ids = [] if assignment is None else assignment_device_ids(assignment.serialize())
    return CompiledForJax(serialized_for_jax(code, options, devices, ids or None))


_topologies: dict[tuple[str, TopologySpec], JaxlibTopology] = {}


def compile_for_topology(
    platform: str, spec: TopologySpec, code: bytes, options: bytes
) -> CompiledForJax:
    """Compiles for a topology of a platform's plugin (found as a pool finds it: its
    PJRT_POOL_PLUGIN_<PLATFORM>, else its package) through jaxlib (JaxlibTopology)."""
    from worker.plugin.locate import find_plugin

    with _loaded_lock:
        topology = _topologies.get((platform, spec))
    if topology is None:
        made = JaxlibTopology(platform, find_plugin(platform).path, spec)
        with _loaded_lock:
            topology = _topologies.setdefault((platform, spec), made)
    return topology.compile(code, options)
