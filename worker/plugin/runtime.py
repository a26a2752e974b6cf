"""The one PJRT plugin and client of this process.

PJRT plugins are initialized once per process and never unloaded, and two
XLA runtimes in one process compete for threads and memory, so a process
holds at most one Runtime. The first compile or load creates it for the
program's platform; a program for another platform is then refused with
PlatformMismatchError rather than loading a second plugin.

A runtime loaded for deviceless compiles (get_runtime(..., deviceless=True):
compile_program with a topology, a Pool's compile workers on a TPU host)
holds no client until something needs one: it compiles for topologies only,
so it never opens a device, and for TPU it loads libtpu without taking the
host's lock (worker.plugin.libtpu). A client, when something asks for one,
opens the platform's first device; where there is none, or another process
holds it, that is a DeviceUnavailableError saying so.

A runtime is either a PJRT plugin, through the native module, or, for a
platform that runs on it (the CPU: Platform.runs_on_jaxlib), the installed
jaxlib's own client (worker.plugin.jaxlib_cpu), whose plugin handle and
client have the native ones' methods. Its client holds as many devices as
JAX's own would here (jaxlib_cpu.client.jax_devices), or as a program needs:
that count changes a CPU client's results.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from worker import _pjrt
from worker.cache.location import default_cache_dir
from worker.errors import PjrtError, PlatformMismatchError, TopologyError
from worker.identity.build import memoized_by_file
from worker.identity.environment import codegen_environment, host_cpu_features
from worker.identity.keys import PlatformPart
from worker.log import get_logger
from worker.phases import STARTUP
from worker.plugin.build_identity import plugin_build_sha256
from worker.plugin.devices import fixed_devices, more_per_worker, too_few_devices
from worker.plugin.locate import (
    PluginLocation,
    RuntimeKind,
    env_var,
    environment_variables,
    find_plugin,
)
from worker.plugin.platforms.registry import platform_named
from worker.plugin.topology import TopologySpec
from worker.plugin.xla_flags import semantic_flags, xla_flags_added

if TYPE_CHECKING:
    from worker.cache.memos import MemoStore
    from worker.plugin.jaxlib_cpu.client import JaxlibClient, JaxlibPlugin
    from worker.plugin.platforms.platform import Platform

    PluginHandle = _pjrt.Plugin | JaxlibPlugin
    ClientHandle = _pjrt.Client | JaxlibClient

logger = get_logger("pjrt_pool.runtime")

PLATFORM_ENV = "PJRT_POOL_PLATFORM"
"""Names the platform to load when nothing else says which (default "cpu")."""


def _is_window(value: Any) -> bool:
    """Whether a remembered StableHLO window is two versions (or Nones)."""
    return (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, (str, type(None))) for v in value)
    )


def _version(value: Any) -> str | None:
    if isinstance(value, tuple) and value:
        return ".".join(str(part) for part in value)
    return str(value) if value else None


class Runtime:
    """A loaded plugin (or jaxlib's own client) and its client, for one platform."""

    # A plain class, not a dataclass: making a dataclass costs about 0.4 ms at import, on
    # the path of every serving process's start (benchmarks/bench_start.py).
    def __init__(
        self,
        location: PluginLocation,
        plugin: PluginHandle,
        client: ClientHandle | None,
        *,
        client_options: dict[str, Any] | None = None,
        codegen_environment: dict[str, Any] | None = None,
        deviceless: bool = False,
        devices: int | None = None,
    ) -> None:
        self.location = location
        """Which plugin library was loaded, and why."""
        self.facts: Platform = platform_named(location.platform)
        """What pjrt-pool knows about the platform (worker.plugin.platforms)."""
        self.plugin = plugin
        """The native plugin handle (for jaxlib's client, a JaxlibPlugin)."""
        self._client = client
        self.deviceless = deviceless
        """Whether the plugin loaded for deviceless compiles (no client until one is asked for)."""
        self._topologies: dict[TopologySpec, _pjrt.Topology] = {}
        self._device_topology: _pjrt.Topology | None = None
        # Guards making the client and topologies: not `lock`, which a registration holds
        # while it asks for the client (kernels.py).
        self._making = threading.Lock()
        self.registered_targets: set[str] = set()
        """Custom-call targets registered through this runtime."""
        self.refused_targets: dict[str, Any] = {}
        """Targets of kernel libraries the plugin's XLA cannot take, each with the refusal
        (worker.plugin.kernels) whose FfiVersionError a program calling it raises."""
        self.lock = threading.Lock()
        """Serializes one-time registrations (kernel libraries) across threads."""
        self.client_options = dict(client_options or {})
        """The create options the client was made with (part of the cache key)."""
        self.codegen_environment = dict(codegen_environment or {})
        """What the plugin read from the environment when it loaded and that changes the
        code it generates (XLA_FLAGS, thread counts): part of the cache key."""
        self.fixed_devices = devices
        """The devices a pool gave this process's client (worker.plugin.devices.DEVICES_ENV),
        or None: as many as the platform gives, or (CPU) as the largest program needs."""

    def __repr__(self) -> str:
        return f"Runtime({self.location!r})"

    @property
    def kind(self) -> RuntimeKind:
        """A PJRT plugin, or jaxlib's own client."""
        return self.location.kind

    @property
    def runs_natively(self) -> bool:
        """Whether its executables are the native module's (a PJRT plugin's), which the native
        hot loop runs; jaxlib's are run from Python."""
        return self.location.kind is RuntimeKind.PLUGIN

    @property
    def client(self) -> ClientHandle:
        """The native client on the plugin's first device, opened on first use.

        Raises DeviceUnavailableError when the platform has no device here or
        another process holds it (libtpu names that process).
        """
        with self._making:
            if self._client is None:
                self._client = self._open(None)
            return self._client

    def _open(self, devices: int | None) -> ClientHandle:
        """A new client with `devices` devices (None: as many as a pool fixed, or by default)."""
        wanted = self.fixed_devices if devices is None else devices
        return _open_client(self.facts, self.plugin, self._create_options(devices), wanted)

    def _create_options(self, devices: int | None = None) -> dict[str, Any]:
        """The client's create options: the key's (client_options) and those that give it
        `devices` devices (default: as many as a pool fixed; Platform.device_settings). The
        device count is left out of the key: a program's compile options say the devices it
        runs on (its device assignment), and a program of one device compiles alike on a
        client of any count (docs/facts.md, "Devices")."""
        wanted = self.fixed_devices if devices is None else devices
        given = {} if wanted is None else self.facts.device_settings(wanted).create_options
        return {**self.client_options, **given}

    def client_for(self, devices: int, mesh: str = "") -> ClientHandle:
        """A client that holds at least `devices` devices, for a program over that many
        (over `mesh`, described for the refusal).

        The runtime's own client when it holds enough; else, on a platform whose client is
        given devices by create options (the CPU's cpu_device_count) in a process whose count
        no pool fixed, a new client of that many, which later compiles use too (executables
        made on the old one keep it). Raises DeviceCountError otherwise, naming both counts
        and what gives more.
        """
        fixed = self.fixed_devices
        if fixed is not None and devices > fixed:  # what the pool gave, whatever else is here
            where = "this pool worker holds"
            raise too_few_devices(devices, fixed, mesh, where, more_per_worker(devices))
        client = self.client
        if client.num_devices >= devices:
            return client
        if fixed is not None or not self._grows_to(devices):
            raise too_few_devices(
                devices,
                client.num_devices,
                mesh,
                f"this process's {self.platform} client has",
                f"run it on a host with {devices} devices, or compile it here for a topology of "
                f"{devices} (compile_program(..., topology=...)) and run it there",
            )
        with self._making:
            if self._client is None or self._client.num_devices < devices:
                self._client = self._open(devices)
            return self._client

    def _grows_to(self, devices: int) -> bool:
        """Whether a client of this process can be made with `devices` devices: jaxlib's client
        takes any count, a plugin's where the platform gives them by create options, not by
        variables read before the plugin loads."""
        if not self.runs_natively:
            return True
        try:
            return bool(self.facts.device_settings(devices).create_options)
        except ValueError:
            return False
            return self._client

    @property
    def has_client(self) -> bool:
        """Whether a client is open (a deviceless runtime has none until one is asked for)."""
        return self._client is not None

    def topology(self, spec: TopologySpec) -> _pjrt.Topology:
        """The plugin's topology for a spec, made once per process; opens no device.

        Raises TopologyError when the plugin cannot make it (a name it does
        not know, options that do not fit the name, a plugin without topologies,
        jaxlib's own client).
        """
        if not self.runs_natively:
            raise TopologyError(
                f"the {self.platform} platform runs on {self.location.source}, which compiles "
                "for its own devices, not for a topology; compile for a topology on a platform "
                "whose plugin has them (tpu)"
            )
        with self._making:
            found = self._topologies.get(spec)
            if found is None:
                try:
                    found = _pjrt.Topology.create(self.plugin, spec.name, spec.create_options())
                except PjrtError as error:
                    raise TopologyError(
                        f"the {self.platform} plugin cannot make the topology {spec} ({error}); "
                        "name one it takes (for libtpu GENERATION:AxB[xC], such as v5e:1x1, "
                        "v5e:2x2, v6e:2x4 or v4:2x2x1), with the create options it needs"
                    ) from None
                self._topologies[spec] = found
            return found

    def device_topology(self) -> _pjrt.Topology:
        """The topology of the client's devices (opening the client if none is open)."""
        client = self.client
        with self._making:
            if self._device_topology is None:
                self._device_topology = client.topology()
            return self._device_topology

    @property
    def platform(self) -> str:
        """The platform this runtime serves ("cpu", "cuda", ...)."""
        return self.location.platform

    @property
    def api_version(self) -> str:
        """The plugin's PJRT C API version, "major.minor"; for jaxlib's own client, which is
        no PJRT plugin, "jaxlib VERSION"."""
        if not self.runs_natively:
            return f"jaxlib {getattr(self.plugin, 'version', '')}"
        major, minor = self.plugin.api_version  # type: ignore[union-attr]
        return f"{major}.{minor}"

    @property
    def stablehlo_window(self) -> tuple[str | None, str | None]:
        """The (minimum, current) StableHLO versions the plugin reads, when it says.

        jaxlib's, which takes its MLIR bindings (a third of a second) to read, are
        memoized per jaxlib build in memory and in the default cache's records.
        """
        if not self.runs_natively:
            window = memoized_by_file(
                self.location.path, _existing_memos(), "stablehlo-window", self._read_window,
                _is_window,
            )  # fmt: skip
            return window[0], window[1]
        return self._read_window()

    def _read_window(self) -> tuple[str | None, str | None]:
        attributes = self.plugin.attributes()
        return (
            _version(attributes.get("stablehlo_minimum_version")),
            _version(attributes.get("stablehlo_current_version")),
        )

    @property
    def ffi_platform(self) -> str:
        """The platform name XLA's FFI registry uses for this runtime ("Host", "CUDA")."""
        return self.facts.ffi_name

    @property
    def platform_parts(self) -> frozenset[PlatformPart]:
        """The key parts the platform's executables have beside the common ones."""
        return self.facts.platform_parts

    @property
    def ffi_version(self) -> str | None:
        """The XLA FFI API version of the plugin's XLA, "major.minor", or None if it does not
        show it. Read on first use, by registering a probe handler."""
        return _version(self.plugin.ffi_api_version(self.ffi_platform))

    def plugin_sha256(self, memos: Callable[[], MemoStore | None] | None = None) -> str:
        """The SHA-256 of the plugin library (worker.plugin.build_identity).

        From the installed package's RECORD when that vouches for the file;
        else hashed, memoized in memory and in the records memos() gives
        (default: the default cache directory's, if that directory exists and
        passes the trust check; it is never created just for this). jaxlib's
        client is named by jaxlib's RECORD itself (worker.plugin.locate), which
        is hashed, memoized in memory only: it takes a millisecond.
        """
        if not self.runs_natively:
            return plugin_build_sha256(self.location.path, lambda: None)
        return plugin_build_sha256(self.location.path, memos or _existing_memos)

    def identity(self) -> dict[str, Any]:
        """What an executable is tied to: plugin build, API version and, on CPU, host features."""
        identity: dict[str, Any] = {
            "platform": self.platform,
            "plugin_sha256": self.plugin_sha256(),
            "api_version": self.api_version,
        }
        if PlatformPart.HOST in self.platform_parts:
            identity["cpu_features"] = host_cpu_features()
        return identity

    def describe(self) -> dict[str, Any]:
        """Returns the plugin's identity and window as plain data (for handshakes and probes).

        A deviceless runtime has no client to say its platform version and
        device kind: those are None (no device is opened to learn them).
        """
        minimum, current = self.stablehlo_window
        client = self._client
        return {
            "platform": self.platform,
            "runtime": self.kind.value,
            "path": self.location.path,
            "source": self.location.source,
            "api_version": self.api_version,
            "platform_version": None if client is None else client.platform_version,
            "device_kind": None if client is None else client.device_kind,
            "stablehlo_minimum_version": minimum,
            "stablehlo_current_version": current,
        }


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def _existing_memos() -> MemoStore | None:
    """The default cache directory's records, if it exists and passes the trust check.

    Only the records folder is made, in a cache that exists: a process that
    only loads (from a bundle, on a read-only host) makes no other folder, and
    compiling creates the cache.
    """
    # Imported here: a process whose plugin's RECORD vouches for it (worker.plugin.build_identity)
    # never opens a cache, and a loader from a bundle then never imports the store.
    from worker.cache.open_caches import existing_memos

    return existing_memos(default_cache_dir())


def default_platform() -> str:
    """The platform to load when neither a program nor a caller names one."""
    return os.environ.get(PLATFORM_ENV, "cpu")


def loaded_runtime() -> Runtime | None:
    """Returns this process's runtime if a plugin is loaded, else None."""
    return _runtime


def _open_client(
    facts: Platform, plugin: PluginHandle, options: dict[str, Any], devices: int | None
) -> ClientHandle:
    """Creates the client on the plugin's first device, saying clearly when there is none.

    A plugin's client takes its devices from `options`; jaxlib's is made with as many as
    JAX's own client would have here, or `devices` where that is more (see the module).
    """
    try:
        with STARTUP.time("client"):  # on a GPU, also the CUDA context and the allocator
            if isinstance(plugin, _pjrt.Plugin):
                return _pjrt.Client(plugin, options)
            from worker.plugin.jaxlib_cpu.client import jax_devices

            return plugin.client(max(devices or 1, jax_devices()))
    except PjrtError as error:
        raise facts.unavailable(error) or error from None


def loading_environment(platform: str, deviceless: bool) -> dict[str, str]:
    """The variables a plugin of `platform` loads with: for deviceless use, those that keep it
    off the devices and their host lock (libtpu's), which it reads as it initializes."""
    return platform_named(platform).compile_only_environment() if deviceless else {}


def get_runtime(platform: str | None = None, *, deviceless: bool = False) -> Runtime:
    """Returns this process's runtime, loading the plugin for `platform` first if none is.

    With no platform, an already loaded runtime is returned as it is, and
    otherwise the default platform's plugin loads. deviceless=True loads the
    plugin for compiles for topologies only, without a client (see the
    module); a runtime that exists already serves either kind of use.
    Raises PlatformMismatchError when a plugin for another platform is
    loaded already, PluginNotFoundError when no plugin is found,
    DeviceUnavailableError when the platform's device is missing or held by
    another process, and PluginLoadError or PjrtError when it fails to load.
    """
    global _runtime
    with _runtime_lock:
        if _runtime is not None:
            if platform is not None and platform != _runtime.platform:
                raise PlatformMismatchError(
                    f"this program is for platform {platform!r} but this process has the "
                    f"{_runtime.platform!r} plugin loaded ({_runtime.location.path}); a process "
                    "holds one plugin, so run it in another process (for example a Pool with "
                    f"platform={platform!r})"
                )
            return _runtime
        platform = platform or default_platform()
        location = find_plugin(platform)
        if location.kind is RuntimeKind.JAXLIB:
            _runtime = _jaxlib_runtime(location, deviceless)
            return _runtime
        facts = platform_named(platform)
        facts.before_load(location.path, deviceless=deviceless)
        logger.debug("loading PJRT plugin %s (%s)", location.path, location.source)
        options = dict(facts.client_options)
        devices = fixed_devices()
        loading = loading_environment(platform, deviceless)
        # The plugin reads XLA_FLAGS once, as it loads: JAX's semantics go in
        # then (worker.plugin.xla_flags), and the key sees the value the plugin saw.
        with xla_flags_added(semantic_flags(platform, location.path, _existing_memos)):
            environment = codegen_environment(flag_variables=facts.flag_variables)
            try:
                with STARTUP.time("plugin_load"), environment_variables(loading):
                    plugin = _pjrt.Plugin.load(location.path)
            except _pjrt.PluginLoadError as error:
                raise _pjrt.PluginLoadError(
                    f"{error} (found through {location.source}; set {env_var(platform)} to "
                    "another plugin library to use that instead)"
                ) from None
            except PjrtError as error:  # PJRT_Plugin_Initialize: libtpu's lock is one cause
                raise facts.unavailable(error) or error from None
            given = {} if devices is None else facts.device_settings(devices).create_options
            client = (
                None if deviceless else _open_client(facts, plugin, {**options, **given}, devices)
            )
        STARTUP.record("startup", platform=platform, plugin=location.path)
        _runtime = Runtime(
            location,
            plugin,
            client,
            client_options=options,
            codegen_environment=environment,
            deviceless=deviceless,
            devices=devices,
        )
        return _runtime


def _jaxlib_runtime(location: PluginLocation, deviceless: bool) -> Runtime:
    """The runtime of jaxlib's own client (worker.plugin.jaxlib_cpu): nothing is added to
    XLA_FLAGS, which jaxlib reads as JAX does, and its client is opened at once unless
    deviceless (a CPU's devices are the host's: nothing else can hold them)."""
    with STARTUP.time("plugin_load"):
        from worker.plugin.jaxlib_cpu.client import JaxlibPlugin

        plugin = JaxlibPlugin(location.path)
    facts = platform_named(location.platform)
    environment = codegen_environment(flag_variables=facts.flag_variables)
    devices = fixed_devices()
    client = None if deviceless else _open_client(facts, plugin, {}, devices)
    STARTUP.record("startup", platform=location.platform, plugin=location.path)
    return Runtime(
        location,
        plugin,
        client,
        codegen_environment=environment,
        deviceless=deviceless,
        devices=devices,
    )
