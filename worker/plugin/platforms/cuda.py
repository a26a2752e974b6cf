"""``cuda``: JAX's CUDA plugin, on NVIDIA GPUs.

- Plugin: ``jax-cuda13-pjrt``, else ``jax-cuda12-pjrt`` (``pjrt-pool[cuda13]``,
  ``pjrt-pool[cuda12]``). Before it loads, the NVIDIA libraries that pip
  installed (nvidia-*) for its CUDA version are loaded, so that it finds them
  without LD_LIBRARY_PATH.
- Client: no preallocation (jax_gpu.CLIENT_OPTIONS).
- Kernels: cuSOLVER, cuSPARSE and the rest from the jax-cuda plugin package of
  the plugin's CUDA version (jax_cuda12_plugin or jax_cuda13_plugin), never
  another's.
- Autotune results are shared by the pool's workers (checked on the CUDA plugin
  of jax 0.11.2); compiles take one slot per CORES_PER_GPU_COMPILE cores.
- Devices: a worker is given k GPUs by CUDA_VISIBLE_DEVICES, chosen among
  those this process sees.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
from pathlib import Path

from worker.log import get_logger
from worker.phases import STARTUP
from worker.plugin.platforms import jax_gpu
from worker.plugin.platforms.platform import (
    CompileSlots,
    DeviceSettings,
    Platform,
    PluginPackage,
    visible_devices_settings,
)

logger = get_logger("pjrt_pool.runtime")

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"

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

# What a CUDA client reports as its platform version: "cuda 13.0.0", or "cuda 12030" from older XLA.
_CUDA_PLATFORM_VERSION = re.compile(r"cuda\s+(\d+)(\.\d+)?")


def cuda_major(plugin_path: str) -> int | None:
    """Returns the CUDA major version a plugin's package names, or None.

    jax-cuda13-pjrt installs its plugin in a directory jax_plugins/xla_cuda13
    (13); a plugin elsewhere names none. The NVIDIA libraries to preload and
    the kernel package to register follow from it.
    """
    return jax_gpu.package_major(plugin_path, "cuda")


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


class Cuda(Platform):
    """JAX's CUDA plugin (see the module)."""

    __slots__ = ()

    name = "cuda"
    jax_names = ("cuda", "gpu")  # JAX lowers for "cuda"; its devices say "gpu"
    packages = (
        PluginPackage(
            "jax-cuda13-pjrt", "jax_plugins.xla_cuda13", "xla_cuda_plugin.so", "cuda13", True
        ),
        PluginPackage(
            "jax-cuda12-pjrt", "jax_plugins.xla_cuda12", "xla_cuda_plugin.so", "cuda12", True
        ),
    )
    client_options = jax_gpu.CLIENT_OPTIONS
    kernels = (jax_gpu.kernel_library("cu", "the jax-cuda plugin's cuSOLVER/cuSPARSE kernels"),)
    shares_autotune_results = True
    compile_slots = CompileSlots.PER_GPU_COMPILE

    def before_load(self, plugin_path: str, *, deviceless: bool) -> None:
        """Preloads the NVIDIA libraries of the plugin's CUDA version (see the module)."""
        with STARTUP.time("preload"):
            _preload_cuda_libraries(cuda_major(plugin_path))

    def kernel_package(self, plugin_path: str, platform_version: str | None) -> str | None:
        """The jax-cuda plugin package of the CUDA version the plugin was built for: its own
        package decides (jax-cuda13-pjrt, installed as jax_plugins/xla_cuda13, goes with
        jax_cuda13_plugin), else the CUDA version its client reports ("cuda 13.0.0").
        Kernels of another CUDA version must never be registered: they are built for
        another CUDA, and the plugin accepts a second handler for a target without a word,
        so which one ran would be left to the order of registration."""
        major = cuda_major(plugin_path)
        if major is None:
            match = _CUDA_PLATFORM_VERSION.match((platform_version or "").strip())
            if match is None:
                return None
            number = int(match.group(1))
            # "12030" (CUDART_VERSION) means 12.3; "13.0.0" and "13" mean 13.
            major = number if match.group(2) or number < 100 else number // 1000
        return f"jax_cuda{major}_plugin"

    def given_devices(self, count: int, first: int) -> DeviceSettings:
        """CUDA_VISIBLE_DEVICES (see the module)."""
        return visible_devices_settings(VISIBLE_DEVICES_ENV, count, first)


PLATFORM = Cuda()
