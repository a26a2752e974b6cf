"""A conformance case: one small JAX program, its seeded inputs and its error budget."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Inputs = Callable[[np.random.Generator], list[np.ndarray]]
"""Makes a case's inputs from a random generator seeded by the case's name."""

Scale = Callable[[Sequence[np.ndarray], Sequence[np.ndarray]], Sequence[Any]]
"""Given (inputs, reference outputs), the magnitude each output's error is measured against."""


@dataclass(frozen=True)
class Budget:
    """How far a plugin's floating-point result may be from JAX's and still pass.

    ulps is the budget in units in the last place of the output's own type
    (0: bit-exact up to the sign of zero). Without a scale, the error of each
    element is measured in ULPs of the element itself (the distance between
    the two values along the type's ordered values). With a scale, it is
    |plugin - jax| / (eps * scale), eps being the spacing of the type at 1.0:
    a norm-wise measure for results that are sums of many terms (reductions,
    dot products, FFT, linear algebra), whose rounding error is bounded by
    the size of the terms, not of the result. Integers, booleans and the
    positions of NaN and infinities are always compared exactly.

    Per-element budgets of float types of 16 bits or fewer are at most
    NARROW_ULPS: XLA computes their functions in float32 and rounds, so
    correct implementations differ there by one rounding at most.
    """

    ulps: float = 0.0
    """Largest allowed error, in ULPs (per element, or of the scale)."""

    why: str = "exactly defined: correctly rounded or integer results"
    """The reason for this budget, shown in the documentation and the report."""

    scale: Scale | None = None
    """Magnitudes to measure errors against (norm-wise), or None (per element)."""

    float64_ulps: float | None = None
    """A different budget for float64 (and complex128) outputs, where one is needed."""

    def allowed(self, dtype: np.dtype) -> float:
        """The budget in ULPs for an output (or complex part) of this float dtype."""
        dtype = np.dtype(dtype)
        if dtype == np.float64 and self.float64_ulps is not None:
            return self.float64_ulps
        if self.scale is None and dtype.itemsize <= 2:
            return min(self.ulps, NARROW_ULPS)
        return self.ulps


NARROW_ULPS = 2.0
"""The most a per-element budget allows for float16, bfloat16 and the float8 types."""


EXACT = Budget()
"""Bit-exact (up to the sign of zero): integer, logical, data movement and IEEE-exact results."""


def shape_name(shape: tuple[int, ...]) -> str:
    """The size part of a case name: n1000 for a vector, 8x100 for more axes."""
    return f"n{shape[0]}" if len(shape) == 1 else "x".join(map(str, shape))


@dataclass(frozen=True)
class Case:
    """One program of the battery.

    name is stable and hierarchical, ``family/operation/dtype/size`` (for
    example ``elementwise/atan2_const1/float32/n64``); its first part is the
    op family the report summarizes by. function is traced by JAX (for the
    plugin through pool.lower, for the reference through jax.jit); inputs
    makes its arguments. x64 cases lower and run with jax_enable_x64 on.
    outputs names the function's outputs for the report when it has several.
    """

    name: str
    function: Callable[..., Any]
    inputs: Inputs
    budget: Budget = EXACT
    x64: bool = False
    outputs: tuple[str, ...] = field(default=())

    @property
    def family(self) -> str:
        """The op family: the first part of the name."""
        return self.name.split("/", 1)[0]

    def seed(self) -> int:
        """The seed of this case's inputs: a digest of its name, the same in every run."""
        return zlib.crc32(self.name.encode())

    def make_inputs(self) -> list[np.ndarray]:
        """Returns this case's inputs (the same on every call)."""
        return [np.asarray(a) for a in self.inputs(np.random.default_rng(self.seed()))]

    def output_name(self, index: int) -> str:
        """The name of an output, for the report: its label, or its index."""
        if index < len(self.outputs):
            return f"{index} ({self.outputs[index]})"
        return str(index)
