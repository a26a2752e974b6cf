"""``cpu``: the host's own cores, on the installed jaxlib's own CPU client.

- Runtime: jaxlib's CPU client (worker.plugin.jaxlib_cpu), the XLA that
  ``jax.jit`` runs on, so that programs give jax.jit's numbers bit for bit.
  A CPU PJRT plugin is another build of XLA (lammps-jax-pjrt-cpu is jaxlib
  0.11.2's), whose last bits differ for matrix products and convolutions:
  ``pjrt_cpu`` (worker.plugin.platforms.pjrt_cpu) and ``xla_cpu`` run those by
  name, and ``PJRT_POOL_PLUGIN_CPU`` makes this platform load the library it
  names instead.
- Kernels: jaxlib's LAPACK kernels (``jaxlib.cpu``), for ``jnp.linalg``.
- Flags: both CPU plugins default to XLA's fast min/max, which returns x for
  max(x, NaN) where JAX returns NaN; ``xla_cpu_enable_fast_min_max=false``
  makes them compute what JAX computes (worker.plugin.xla_flags). jaxlib's
  own client takes no flags from pjrt-pool: it reads XLA_FLAGS as JAX does.
- Keys: the host's CPU features, since XLA:CPU compiles for the host's
  instruction set and a plugin refuses an executable built for other features.
- Devices: jaxlib's client has as many devices as JAX's CPU client has here
  (worker.plugin.jaxlib_cpu.client.jax_devices), or as many as a program over
  several devices needs. A CPU plugin's client has DEFAULT_DEVICES devices of
  its own, made of the host's cores (4 on both CPU plugins: docs/facts.md);
  a worker that needs more is given them by the plugin's create option
  ``cpu_device_count`` (which is no part of a key: a program compiles alike on
  a client of any count, and a program over several devices says its devices
  in its compile options); up to 4 need nothing, so that a client is made as
  it always was. There are no host devices to choose among, so ``first``
  changes nothing.
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
    """The host's CPU (see the module)."""

    __slots__ = ()

    name = "cpu"
    jax_names = ("cpu",)
    runs_on_jaxlib = True
    kernels = (KernelLibrary((b"lapack_",), (("_lapack", False),), "jaxlib's LAPACK kernels"),)
    jax_semantics = MappingProxyType({"xla_cpu_enable_fast_min_max": "false"})
    platform_parts = frozenset({PlatformPart.HOST})
    devices_on_demand = True

    @property
    def ffi_name(self) -> str:
        """XLA's FFI registry calls the CPU "Host"."""
        return "Host"

    def kernel_package(self, plugin_path: str, platform_version: str | None) -> str | None:
        """jaxlib's: every CPU runtime's kernels are the installed jaxlib's."""
        return "jaxlib.cpu"

    def given_devices(self, count: int, first: int) -> DeviceSettings:
        """cpu_device_count devices, where a plugin's default are too few (see the module)."""
        if count <= DEFAULT_DEVICES:
            return NO_SETTINGS
        return DeviceSettings(
            MappingProxyType({DEVICE_COUNT_OPTION: count}), NO_SETTINGS.environment
        )


PLATFORM = Cpu()
