"""``cpu``: XLA's CPU plugin, the host's own cores.

- Plugin: ``lammps-jax-pjrt-cpu`` (the extra ``pjrt-pool[cpu]``; XLA of
  jaxlib 0.11.2), else ``xla-cpu-pjrt`` (PJRT API 0.81).
- Kernels: jaxlib's LAPACK kernels (``jaxlib.cpu``), for ``jnp.linalg``.
- Flags: both CPU plugins default to XLA's fast min/max, which returns x for
  max(x, NaN) where JAX returns NaN; ``xla_cpu_enable_fast_min_max=false``
  makes them compute what JAX computes (worker.plugin.xla_flags).
- Keys: the host's CPU features, since XLA:CPU compiles for the host's
  instruction set and a plugin refuses an executable built for other features.
- Devices: a CPU client has DEFAULT_DEVICES devices of its own, made of the
  host's cores (4 on both CPU plugins: docs/facts.md). A worker that needs more is
  given them by the plugin's create option ``cpu_device_count`` (which is no
  part of a key: a program compiles alike on a client of any count, and a
  program over several devices says its devices in its compile options); up to
  4 need nothing, so that a client is made as it always was. There are no
  host devices to choose among, so ``first`` changes nothing.
"""

from __future__ import annotations

from types import MappingProxyType

from worker.identity.keys import PlatformPart
from worker.plugin.platforms.platform import (
    NO_SETTINGS,
    DeviceSettings,
    KernelLibrary,
    Platform,
    PluginPackage,
)

DEVICE_COUNT_OPTION = "cpu_device_count"
"""The CPU plugin's create option: how many devices its client has."""

DEFAULT_DEVICES = 4
"""The devices of a CPU client made without DEVICE_COUNT_OPTION, on both CPU plugins
(docs/facts.md, "Devices")."""

LAMMPS_JAX_PJRT_CPU = PluginPackage(
    "lammps-jax-pjrt-cpu",
    "lammps_jax_pjrt_cpu",
    "pjrt_c_api_cpu_plugin.so",
    "cpu",
    versioned_as_jax=True,
)
XLA_CPU_PJRT = PluginPackage(
    "xla-cpu-pjrt", "xla_plugins.xla_cpu_pjrt", "xla_cpu_pjrt.so", None, versioned_as_jax=False
)


class Cpu(Platform):
    """XLA's CPU plugin (see the module)."""

    __slots__ = ()

    name = "cpu"
    jax_names = ("cpu",)
    packages = (LAMMPS_JAX_PJRT_CPU, XLA_CPU_PJRT)
    kernels = (KernelLibrary((b"lapack_",), (("_lapack", False),), "jaxlib's LAPACK kernels"),)
    jax_semantics = MappingProxyType({"xla_cpu_enable_fast_min_max": "false"})
    platform_parts = frozenset({PlatformPart.HOST})
    devices_on_demand = True

    @property
    def ffi_name(self) -> str:
        """XLA's FFI registry calls the CPU "Host"."""
        return "Host"

    def kernel_package(self, plugin_path: str, platform_version: str | None) -> str | None:
        """jaxlib's: every CPU plugin's kernels are the installed jaxlib's."""
        return "jaxlib.cpu"

    def given_devices(self, count: int, first: int) -> DeviceSettings:
        """cpu_device_count devices, where the default's are too few (see the module)."""
        if count <= DEFAULT_DEVICES:
            return NO_SETTINGS
        return DeviceSettings(
            MappingProxyType({DEVICE_COUNT_OPTION: count}), NO_SETTINGS.environment
        )


PLATFORM = Cpu()
