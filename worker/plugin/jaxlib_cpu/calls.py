"""Every call into jaxlib's own CPU client, in one place, without JAX.

jaxlib is JAX's compiled half: its CPU client (``xla_client.make_cpu_client``, what
``jax.jit`` runs on) is XLA's, built from the same XLA as the installed jax, and
it has no PJRT C API to load it by. So the worker uses it through jaxlib's Python
bindings, and every binding it uses is named here. Most are private to jaxlib and
move between its releases; each function says what it uses, and an installed
jaxlib that lacks one raises JaxlibApiError naming that jaxlib and what to do
(name a CPU plugin instead). Checked with jaxlib 0.10.2, 0.11.2 and 0.12.0.1.

Nothing here imports ``jax``: arrays go in through ``batched_device_put`` with a
sharding and an abstract value of this module's own (what JAX's own classes
provide), and come out through the array's own host view, never ``np.asarray``
(whose ``__array__`` imports JAX). Importing this module imports jaxlib's
extension (about 0.1 s over numpy in a fresh process): only a process that runs
programs on jaxlib's client pays for it.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from worker.errors import JaxlibApiError, PjrtError

# As jax/__init__.py does before jaxlib loads: XLA's INFO lines (the CPU client's device
# count as it starts, ...) stay out of the caller's stderr unless the user asks for them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

try:
    import jaxlib
    from jaxlib import xla_client
except ImportError as error:  # pjrt-pool depends on jaxlib: an installation left broken
    raise ImportError(
        f"jaxlib's CPU client needs jaxlib, which does not import here ({error}); "
        "reinstall jax and jaxlib (pip install --force-reinstall jax jaxlib)"
    ) from error

KNOWN_VERSIONS = ("0.10", "0.11", "0.12")
"""The jaxlib releases whose private API this module is written against."""


def version() -> str:
    """The installed jaxlib's version ("0.10.2")."""
    return str(jaxlib.__version__)


def git_hash() -> str:
    """The git commit the installed jaxlib (and so its XLA) was built from, or ""."""
    from jaxlib import version as jaxlib_version

    return str(getattr(jaxlib_version, "_git_hash", "") or "")


def _moved(what: str, error: BaseException | None = None) -> JaxlibApiError:
    known = ", ".join(KNOWN_VERSIONS)
    cause = f" ({error})" if error is not None else ""
    return JaxlibApiError(
        f"jaxlib {version()} has no {what}{cause}: pjrt-pool runs programs on jaxlib's own "
        f"CPU client through bindings that moved in this release (it knows jaxlib {known}). "
        "Install a jax and jaxlib of those releases, or run on a CPU PJRT plugin instead "
        "(platform='pjrt_cpu', or PJRT_POOL_PLUGIN_CPU naming its library)"
    )


def _binding(owner: Any, name: str, what: str) -> Any:
    found = getattr(owner, name, None)
    if found is None:
        raise _moved(what)
    return found


_STATUS = re.compile(r"^(?:\w+Error: )?([A-Z_]+): ")
_CODES = {
    "CANCELLED": 1,
    "UNKNOWN": 2,
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "ABORTED": 10,
    "OUT_OF_RANGE": 11,
    "UNIMPLEMENTED": 12,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}
"""absl status codes by name, as PJRT_Error_Code numbers them."""


def pjrt_error(error: BaseException, step: str = "") -> PjrtError:
    """A jaxlib runtime error as the PjrtError a PJRT plugin's would be (code, code_name), its
    message after the jaxlib call that failed (`step`), as a plugin's names its function."""
    message = str(error)
    found = _STATUS.match(message)
    name = found.group(1) if found and found.group(1) in _CODES else "UNKNOWN"
    converted = PjrtError(f"{step}: {message}" if step else message)
    converted.code = _CODES[name]
    converted.code_name = name
    return converted


def _runtime_errors() -> tuple[type[BaseException], ...]:
    found = [getattr(xla_client, "XlaRuntimeError", None), getattr(jaxlib, "JaxRuntimeError", None)]
    jax_module = getattr(xla_client, "_xla", None)
    found.append(getattr(jax_module, "JaxRuntimeError", None))
    return tuple({error for error in found if isinstance(error, type)}) or (RuntimeError,)


RUNTIME_ERRORS = _runtime_errors()
"""The exceptions jaxlib raises for a failed compile, load or run."""


def make_client(devices: int) -> Any:
    """A new CPU client of `devices` devices, made as JAX makes its own (asynchronous
    dispatch on, as JAX's jax_cpu_enable_async_dispatch defaults), with jaxlib's handler of
    CPU custom-call registrations installed (register_ffi_target)."""
    make = _binding(xla_client, "make_cpu_client", "xla_client.make_cpu_client")
    try:
        return make(asynchronous=True, num_devices=devices)
    except TypeError as error:
        raise _moved("make_cpu_client(asynchronous=..., num_devices=...)", error) from None


def devices_of(client: Any) -> list[Any]:
    """The client's devices, by id order."""
    return sorted(client.local_devices(), key=lambda device: device.id)


def _device_list(devices: Sequence[Any]) -> Any:
    return _binding(xla_client, "DeviceList", "xla_client.DeviceList")(tuple(devices))


def _options(serialized: bytes) -> Any:
    parse = _binding(xla_client.CompileOptions, "ParseFromString", "CompileOptions.ParseFromString")
    return parse(bytes(serialized))


def default_compile_options() -> bytes:
    """The compile options jaxlib makes by default (XLA's debug options, with this process's
    XLA_FLAGS), serialized: what JAX's own options start from."""
    return bytes(xla_client.CompileOptions().SerializeAsString())


def compile_and_load(client: Any, code: bytes, options: bytes, devices: Sequence[Any]) -> Any:
    """Compiles StableHLO bytecode with serialized CompileOptionsProto for `devices`.

    Malformed options can make XLA abort the process, as on a PJRT plugin
    (an empty proto: "Check failed: replica_count > 0"). Raises PjrtError for
    what XLA refuses.
    """
    compile_ = _binding(client, "compile_and_load", "Client.compile_and_load")
    parsed = _options(options)
    try:
        return compile_(bytes(code), _device_list(devices), parsed)
    except RUNTIME_ERRORS as error:
        raise pjrt_error(error, "jaxlib Client.compile_and_load") from None


def deserialize(client: Any, serialized: bytes, devices: Sequence[Any]) -> Any:
    """Loads what serialize gave onto `devices`, which must be the devices it was compiled
    for in number (XLA aborts the process on a count that does not fit its shardings).
    Raises PjrtError for bytes it cannot read."""
    load = _binding(client, "deserialize_executable", "Client.deserialize_executable")
    try:
        return load(bytes(serialized), _device_list(devices), None)
    except RUNTIME_ERRORS as error:
        raise pjrt_error(error, "jaxlib Client.deserialize_executable") from None


def serialize(executable: Any) -> bytes:
    """The executable in jaxlib's serialized form (what JAX's persistent cache stores)."""
    return bytes(_binding(executable, "serialize", "LoadedExecutable.serialize")())


def fingerprint(executable: Any) -> bytes | None:
    """The executable's fingerprint (equal for equal compiles), or None."""
    found = getattr(executable, "fingerprint", None)
    if callable(found):
        found = found()
    return None if found is None else bytes(found)


def _hlo_module(executable: Any) -> Any:
    modules = _binding(executable, "hlo_modules", "LoadedExecutable.hlo_modules")()
    if len(modules) != 1:
        raise _moved(f"one HLO module per executable (it gave {len(modules)})")
    return modules[0]


def output_types(executable: Any) -> list[tuple[np.dtype, tuple[int, ...]]]:
    """Each output's (dtype, shape) on one device, from the compiled module's result shape.
    Raises PjrtError for an output that is not laid out row-major (host_view reads them so;
    XLA's CPU compiler lays out none otherwise)."""
    module = _hlo_module(executable)
    computation_type = _binding(_hlo(), "XlaComputation", "jaxlib._hlo.XlaComputation")
    serialized = _binding(module, "as_serialized_hlo_module_proto", "HloModule serialization")()
    result = computation_type(serialized).program_shape().result_shape()
    shapes = result.tuple_shapes() if result.is_tuple() else [result]
    found = []
    for shape in shapes:
        dimensions = tuple(shape.dimensions())
        layout = shape.layout()
        order = None if layout is None else tuple(layout.minor_to_major())
        if order not in (None, (), tuple(reversed(range(len(dimensions))))):
            raise PjrtError(f"an output of shape {dimensions} is laid out {layout}, not row-major")
        found.append((np.dtype(shape.numpy_dtype()), dimensions))
    return found


@functools.cache
def _hlo() -> Any:
    try:
        from jaxlib import _hlo as hlo
    except ImportError:
        hlo = getattr(xla_client, "_xla", None)
    if hlo is None:
        raise _moved("jaxlib._hlo")
    return hlo


def parameter_shardings(executable: Any) -> list[Any]:
    """Each parameter's HloSharding (what an array given to it on several devices says)."""
    found = _binding(executable, "get_parameter_shardings", "get_parameter_shardings")()
    if found is None:
        raise _moved("parameter shardings of an executable over several devices")
    hlo_sharding = xla_client.HloSharding
    return [s if isinstance(s, hlo_sharding) else hlo_sharding.from_proto(s) for s in found]


class _Aval:
    """What batched_device_put reads of an abstract value (JAX's ShapedArray)."""

    __slots__ = ("dtype", "shape", "weak_type")

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.shape = shape
        self.dtype = dtype
        self.weak_type = False


class _OneDevice(xla_client.SingleDeviceSharding):  # type: ignore[misc,name-defined]
    """An array on one device: what JAX's SingleDeviceSharding adds to jaxlib's class (its
    device list made once: batched_device_put asks for it on every put)."""

    memory_kind = None
    is_fully_addressable = True
    is_fully_replicated = True
    num_devices = 1

    def __init__(self, device: Any) -> None:
        super().__init__(device)
        self._devices_of = _device_list((device,))
        self._assignment = (device,)

    def _to_xla_hlo_sharding(self, ndim: int) -> Any:
        return xla_client.HloSharding.replicate()

    @property
    def _internal_device_list(self) -> Any:
        return self._devices_of

    @property
    def _device_assignment(self) -> tuple[Any, ...]:
        return self._assignment


class _Devices(xla_client.GSPMDSharding):  # type: ignore[misc,name-defined]
    """An array split over several devices as an executable's parameter is (its HloSharding):
    what JAX's GSPMDSharding adds to jaxlib's class."""

    memory_kind = None
    is_fully_addressable = True
    is_fully_replicated = False

    def _to_xla_hlo_sharding(self, ndim: int) -> Any:
        return self._hlo_sharding

    @property
    def _device_assignment(self) -> tuple[Any, ...]:
        return tuple(self._devices)

    @property
    def num_devices(self) -> int:
        return len(self._devices)


_HOST_BUFFER = getattr(xla_client, "HostBufferSemantics", None)
_ZERO_COPY = getattr(_HOST_BUFFER, "ZERO_COPY", None)
_COPY = getattr(_HOST_BUFFER, "IMMUTABLE_ONLY_DURING_CALL", None)


@functools.cache
def one_device(device: Any) -> Any:
    """The sharding of an array on one device."""
    return _OneDevice(device)


def sharding_over(devices: Sequence[Any], hlo_sharding: Any) -> Any:
    """The sharding of an array over devices as an HloSharding splits it."""
    return _Devices(_device_list(devices), hlo_sharding)


@functools.lru_cache(maxsize=1024)
def abstract(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """The abstract value of arrays of a shape and dtype (made once: puts are the hot path)."""
    return _Aval(tuple(shape), np.dtype(dtype))


def put(arrays: Sequence[np.ndarray], devices: Sequence[Any], sharding: Any, zero_copy: bool,
        aval: Any) -> Any:  # fmt: skip
    """One array on `devices` from its blocks (one per device, C-contiguous, of aval's dtype;
    aval's shape is the whole array's): the device's buffer is the block's own memory where
    zero_copy and XLA takes it (dense, aligned to 64 bytes), else a copy. A zero-copy array
    keeps its block (and the memory it views) alive until the array is gone."""
    if _ZERO_COPY is None or _COPY is None:
        raise _moved("HostBufferSemantics.ZERO_COPY")
    semantics = _ZERO_COPY if zero_copy else _COPY
    try:
        return xla_client.batched_device_put(
            aval, sharding, arrays, devices, True, False, semantics, True
        )
    except RUNTIME_ERRORS as error:
        raise pjrt_error(error) from None
    except TypeError as error:
        raise _moved("batched_device_put(aval, sharding, xs, devices, ...)", error) from None


def result_handler(shape: tuple[int, ...], dtype: np.dtype, device: Any) -> Any:
    """What makes an output of one device into an array (JAX makes these for a jax.jit)."""
    make = _binding(xla_client, "array_result_handler", "xla_client.array_result_handler")
    try:
        return make(abstract(shape, dtype), one_device(device), True, _skip_checks=True)
    except TypeError:  # jaxlib 0.12 dropped _skip_checks (and checks nothing JAX would)
        return make(abstract(shape, dtype), one_device(device), True)


def execute(executable: Any, arguments: Sequence[Any], handlers: Sequence[Any]) -> list[Any]:
    """Runs an executable of one device on arrays; returns its outputs as arrays made by
    `handlers` (result_handler), once dispatched (they are ready when read: host_view)."""
    try:
        return list(executable.execute_sharded(list(arguments)).consume_with_handlers(handlers))
    except RUNTIME_ERRORS as error:
        raise pjrt_error(error) from None


def execute_per_device(executable: Any, arguments: Sequence[Any]) -> list[list[Any]]:
    """Runs an executable over several devices on arrays; returns each output's arrays, one per
    device. Splitting them makes jaxlib import JAX's core (it gives each its abstract value
    with jax.core.ShapedArray): the one call here that imports JAX, made only for programs
    over several devices."""
    try:
        return executable.execute_sharded(list(arguments)).disassemble_into_single_device_arrays()
    except RUNTIME_ERRORS as error:
        raise pjrt_error(error) from None


class _HostBuffer:
    """An array's buffer on a CPU device as numpy reads it (__array_interface__), holding the
    array: a numpy view of it keeps the buffer alive."""

    __slots__ = ("__array_interface__", "array")

    def __init__(self, array: Any, address: int, size: int) -> None:
        self.array = array
        self.__array_interface__ = {
            "data": (address, False),  # writable: the buffer is the array's alone
            "shape": (size,),
            "typestr": "|u1",
            "version": 3,
        }


def host_view(array: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """An array on one CPU device (of this dtype and row-major shape) as a numpy view of its
    buffer, once it is computed; raises PjrtError for a run that failed. Read through its
    buffer's address, since jaxlib's own conversions import JAX. The view is writable, as a
    PJRT plugin's outputs are: the buffer is the array's alone, and the view holds it."""
    ready([array])
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size == 0:
        return np.empty(shape, dtype)
    buffer = _HostBuffer(array, buffer_address(array), size)
    return np.asarray(buffer).view(dtype).reshape(shape)


def collect_garbage() -> None:
    """Lets go of the host arrays that XLA's threads are done with: jaxlib defers dropping a
    Python reference from another thread until it holds the GIL again (its next call, or
    this), so an input given without a copy, or copied asynchronously, keeps the memory it
    views (shared memory: its segment stays mapped) until then. JAX calls this on every
    garbage collection; this module registers the same callback."""
    collect = getattr(getattr(xla_client, "_xla", None), "collect_garbage", None)
    if collect is not None:
        collect()


def _collect_on_gc(phase: str, info: dict[str, Any]) -> None:
    collect_garbage()


gc.callbacks.append(_collect_on_gc)


def ready(arrays: Sequence[Any]) -> None:
    """Waits until arrays are computed; raises PjrtError for a run that failed."""
    try:
        xla_client.batched_block_until_ready(list(arrays))
    except RUNTIME_ERRORS as error:
        raise pjrt_error(error) from None


def buffer_address(array: Any) -> int:
    """The address of an array's buffer on its one CPU device."""
    return int(array.unsafe_buffer_pointer())


def copy_out(array: Any, address: int, size: int) -> None:
    """Copies the `size` bytes of a computed array on one CPU device (ready) to an address."""
    if size:
        ctypes.memmove(address, buffer_address(array), size)


CAPSULE_NAME = b"xla._CUSTOM_CALL_TARGET"
"""The name of the PyCapsule that holds an XLA_FFI_Handler* (as FFI libraries make them)."""


def _capsule(handler: Any) -> Any:
    """A handler as a PyCapsule: one as it is, an address wrapped in one (which jaxlib takes
    only so)."""
    if not isinstance(handler, int):
        return handler
    if handler == 0:
        raise ValueError("an FFI handler's address is 0: give the handler's address or capsule")
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(handler, CAPSULE_NAME, None)


class FfiRefusalError(PjrtError):
    """jaxlib's XLA refused an FFI handler built for an XLA FFI it cannot take."""

    def __init__(self, message: str, handler: tuple[int, int], runtime: tuple[int, int]) -> None:
        super().__init__(message)
        self.handler_version = handler
        self.runtime_version = runtime


_REFUSED = re.compile(
    r"handler's API version \((\d+)\.(\d+)\) is incompatible with the framework's API "
    r"version \((\d+)\.(\d+)\)"
)


def register_ffi_target(name: str, handler: Any, traits: int) -> None:
    """Registers a typed XLA FFI handler (a PyCapsule, or its address) for a CPU custom-call
    target, as JAX registers jaxlib's LAPACK kernels (api_version 1: the typed FFI).

    jaxlib's XLA checks the handler's XLA FFI version: one it cannot take raises
    FfiRefusalError with both versions; any other failure PjrtError.
    """
    register = _binding(xla_client, "register_custom_call_target", "register_custom_call_target")
    try:
        register(name, _capsule(handler), platform="cpu", api_version=1, traits=traits)
    except RUNTIME_ERRORS as error:
        converted = pjrt_error(error)
        found = _REFUSED.search(str(error))
        if found is None:
            raise converted from None
        major, minor, runtime_major, runtime_minor = (int(part) for part in found.groups())
        raise FfiRefusalError(str(error), (major, minor), (runtime_major, runtime_minor)) from None


def ffi_api_version() -> tuple[int, int] | None:
    """The XLA FFI API version of jaxlib's XLA, from the FFI header jaxlib ships (the one
    jax.ffi.include_dir() names), or None when it is not there."""
    header = Path(jaxlib.__file__).parent / "include" / "xla" / "ffi" / "api" / "c_api.h"
    try:
        text = header.read_text()
    except OSError:
        return None
    found = [re.search(rf"#define XLA_FFI_API_{part}\s+(\d+)", text) for part in ("MAJOR", "MINOR")]
    if not all(found):
        return None
    return (int(found[0].group(1)), int(found[1].group(1)))  # type: ignore[union-attr]


def stablehlo_window() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (minimum, current) StableHLO versions jaxlib's compiler reads (importing jaxlib's
    MLIR bindings: about 0.3 s)."""
    from jaxlib.mlir.dialects import stablehlo

    def parse(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in str(text).split("."))

    return parse(stablehlo.get_minimum_version()), parse(stablehlo.get_current_version())
