"""``xla_cpu``: the second CPU plugin build, xla-cpu-pjrt, as a platform of its own.

``Pool(platform="xla_cpu")`` (``--platform xla_cpu``) loads xla-cpu-pjrt's
library (PJRT API 0.81, StableHLO 1.13.3) whichever CPU plugin ``pjrt_cpu``
finds first, beside a process or pool of another CPU runtime, without
PJRT_POOL_PLUGIN_CPU; PJRT_POOL_PLUGIN_XLA_CPU names another build of it.
Everything else is the ``pjrt_cpu`` platform's: the plugin reports itself as
"cpu", JAX lowers for "cpu", and it has the CPU's flags, kernels (jaxlib's
LAPACK, which its XLA FFI 0.2 refuses with FfiVersionError), host key part and
devices. Its keys say "xla_cpu", so its entries and the other CPU platforms'
stay apart even in one cache.
"""

from __future__ import annotations

from worker.plugin.platforms.cpu import XLA_CPU_PJRT
from worker.plugin.platforms.pjrt_cpu import PjrtCpu


class XlaCpu(PjrtCpu):
    """The pjrt_cpu platform, with only xla-cpu-pjrt to load (see the module)."""

    __slots__ = ()

    name = "xla_cpu"
    packages = (XLA_CPU_PJRT,)


PLATFORM = XlaCpu()
