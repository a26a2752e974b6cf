"""The built-in battery: every case, in a stable order, and selecting cases by name."""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Sequence

from pool.conformance.case import Case
from pool.conformance.control import control_cases, random_cases
from pool.conformance.conversions import conversion_cases
from pool.conformance.elementwise import compare_cases, float_cases, integer_cases
from pool.conformance.linear import conv_cases, dot_cases, fft_cases, linalg_cases
from pool.conformance.reductions import cumulative_cases, reduction_cases
from pool.conformance.structure import indexing_cases, sort_cases

_FAMILIES = (
    float_cases,
    compare_cases,
    integer_cases,
    conversion_cases,
    reduction_cases,
    cumulative_cases,
    dot_cases,
    conv_cases,
    indexing_cases,
    sort_cases,
    fft_cases,
    control_cases,
    random_cases,
    linalg_cases,
)


@functools.cache
def battery() -> tuple[Case, ...]:
    """Returns every case of the battery, in the order of the report."""
    cases = tuple(case for family in _FAMILIES for case in family())
    names = [case.name for case in cases]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:  # a bug in the battery itself: names must identify cases
        raise AssertionError(f"the battery has duplicate case names: {duplicates}")
    return cases


def select(patterns: Sequence[str] | None) -> list[Case]:
    """Returns the cases whose names match any of the shell-style patterns (all for None).

    A pattern without wildcards also matches every case below it, so that
    ``elementwise/arctan`` selects ``elementwise/arctan/float32/n64`` and the
    rest of that operation. Raises ValueError naming a pattern that matches
    nothing.
    """
    cases = battery()
    if not patterns:
        return list(cases)
    chosen: dict[str, Case] = {}
    for pattern in patterns:
        matched = [
            case
            for case in cases
            if fnmatch.fnmatchcase(case.name, pattern)
            or fnmatch.fnmatchcase(case.name, pattern.rstrip("/") + "/*")
        ]
        if not matched:
            raise ValueError(
                f"no case matches {pattern!r}; names look like "
                "'elementwise/atan2_const1/float32/n64' (pjrt-pool check-plugin --list shows all)"
            )
        chosen.update((case.name, case) for case in matched)
    return [case for case in cases if case.name in chosen]
