"""What JAX's two GPU plugins have in common (cuda.py and rocm.py use it).

jax builds its CUDA and ROCm plugins from one XLA GPU client and lays their
packages out the same way: the PJRT plugin in ``jax_plugins/xla_<stem>N``
(N the CUDA or ROCm major version: ``xla_cuda13``, ``xla_rocm7``) and the
kernels in ``jax_<stem>N_plugin``, whose modules name their targets with the
platform's prefix (``cu`` or ``hip``: ``cusolver_getrf_ffi``,
``hipsolver_getrf_ffi``).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType

from worker.plugin.platforms.platform import KernelLibrary

CLIENT_OPTIONS = MappingProxyType({"preallocate": False, "allocator": "default"})
"""XLA's GPU client preallocates 75% of device memory by default, which would starve every
worker after the first."""

KERNEL_MODULES = (
    ("_solver", False),
    ("_hybrid", True),
    ("_linalg", True),
    ("_prng", False),
    ("_sparse", False),
)
"""The kernel package's modules JAX lowers to, each with whether all its targets are FFI:
_linalg (cu_lu_pivots_to_permutation) and _hybrid (cuhybrid_eig_*) name FFI targets without
the "_ffi" suffix; the other modules use it."""

_TARGET_KINDS = ("solver_", "blas_", "_", "sparse_", "hybrid_")
"""What follows the prefix in the kernels' target names (cusolver_, cublas_, cu_, ...)."""


def kernel_library(prefix: str, description: str) -> KernelLibrary:
    """The kernel library of a JAX GPU plugin whose targets start with `prefix` ("cu")."""
    markers = tuple(f"{prefix}{kind}".encode() for kind in _TARGET_KINDS)
    return KernelLibrary(markers, KERNEL_MODULES, description)


def package_major(plugin_path: str, stem: str) -> int | None:
    """The major version a plugin's package directory names (jax_plugins/xla_cuda13 for stem
    "cuda": 13), or None for a plugin elsewhere."""
    pattern = re.compile(rf"xla_{stem}(\d+)")
    for part in reversed(Path(plugin_path).parts[:-1]):
        match = pattern.fullmatch(part)
        if match:
            return int(match.group(1))
    return None
