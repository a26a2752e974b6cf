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
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker import _pjrt
from worker.cache.location import default_cache_dir
from worker.errors import (
    DeviceUnavailableError,
    PjrtError,
    PlatformMismatchError,
    TopologyError,
)
from worker.identity.environment import codegen_environment, host_cpu_features
from worker.log import get_logger
from worker.phases import STARTUP
from worker.plugin import libtpu
from worker.plugin.build_identity import plugin_build_sha256
from worker.plugin.locate import (
    PluginLocation,
    cuda_major,
    env_var,
    environment_variables,
    find_plugin,
)
from worker.plugin.topology import TopologySpec
from worker.plugin.xla_flags import semantic_flags, xla_flags_added

if TYPE_CHECKING:
    from worker.cache.memos import MemoStore

logger = get_logger("pjrt_pool.runtime")

PLATFORM_ENV = "PJRT_POOL_PLATFORM"
"""Names the platform to load when nothing else says which (default "cpu")."""

# The platform names XLA's FFI registry uses for each PJRT platform.
_FFI_PLATFORMS = {"cpu": "Host", "cuda": "CUDA", "rocm": "ROCM"}

# Create options per platform. GPU plugins preallocate 75% of device memory
# by default, which would starve every worker after the first.
_CLIENT_OPTIONS: dict[str, dict[str, Any]] = {
    "cuda": {"preallocate": False, "allocator": "default"},
    "rocm": {"preallocate": False, "allocator": "default"},
}

# NVIDIA libraries the CUDA plugin links against, by the pip package that ships
# them and the CUDA major version of that package (None: the package name is
# the same for both); preloaded so that the plugin finds them without
# LD_LIBRARY_PATH.
_CUDA_LIBRARIES = (
    ("cuda_runtime", "libcudart.so.*", 12),
    ("cu13", "libcudart.so.*", 13),
    ("cuda_nvrtc", "libnvrtc.so.*", 12),
    ("cu13", "libnvrtc.so.*", 13),
    ("cublas", "libcublasLt.so.*", 12),
    ("cublas", "libcublas.so.*", 12),
    ("cu13", "libcublasLt.so.*", 13),
    ("cu13", "libcublas.so.*", 13),
    ("nccl", "libnccl.so.*", None),
    ("cuda_cupti", "libcupti.so.*", 12),
    ("cu13", "libcupti.so.*", 13),
    ("cusparse", "libcusparse.so.*", 12),
    ("cusolver", "libcusolver.so.*", 12),
    ("cu13", "libcusparse.so.*", 13),
    ("cu13", "libcusolver.so.*", 13),
    ("cufft", "libcufft.so.*", 12),
    ("cu13", "libcufft.so.*", 13),
    ("nvshmem", "libnvshmem_host.so.*", None),
    ("cudnn", "libcudnn.so.*", None),
)


def _preload_cuda_libraries(major: int | None) -> None:
    """Loads the nvidia-* pip libraries of a CUDA major version (None: of every version).

    With both CUDA 12 and CUDA 13 libraries installed, loading both would put
    two CUDA runtimes into one process, and the plugin could bind to the
    wrong one: only the plugin's own version is loaded when it is known.
    """
    if not _has_nvidia():
        return  # CUDA from the system: the plugin finds it through the loader path
    for package, pattern, version in _CUDA_LIBRARIES:
        if major is not None and version is not None and version != major:
            continue
        spec = importlib.util.find_spec(f"nvidia.{package}")
        if spec is None or not spec.submodule_search_locations:
            continue
        for library in sorted(
            (Path(next(iter(spec.submodule_search_locations))) / "lib").glob(pattern)
        ):
            try:
                ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
            except OSError as error:  # a broken optional library; the plugin will say if it matters
                logger.debug("could not preload %s: %s", library, error)


def _has_nvidia() -> bool:
    try:
        return importlib.util.find_spec("nvidia") is not None
    except (ImportError, ValueError):
        return False


def _version(value: Any) -> str | None:
    if isinstance(value, tuple) and value:
        return ".".join(str(part) for part in value)
    return str(value) if value else None


class Runtime:
    """A loaded plugin and its client, for one platform."""

    # A plain class, not a dataclass: making a dataclass costs about 0.4 ms at import, on
    # the path of every serving process's start (scripts/bench_start.py).
    def __init__(
        self,
        location: PluginLocation,
        plugin: _pjrt.Plugin,
        client: _pjrt.Client | None,
        *,
        client_options: dict[str, Any] | None = None,
        codegen_environment: dict[str, Any] | None = None,
        deviceless: bool = False,
    ) -> None:
        self.location = location
        """Which plugin library was loaded, and why."""
        self.plugin = plugin
        """The native plugin handle."""
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

    def __repr__(self) -> str:
        return f"Runtime({self.location!r})"

    @property
    def client(self) -> _pjrt.Client:
        """The native client on the plugin's first device, opened on first use.

        Raises DeviceUnavailableError when the platform has no device here or
        another process holds it (libtpu names that process).
        """
        with self._making:
            if self._client is None:
                self._client = _open_client(self.platform, self.plugin, self.client_options)
            return self._client

    @property
    def has_client(self) -> bool:
        """Whether a client is open (a deviceless runtime has none until one is asked for)."""
        return self._client is not None

    def topology(self, spec: TopologySpec) -> _pjrt.Topology:
        """The plugin's topology for a spec, made once per process; opens no device.

        Raises TopologyError when the plugin cannot make it (a name it does
        not know, options that do not fit the name, a plugin without topologies).
        """
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
        """The plugin's PJRT C API version, "major.minor"."""
        major, minor = self.plugin.api_version
        return f"{major}.{minor}"

    @property
    def stablehlo_window(self) -> tuple[str | None, str | None]:
        """The (minimum, current) StableHLO versions the plugin reads, when it says."""
        attributes = self.plugin.attributes()
        return (
            _version(attributes.get("stablehlo_minimum_version")),
            _version(attributes.get("stablehlo_current_version")),
        )

    @property
    def ffi_platform(self) -> str:
        """The platform name XLA's FFI registry uses for this runtime ("Host", "CUDA")."""
        return _FFI_PLATFORMS.get(self.platform, self.platform.upper())

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
        passes the trust check; it is never created just for this).
        """
        return plugin_build_sha256(self.location.path, memos or _existing_memos)

    def identity(self) -> dict[str, Any]:
        """What an executable is tied to: plugin build, API version and, on CPU, host features."""
        identity: dict[str, Any] = {
            "platform": self.platform,
            "plugin_sha256": self.plugin_sha256(),
            "api_version": self.api_version,
        }
        if self.platform == "cpu":
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


_COMPILE_ONLY_ENVIRONMENT = {"tpu": libtpu.compile_only_environment}
"""Per platform, the variables a plugin loaded for deviceless compiles loads with."""


def _open_client(platform: str, plugin: _pjrt.Plugin, options: dict[str, Any]) -> _pjrt.Client:
    """Creates the client on the plugin's first device, saying clearly when there is none."""
    try:
        with STARTUP.time("client"):  # on a GPU, also the CUDA context and the allocator
            return _pjrt.Client(plugin, options)
    except PjrtError as error:
        raise _unavailable(platform, error) or error from None


def _unavailable(platform: str, error: Exception) -> DeviceUnavailableError | None:
    """The DeviceUnavailableError a failed plugin load or client creation means, if any."""
    message = str(error)
    if platform == "tpu" and libtpu.attached_chips() == 0:
        # Whatever libtpu says then (no device, or its lock taken by a process
        # whose JAX loaded it): there is no chip here to run on.
        return DeviceUnavailableError(
            f"no {platform} device is attached to this machine ({message}): compile for a "
            "topology without one (compile_program(..., topology='v5e:1x1'), "
            "Pool(topology=...), pjrt-pool warm --platform tpu --topology v5e:1x1) and run "
            "where the device is"
        )
    holder = libtpu.lock_holder(message)
    if platform == "tpu" and (holder is not None or "lockfile" in message):
        who = f"process {holder}" if holder is not None else "another process"
        return DeviceUnavailableError(
            f"the TPU of this host is held by {who} ({message}); one process at a time may "
            "hold a chip: end that process, or compile beside it without the chip "
            "(compile_program(..., topology=...), a Pool's compile workers)",
            holder=holder,
        )
    if "found no addressable device" in message:
        return DeviceUnavailableError(
            f"no {platform} device is attached to this machine ({message}); run where one is"
        )
    return None


def loading_environment(platform: str, deviceless: bool) -> dict[str, str]:
    """The variables a plugin of `platform` loads with: for deviceless use, those that keep it
    off the devices and their host lock (libtpu's), which it reads as it initializes."""
    compile_only = _COMPILE_ONLY_ENVIRONMENT.get(platform)
    return compile_only() if deviceless and compile_only is not None else {}


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
        if not deviceless and platform == "tpu" and libtpu.attached_chips() == 0:
            # Said at once: libtpu would poll a metadata server for minutes first.
            error = _unavailable(platform, RuntimeError("no TPU chip in /dev"))
            assert error is not None
            raise error
        if platform == "cuda":
            with STARTUP.time("preload"):
                _preload_cuda_libraries(cuda_major(location.path))
        logger.debug("loading PJRT plugin %s (%s)", location.path, location.source)
        options = dict(_CLIENT_OPTIONS.get(platform, {}))
        loading = loading_environment(platform, deviceless)
        # The plugin reads XLA_FLAGS once, as it loads: JAX's semantics go in
        # then (worker.plugin.xla_flags), and the key sees the value the plugin saw.
        with xla_flags_added(semantic_flags(platform, location.path, _existing_memos)):
            environment = codegen_environment(platform=platform)
            try:
                with STARTUP.time("plugin_load"), environment_variables(loading):
                    plugin = _pjrt.Plugin.load(location.path)
            except _pjrt.PluginLoadError as error:
                raise _pjrt.PluginLoadError(
                    f"{error} (found through {location.source}; set {env_var(platform)} to "
                    "another plugin library to use that instead)"
                ) from None
            except PjrtError as error:  # PJRT_Plugin_Initialize: libtpu's lock is one cause
                raise _unavailable(platform, error) or error from None
            client = None if deviceless else _open_client(platform, plugin, options)
        STARTUP.record("startup", platform=platform, plugin=location.path)
        _runtime = Runtime(
            location,
            plugin,
            client,
            client_options=options,
            codegen_environment=environment,
            deviceless=deviceless,
        )
        return _runtime
