"""jax.jit's answer for a case, on JAX's device for the platform.

The reference process (reference_child.py) computes them, one process for the
whole battery, restarted after a crash or hang (reference_side.py): never the
checking process itself, which a case that aborts JAX's backend would take down.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from pool.conformance.case import Case
from worker.plugin.platforms.registry import platform_named


def reference(case: Case, inputs: Sequence[np.ndarray], device: Any) -> list[np.ndarray]:
    """jax.jit's outputs of a case's function on a device."""
    placed = [jax.device_put(a, device) for a in inputs]
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.jit(case.function)(*placed))]


def reference_device(platform: str) -> Any:
    """JAX's own device for the platform if it has one (by any of its JAX names), else its
    CPU."""
    for name in platform_named(platform).jax_names:
        with contextlib.suppress(RuntimeError):
            return jax.devices(name)[0]
    return jax.devices("cpu")[0]
