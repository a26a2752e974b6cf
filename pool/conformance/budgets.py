"""The error budgets of the battery, one per kind of computation, and why each is what it is.

Both sides compile the same StableHLO with XLA, so most results must agree
exactly; budgets are only as wide as two *correct* builds of XLA differ, and
far narrower than a miscompile (the default CPU plugin's arctan is off by up
to π, some 10^9 ULP). The widths come from measuring jax.jit
(jaxlib 0.10.2), lammps-jax-pjrt-cpu (XLA of jaxlib 0.11.2) and xla-cpu-pjrt
(an older XLA) against float64 / long-double references on 20,000 points
per function (tools/calibrate_budgets.py):

=================  =====  ======================================================
budget             ULPs   why
=================  =====  ======================================================
EXACT              0      IEEE-exact (+ - * / sqrt, rounding, min/max, fmod,
                          conversions), integers, logic, data movement,
                          sorting, random bits: there is one right answer
ELEMENTARY         16     exp, log, trig, hyperbolic functions, their inverses,
                          erf, cbrt, atan2, hypot: builds differ by up to 4 ULP,
                          and xla-cpu-pjrt's cbrt is 13 ULP from jax's (12 from
                          the true value); float64 log1p and arctanh: 256, since
                          jaxlib 0.10.2's are 41 and 129 ULP from the true value
                          (newer XLA: 2)
SPECIAL            64     lgamma, digamma, erf_inv, Bessel i0e/i1e, pow:
                          composite approximations; builds differ by up to 21
SUMMATION          64     reductions, cumulative sums, dot, einsum,
                          convolution: ULPs of the sum of the terms'
                          magnitudes (|A|·|B| for A·B), since the order of
                          summation may differ; far below the n·ε worst case,
                          measured at most 2
FFT                16     ULPs of the sum of |x|, which bounds every output;
                          measured below 1
LINALG             128    ULPs of the largest output element, on matrices with
                          condition number below about 10 (n = 16); measured
                          at most 6
LOOP               16     a loop of a few rounded steps: ULPs of the largest
                          output element
=================  =====  ======================================================

ULPs are of each output's own type. Per-element budgets of 16-bit and 8-bit
floats are at most 2 ULP (Budget.allowed): XLA computes their functions in
float32 and rounds, so correct builds differ by one rounding at most.

A miscompile that a budget catches and that pjrt-pool works around for a
particular build is listed, with its cases, reproduction and workaround, in
worker.plugin.known_builds (the one list; importable without JAX, for the warning
workers and manifest runs give).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pool.conformance.case import EXACT, Budget, Scale

ELEMENTARY = Budget(16, "elementary function: correct XLA builds differ by up to 13 ULP (cbrt)")
ELEMENTARY_LOOSE_F64 = Budget(
    16,
    "elementary function; in float64, jaxlib 0.10.2 is up to 129 ULP from the true value",
    float64_ulps=256,
)
SPECIAL = Budget(64, "special function: composite approximations, builds differ by up to 21 ULP")


def _magnitudes(array: np.ndarray) -> np.ndarray:
    """|array| as float64 (complex magnitudes for complex arrays)."""
    return np.abs(array.astype(np.complex128 if array.dtype.kind == "c" else np.float64))


def magnitude_scale(compute: Callable[..., Any]) -> Scale:
    """A scale from the inputs' magnitudes: compute(*|inputs| as float64) gives one per output.

    For a sum of terms, compute is the same sum of the terms' magnitudes
    (|A|@|B| for A@B), the bound of what rounding can do to the sum.
    """

    def scale(inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> Sequence[Any]:
        result = compute(*[_magnitudes(a) for a in inputs])
        return list(result) if isinstance(result, (tuple, list)) else [result] * len(outputs)

    return scale


def _largest(output: np.ndarray) -> float:
    values = _magnitudes(np.asarray(output))
    finite = values[np.isfinite(values)]
    return float(finite.max()) if finite.size and finite.max() > 0 else 1.0


def largest_output_scale(
    inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]
) -> list[float]:
    """A scale per output: its largest finite magnitude (norm-wise relative error)."""
    return [_largest(o) for o in outputs]


def summation(compute: Callable[..., Any]) -> Budget:
    """The budget of sums: 64 ULPs of the sum of the terms' magnitudes (compute gives it)."""
    return Budget(
        64,
        "sum of many terms: 64 ULPs of the sum of their magnitudes, as summation order may differ",
        magnitude_scale(compute),
    )


def fft(compute: Callable[..., Any]) -> Budget:
    """The budget of FFTs: 16 ULPs of the transform's bound (compute gives it: sum of |x|)."""
    return Budget(
        16, "FFT: 16 ULPs of the sum of |x|, which bounds every output", magnitude_scale(compute)
    )


LINALG = Budget(
    128,
    "linear algebra on well-conditioned inputs: 128 ULPs of the largest output element",
    largest_output_scale,
)
LOOP = Budget(
    16, "a loop of a few rounded steps: 16 ULPs of the largest output element", largest_output_scale
)

__all__ = [
    "ELEMENTARY",
    "ELEMENTARY_LOOSE_F64",
    "EXACT",
    "LINALG",
    "LOOP",
    "SPECIAL",
    "fft",
    "largest_output_scale",
    "magnitude_scale",
    "summation",
]
