"""What a platform is: the one interface every platform module fills in.

A platform is a kind of PJRT plugin as a user names it (``Pool(platform="cuda")``,
``--platform``, ``PJRT_POOL_PLUGIN_<NAME>``). Everything pjrt-pool knows about
one lives in its module (worker/plugin/platforms/NAME.py), as a subclass of
Platform whose one instance is the module's ``PLATFORM``; the rest of the
code only reads it (registry.platform_named). A platform says:

- where its plugin is found: ``packages``, the pip distributions that
  install a plugin library, tried in order after ``PJRT_POOL_PLUGIN_<NAME>``
  (worker.plugin.locate), or, before them, ``runs_on_jaxlib``: the installed
  jaxlib's own client (the CPU's, worker.plugin.jaxlib_cpu);
- what a process needs around the plugin: ``before_load`` (CUDA preloads
  NVIDIA's libraries; TPU says at once that no chip is attached),
  ``compile_only_environment`` (libtpu kept off the chips and their lock),
  ``client_options`` (GPUs: no preallocation), ``ffi_name``, and
  ``unavailable``, what a failed load or client means;
- its kernels: ``kernels``, the kernel libraries JAX lowers custom calls to,
  and ``kernel_package``, the package that matches a plugin build
  (worker.plugin.kernels);
- its flags and key parts: ``jax_semantics`` (flags that make results equal
  JAX's, worker.plugin.xla_flags), ``flag_variables`` (variables of XLA flags
  of its own, part of the key), ``platform_parts`` (the host or the topology
  in its keys), ``shares_autotune_results`` (worker.plugin.startup);
- its compile slots: ``compile_slots`` (worker.compile.slots);
- its devices: ``device_access`` (may several processes hold one?),
  ``attached_devices``, ``host_topology``, ``references_apart`` (whether
  check-plugin runs JAX's side in a process of its own), and
  ``device_settings``, how a worker process is given k devices;
- JAX's names for it: ``jax_names`` (what ``lower`` exports for, and the
  devices of JAX's own that check-plugin compares with).

A platform no module describes still works when its plugin is named by
``PJRT_POOL_PLUGIN_<NAME>``: it gets the defaults below (UnlistedPlatform).

Platforms are plain classes, not dataclasses: every process that loads a
plugin reads one, and defining a dataclass costs about a millisecond, on the
path of every worker's start (docs/facts.md, "Start-up costs").
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from worker.errors import DeviceUnavailableError
from worker.identity.keys import PlatformPart

if TYPE_CHECKING:
    from worker.plugin.topology import TopologySpec

NOTHING: Mapping[str, Any] = MappingProxyType({})
"""An empty mapping no one can change: the default of every mapping a platform holds."""


class PluginPackage(NamedTuple):
    """A pip distribution that installs a platform's plugin library."""

    distribution: str
    """What to pip install ("jax-cuda13-pjrt")."""

    package: str
    """The import name of the directory that holds the library ("jax_plugins.xla_cuda13")."""

    library: str
    """The library's file name in that directory ("xla_cuda_plugin.so")."""

    extra: str | None
    """The pjrt-pool extra that installs it ("cuda13"), or None."""

    versioned_as_jax: bool
    """Whether the distribution's version is that of the jaxlib whose XLA it is built from."""


class KernelLibrary(NamedTuple):
    """A library of FFI handlers that JAX lowers custom calls to (jnp.linalg: LAPACK on CPU)."""

    markers: tuple[bytes, ...]
    """Substrings of any program or executable that calls one of its targets."""

    modules: tuple[tuple[str, bool], ...]
    """Its modules in the kernel package, each with whether all its targets are FFI ones."""

    description: str
    """What it is, for messages ("jaxlib's LAPACK kernels")."""


class DeviceAccess(enum.Enum):
    """Whether several processes may hold one device of the platform."""

    SHARED = "shared"
    """Every worker opens the devices (a CPU; a GPU, whose memory the workers share)."""

    EXCLUSIVE = "exclusive"
    """One process at a time holds a device (a TPU chip): a pool runs one device worker per
    device and compiles without one, the parent's JAX keeps off them while lowering, and
    check-plugin runs JAX's side after the workers let them go."""


class CompileSlots(enum.Enum):
    """How many compiles of the platform may run at once on a machine by default
    (PJRT_POOL_COMPILE_SLOTS decides when set: worker.compile.slots)."""

    UNCAPPED = "uncapped"
    """Any number: a compile is bound by cores, and XLA's own thread pool spreads one over them."""

    PER_GPU_COMPILE = "one per CORES_PER_GPU_COMPILE cores"
    """One slot per CORES_PER_GPU_COMPILE cores: an XLA GPU compile keeps several cores busy
    and autotunes on the device."""


class DeviceSettings(NamedTuple):
    """What gives a worker process its devices (Platform.device_settings)."""

    create_options: Mapping[str, Any]
    """Client create options to add to the platform's own (client_options). Not part of the
    key: a program's compile options say the devices it runs on (worker.plugin.runtime)."""

    environment: Mapping[str, str]
    """Variables to set for the worker process alone, before its plugin loads."""


NO_SETTINGS = DeviceSettings(NOTHING, MappingProxyType({}))
"""The settings of a worker that opens the platform's devices as a process does by default."""


class Platform:
    """A platform: the defaults here, and a subclass per platform module (see the module).

    Each attribute is a fact about the platform's plugins; each method
    something that needs the machine or the plugin to answer.
    """

    __slots__ = ()

    name: str = ""
    """The platform's name as users give it (platform="cpu"): the module's name, the
    PJRT_POOL_PLUGIN_<NAME> variable's, and the "platform" part of its keys."""

    jax_names: tuple[str, ...] = ()
    """JAX's names for the platform's devices, the one jax.export lowers for first ("cuda",
    then "gpu", what JAX's CUDA devices say). Stated, not derived from the name: a platform
    that builds on another under a name of its own (xla_cpu on cpu) lowers as it does."""

    packages: tuple[PluginPackage, ...] = ()
    """The distributions that install its plugin, in the order they are looked for."""

    runs_on_jaxlib: bool = False
    """Whether its programs run on the installed jaxlib's own client (worker.plugin.jaxlib_cpu),
    the XLA jax.jit runs on, unless PJRT_POOL_PLUGIN_<NAME> names a plugin."""

    client_options: Mapping[str, Any] = NOTHING
    """Client create options every process gives the plugin (part of the key)."""

    kernels: tuple[KernelLibrary, ...] = ()
    """The kernel libraries programs for it may call (registered on first use)."""

    jax_semantics: Mapping[str, str] = NOTHING
    """XLA flags (name: value) added while its plugin loads, so that results equal JAX's."""

    flag_variables: tuple[str, ...] = ()
    """Environment variables of XLA flags of its own, read as the plugin loads: their code
    flags are part of the key (worker.identity.environment.codegen_environment)."""

    platform_parts: frozenset[PlatformPart] = frozenset()
    """The key parts its executables have beside the common ones."""

    shares_autotune_results: bool = False
    """Whether pool workers share XLA's per-fusion autotune results through the cache
    (worker.plugin.startup)."""

    compile_slots: CompileSlots = CompileSlots.UNCAPPED
    """How many of its compiles may run at once on a machine by default."""

    device_access: DeviceAccess = DeviceAccess.SHARED
    """Whether several processes may hold one of its devices."""

    devices_on_demand: bool = False
    """Whether a worker's client makes as many devices as it is given (the CPU's host
    devices: device_settings), so that warming a spec over a mesh of N gives each worker N
    unless told otherwise."""

    input_stream_bytes: int | None = None
    """From what size a pool's parent copies a numpy input for its workers into shared
    memory with streaming stores (pool.executor.copier); None: the copier's STREAM_BYTES,
    the size for a worker whose CPU reads the inputs (the CPU plugins)."""

    @property
    def ffi_name(self) -> str:
        """The platform name XLA's FFI registry uses ("Host", "CUDA"; default: NAME)."""
        return self.name.upper()

    @property
    def references_apart(self) -> bool:
        """Whether check-plugin's reference process computes JAX's answers after the pool's
        workers let the devices go, rather than beside them (pool.conformance.reference_side):
        so for devices one process at a time may hold."""
        return self.device_access is DeviceAccess.EXCLUSIVE

    def compile_only_environment(self) -> dict[str, str]:
        """Variables a process that compiles without devices sets before its plugin loads
        (the plugin reads them as it initializes); a user's own are left as they are."""
        return {}

    def before_load(self, plugin_path: str, *, deviceless: bool) -> None:
        """Prepares this process for loading the plugin at plugin_path; raises
        DeviceUnavailableError when it is known at once that there is nothing to open."""

    def unavailable(self, error: Exception) -> DeviceUnavailableError | None:
        """The DeviceUnavailableError a failed plugin load or client creation means, if any."""
        message = str(error)
        if "found no addressable device" in message:
            return DeviceUnavailableError(
                f"no {self.name} device is attached to this machine ({message}); run where one is"
            )
        return None

    def kernel_package(self, plugin_path: str, platform_version: str | None) -> str | None:
        """The package whose modules hold the kernels for the plugin at plugin_path (whose
        client reports platform_version), or None when nothing says which."""
        return None

    def attached_devices(self) -> int | None:
        """How many of its devices this host shows, or None when that is not known without
        loading the plugin."""
        return None

    def host_topology(self, devices: int) -> TopologySpec | None:
        """The topology of `devices` of this host's devices, to compile for without them;
        None when the platform has no topologies or this host's is unknown."""
        return None

    def device_settings(self, count: int, first: int = 0) -> DeviceSettings:
        """What gives a worker process `count` devices of this host, from device `first` on
        (counting the devices this process sees): client create options and variables for
        that worker alone. The worker's first `count` devices are then those, and a program
        compiled for `count` devices runs on them; whether it has others is the platform's
        (a CPU client has 4 of its own by default; a GPU worker sees only those given).
        Where a worker has the devices without any, no create option is asked for, so that
        its client is made as it always was.

        Raises ValueError for counts below 1 or a first below 0, and for what the platform
        cannot give one process.
        """
        if not isinstance(count, int) or not isinstance(first, int) or count < 1 or first < 0:
            raise ValueError(
                f"a worker is given 1 or more devices from device 0 or later, not {count!r} "
                f"from {first!r}"
            )
        return self.given_devices(count, first)

    def given_devices(self, count: int, first: int) -> DeviceSettings:
        """device_settings for checked arguments: what each platform says (the default
        knows only one device from the first, which needs nothing)."""
        if (count, first) == (1, 0):
            return NO_SETTINGS
        raise ValueError(
            f"pjrt-pool does not know how to give a {self.name} worker {count} device(s) from "
            f"device {first}"
        )

    def __repr__(self) -> str:
        return f"<platform {self.name!r}>"


class UnlistedPlatform(Platform):
    """A platform no module describes: its plugin named by PJRT_POOL_PLUGIN_<NAME>, the
    defaults of Platform for everything else."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    @property  # type: ignore[override]
    def name(self) -> str:
        """The name the platform was asked for by."""
        return self._name

    @property  # type: ignore[override]
    def jax_names(self) -> tuple[str, ...]:
        """Its name: JAX knows it by that, if at all."""
        return (self._name,)


def visible_devices(variable: str, count: int, first: int, environ: Mapping[str, str]) -> str:
    """The value of a variable that limits a process to devices first..first+count-1 of those
    this process sees (CUDA_VISIBLE_DEVICES and the like): indices when the variable is not
    set here, else the entries of its value, so that a worker never sees a device that this
    process does not. Raises ValueError when this process sees fewer."""
    seen = environ.get(variable, "").strip()
    if not seen:
        return ",".join(str(index) for index in range(first, first + count))
    entries = [entry.strip() for entry in seen.split(",") if entry.strip()]
    if first + count > len(entries):
        raise ValueError(
            f"{variable}={seen} shows this process {len(entries)} device(s): a worker cannot "
            f"have {count} from device {first}"
        )
    return ",".join(entries[first : first + count])


def visible_devices_settings(variable: str, count: int, first: int) -> DeviceSettings:
    """The settings that limit a worker to devices first..first+count-1 of those this process
    sees by a variable such as CUDA_VISIBLE_DEVICES (see visible_devices)."""
    value = visible_devices(variable, count, first, os.environ)
    return DeviceSettings(NOTHING, MappingProxyType({variable: value}))
