"""``rocm``: JAX's ROCm plugin, on AMD GPUs.

Not run here (no AMD GPU, no ROCm plugin installed in CI): what follows is
read off jax's own packaging (jax_plugins/rocm, jaxlib's plugin_support) and
the XLA GPU client it shares with CUDA.

- Plugin: ``jax-rocm7-pjrt``, else ``jax-rocm60-pjrt`` (the ROCm plugins
  jaxlib knows, newest first), each installing ``xla_rocm_plugin.so`` in
  ``jax_plugins/xla_rocmN``. ROCm's own libraries come from the system
  (/opt/rocm), where the plugin finds them: nothing is preloaded.
- Client: no preallocation, as for CUDA (jax_gpu.CLIENT_OPTIONS).
- Kernels: hipSOLVER, hipSPARSE and the rest from the jax-rocm plugin package
  (jax_rocm7_plugin or jax_rocm60_plugin) that the plugin's own package
  directory names; for a plugin elsewhere none is registered (which ROCm
  version its client reports is not known here, so nothing is guessed).
- Autotune results are not shared: XLA's flag is the same as for CUDA, but
  sharing is left off until it is checked on a ROCm plugin. Compiles take one
  slot per CORES_PER_GPU_COMPILE cores, as for CUDA.
- Devices: a worker is given k GPUs by HIP_VISIBLE_DEVICES, chosen among those
  this process sees. HIP_VISIBLE_DEVICES, not ROCR_VISIBLE_DEVICES: HIP counts
  its devices among those ROCR_VISIBLE_DEVICES leaves, so a selection of this
  process's ROCR_VISIBLE_DEVICES stays in force beneath it.
"""

from __future__ import annotations

from worker.plugin.platforms import jax_gpu
from worker.plugin.platforms.platform import (
    CompileSlots,
    DeviceSettings,
    Platform,
    PluginPackage,
    visible_devices_settings,
)

VISIBLE_DEVICES_ENV = "HIP_VISIBLE_DEVICES"


class Rocm(Platform):
    """JAX's ROCm plugin (see the module)."""

    __slots__ = ()

    name = "rocm"
    jax_names = ("rocm", "gpu")  # JAX lowers for "rocm"; its devices say "gpu"
    packages = (
        PluginPackage("jax-rocm7-pjrt", "jax_plugins.xla_rocm7", "xla_rocm_plugin.so", None, True),
        PluginPackage(
            "jax-rocm60-pjrt", "jax_plugins.xla_rocm60", "xla_rocm_plugin.so", None, True
        ),
    )
    client_options = jax_gpu.CLIENT_OPTIONS
    kernels = (jax_gpu.kernel_library("hip", "the jax-rocm plugin's hipSOLVER/hipSPARSE kernels"),)
    compile_slots = CompileSlots.PER_GPU_COMPILE

    @property
    def ffi_name(self) -> str:
        """XLA's FFI registry calls it "ROCM"."""
        return "ROCM"

    def kernel_package(self, plugin_path: str, platform_version: str | None) -> str | None:
        """The jax-rocm plugin package its package directory names (jax_plugins/xla_rocm7:
        jax_rocm7_plugin), else None (see the module)."""
        major = jax_gpu.package_major(plugin_path, "rocm")
        return None if major is None else f"jax_rocm{major}_plugin"

    def given_devices(self, count: int, first: int) -> DeviceSettings:
        """HIP_VISIBLE_DEVICES (see the module)."""
        return visible_devices_settings(VISIBLE_DEVICES_ENV, count, first)


PLATFORM = Rocm()
