"""``pjrt_cpu``: the host's CPU on XLA's CPU PJRT plugin, by name.

``Pool(platform="pjrt_cpu")`` (``--platform pjrt_cpu``) runs programs on a
CPU PJRT plugin through the native module, as the ``cpu`` platform did before
it ran on jaxlib's own client: ``lammps-jax-pjrt-cpu`` (the extra
``pjrt-pool[cpu]``; XLA of jaxlib 0.11.2), else ``xla-cpu-pjrt`` (PJRT API
0.81); PJRT_POOL_PLUGIN_PJRT_CPU names another. A plugin is another build of
XLA than the installed jaxlib's unless built from it, so its results may
differ from jax.jit's in the last bits (``pjrt-pool check-plugin --platform
pjrt_cpu --exact`` counts where). Everything else is the ``cpu`` platform's:
JAX lowers for "cpu", and it has the CPU's flags, kernels, host key part and
devices. Its keys say "pjrt_cpu", so its entries and the ``cpu`` platform's
stay apart even in one cache.
"""

from __future__ import annotations

from worker.plugin.platforms.cpu import LAMMPS_JAX_PJRT_CPU, XLA_CPU_PJRT, Cpu


class PjrtCpu(Cpu):
    """The cpu platform on a PJRT plugin (see the module)."""

    __slots__ = ()

    name = "pjrt_cpu"
    runs_on_jaxlib = False
    packages = (LAMMPS_JAX_PJRT_CPU, XLA_CPU_PJRT)


PLATFORM = PjrtCpu()
