"""Comparing a plugin's outputs with JAX's: exact for integers, ULP budgets for floats.

Integers and booleans must be equal. For floating-point outputs (complex
ones part by part), NaN must be where JAX has NaN and infinities must be
equal, and elsewhere the error must be within the case's Budget: ULPs of the
element (the distance along the type's ordered values, so that -0 and +0 are
0 apart and the largest finite value is 1 from infinity, which the infinity
check catches) or, with a scale, ULPs of that magnitude.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pool.conformance.case import Budget, Case
from pool.conformance.inputs import finfo, is_float


@dataclass
class Element:
    """One element of an output: where it is, the inputs there, and both results."""

    index: list[int]
    """Its index in the output (row-major)."""

    got: str
    """The plugin's value."""

    expected: str
    """JAX's value."""

    inputs: list[str] = field(default_factory=list)
    """The inputs' values at the same index, for inputs of the output's shape (or scalars)."""

    error: float = 0.0
    """Its error: ULPs for floats (inf for a NaN or infinity mismatch), absolute for integers."""


@dataclass
class OutputComparison:
    """How one output of a case compares with JAX's."""

    output: str
    """The output's index (and label)."""

    ok: bool
    """True when the output is within the budget."""

    budget: float = 0.0
    """The budget this output was held to, in ULPs (0 for integers and booleans)."""

    max_error: float = 0.0
    """Largest error where both are finite: ULPs for floats, absolute for integers."""

    max_abs_error: float = 0.0
    """Largest absolute difference where both are finite."""

    bad: int = 0
    """How many elements are outside the budget (NaN and infinity mismatches included)."""

    nan_mismatches: int = 0
    """Elements that are NaN on one side only."""

    inf_mismatches: int = 0
    """Elements that are infinite on one side at least, and differ."""

    first: Element | None = None
    """The first element outside the budget."""

    worst: Element | None = None
    """The element with the largest finite error, when it is outside the budget."""

    identical: bool = False
    """True when the output is jax.jit's bit for bit (every byte equal: NaN payloads too)."""

    problem: str = ""
    """"shape" or "dtype" when the outputs cannot be compared element by element."""

    got_type: str = ""
    """The plugin's shape or dtype, for those problems."""

    expected_type: str = ""
    """JAX's shape or dtype, for those problems."""


def _sign_magnitude(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sign bits and the other bits (as int64) of floats: their order within a sign."""
    bits = values.view(f"u{values.dtype.itemsize}")
    if np.dtype(values.dtype).name == "float8_e8m0fnu":
        return np.zeros(bits.shape, bool), bits.astype(np.int64)  # no sign bit
    width = values.dtype.itemsize * 8
    negative = (bits >> (width - 1)).astype(bool)
    return negative, (bits & bits.dtype.type((1 << (width - 1)) - 1)).astype(np.int64)


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How many representable values apart a and b are (float64; -0 and +0 are 0 apart)."""
    negative_a, magnitude_a = _sign_magnitude(a)
    negative_b, magnitude_b = _sign_magnitude(b)
    same_sign = np.abs(magnitude_a - magnitude_b).astype(np.float64)  # exact in int64
    across_zero = magnitude_a.astype(np.float64) + magnitude_b.astype(np.float64)
    return np.where(negative_a == negative_b, same_sign, across_zero)


def _float_errors(
    got: np.ndarray, expected: np.ndarray, budget: Budget, scale: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per element of a real float output: error, absolute error, NaN and infinity mismatches."""
    nan_got, nan_expected = np.isnan(got), np.isnan(expected)
    inf_got, inf_expected = np.isinf(got), np.isinf(expected)
    nan_bad = nan_got != nan_expected
    inf_bad = ~nan_bad & ~nan_got & (inf_got | inf_expected) & (got != expected)
    finite = ~(nan_got | nan_expected | inf_got | inf_expected)
    wide_got, wide_expected = got.astype(np.float64), expected.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf where not finite: masked
        absolute = np.where(finite, np.abs(wide_got - wide_expected), 0.0)
    if scale is None:
        error = np.where(finite, ulp_distance(got, expected), 0.0)
    else:
        unit = float(finfo(got.dtype).eps) * np.broadcast_to(np.abs(scale), got.shape)
        with np.errstate(divide="ignore", invalid="ignore"):
            error = np.where(absolute == 0, 0.0, absolute / unit)
    return error, absolute, nan_bad, inf_bad


def _show(array: np.ndarray, index: tuple[int, ...]) -> str:
    return str(array[index])


def _element(
    index: tuple[int, ...],
    inputs: Sequence[np.ndarray],
    got: np.ndarray,
    expected: np.ndarray,
    error: float,
) -> Element:
    return Element(
        [int(i) for i in index],
        _show(got, index),
        _show(expected, index),
        [
            _show(a, index) if a.shape == got.shape else _show(a, ())
            for a in inputs
            if a.shape == got.shape or a.ndim == 0
        ],
        float(error),
    )


def compare_output(
    case: Case,
    position: int,
    inputs: Sequence[np.ndarray],
    got: np.ndarray,
    expected: np.ndarray,
    scale: Any = None,
) -> OutputComparison:
    """Compares one output of a case; scale is the budget's magnitude for this output."""
    name = case.output_name(position)
    for problem, mine, theirs in (
        ("shape", got.shape, expected.shape),
        ("dtype", got.dtype, expected.dtype),
    ):
        if mine != theirs:
            return OutputComparison(
                name, False, problem=problem, got_type=str(mine), expected_type=str(theirs)
            )
    parts = (
        [(got.real, expected.real), (got.imag, expected.imag)]
        if got.dtype.kind == "c"
        else [(got, expected)]
    )
    error = np.zeros(got.shape)
    absolute = np.zeros(got.shape)
    nan_bad = np.zeros(got.shape, dtype=bool)
    inf_bad = np.zeros(got.shape, dtype=bool)
    for part_got, part_expected in parts:
        if is_float(part_got.dtype):
            part_error, part_absolute, part_nan, part_inf = _float_errors(
                # Not np.ascontiguousarray: it makes scalars 1-d.
                np.asarray(part_got, order="C"),
                np.asarray(part_expected, order="C"),
                case.budget,
                scale,
            )
            nan_bad |= part_nan
            inf_bad |= part_inf
        else:  # integers and booleans: exact
            part_absolute = np.abs(part_got.astype(np.float64) - part_expected.astype(np.float64))
            part_error = np.where(part_got != part_expected, np.maximum(part_absolute, 1.0), 0.0)
        error, absolute = np.maximum(error, part_error), np.maximum(absolute, part_absolute)
    part_type = got.real.dtype
    budget = case.budget.allowed(part_type) if is_float(part_type) else 0.0
    over = error > budget
    bad = over | nan_bad | inf_bad
    comparison = OutputComparison(
        name,
        not bad.any(),
        identical=bit_identical(got, expected),
        budget=budget,
        max_error=float(error.max()) if error.size else 0.0,
        max_abs_error=float(absolute.max()) if absolute.size else 0.0,
        bad=int(bad.sum()),
        nan_mismatches=int(nan_bad.sum()),
        inf_mismatches=int(inf_bad.sum()),
    )
    if bad.any():
        first = tuple(np.argwhere(bad)[0])
        flagged = np.where(nan_bad | inf_bad, np.inf, error)
        comparison.first = _element(first, inputs, got, expected, flagged[first])
        if over.any():
            worst = np.unravel_index(int(np.argmax(error)), error.shape)
            comparison.worst = _element(worst, inputs, got, expected, error[worst])
    return comparison


def bit_identical(got: np.ndarray, expected: np.ndarray) -> bool:
    """Whether two arrays of one shape and dtype hold the same bytes."""
    return bool(
        np.array_equal(
            np.ascontiguousarray(got).reshape(-1).view(np.uint8),
            np.ascontiguousarray(expected).reshape(-1).view(np.uint8),
        )
    )


def compare_case(
    case: Case,
    inputs: Sequence[np.ndarray],
    got: Sequence[np.ndarray],
    expected: Sequence[np.ndarray],
) -> list[OutputComparison]:
    """Compares every output of a case with JAX's (the lists must be of equal length)."""
    scales: Sequence[Any] = [None] * len(expected)
    if case.budget.scale is not None:
        scales = case.budget.scale(inputs, expected)
    return [
        compare_output(case, i, inputs, np.asarray(g), np.asarray(e), s)
        for i, (g, e, s) in enumerate(zip(got, expected, scales, strict=True))
    ]
