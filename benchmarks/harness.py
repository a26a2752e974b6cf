"""The benchmarks' one harness: a baseline and its candidates, measured in turn, in one run.

A shared machine's speed drifts 2-3x between hours, and a busy neighbour
slows whatever runs beside it; a ratio between sides measured alternately in
the same run drifts much less. So every benchmark here names its sides, the
baseline first, and compare() measures each once per round, in turn, after
unrecorded warm-up rounds, the order rotating from round to round (so that no
side always follows the same one); report() prints each side's median and
its ratio against the baseline's median:

    samples = compare([Side("jax.jit", jitted), Side("Pool.run", pooled)], rounds=15)
    report(samples, "f(x) = x * 2 + 1, 16 MiB", goals={"Pool.run": 1.3})

A side's sample is the wall time of one call the harness times; or, for a
side that measures itself (measures=True), what its call returns: seconds (a
child process's own figure, a batch's time per call) or named figures (a
mapping of floats; "wall" is the one report() compares unless told another).

Run from the checkout, with pjrt-pool installed in the environment
(``pip install -e '.[cpu,test]'``): ``python benchmarks/NAME.py --help``.
The helpers below change one setting of the pool for one call, so that a
benchmark measures both settings in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

WALL = "wall"
"""The figure of a side that the harness times, or that returns seconds alone."""


@dataclass(frozen=True)
class Side:
    """One way of doing what a benchmark measures: its name and how to take one sample."""

    name: str
    call: Callable[[], Any]
    """One sample: the harness times the call (its wall seconds; what it returns is unused),
    unless `measures`."""
    measures: bool = False
    """Whether call measures itself: it returns seconds (a child's own figure, a batch's time
    per call), or figures by name (a mapping of floats, "wall" among them)."""


@dataclass
class Samples:
    """Every sample of every side, by side and figure, in the order compare() took them."""

    sides: list[str]
    """The sides' names, the baseline first."""

    values: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def add(self, side: str, sample: float | Mapping[str, float]) -> None:
        """Records one sample of side (seconds, or figures by name)."""
        figures = sample if isinstance(sample, Mapping) else {WALL: sample}
        for figure, value in figures.items():
            self.values.setdefault(side, {}).setdefault(figure, []).append(float(value))

    def of(self, side: str, figure: str = WALL) -> list[float]:
        """A side's samples of one figure."""
        return self.values[side][figure]

    def median(self, side: str, figure: str = WALL) -> float:
        """The median of a side's samples of one figure."""
        return statistics.median(self.of(side, figure))

    def ratio(self, side: str, baseline: str | None = None, figure: str = WALL) -> float:
        """A side's median against the baseline's (the first side's unless named)."""
        return self.median(side, figure) / self.median(baseline or self.sides[0], figure)

    def figures(self, side: str) -> list[str]:
        """The figures a side's samples carry."""
        return list(self.values.get(side, {}))


def compare(sides: Sequence[Side], rounds: int, *, warmup: int = 1) -> Samples:
    """Measures each side once per round, in turn, for `warmup` unrecorded rounds and then
    `rounds` recorded ones; round r starts with side r (mod the sides' count)."""
    if not sides or rounds < 1:
        raise ValueError("compare() needs at least one side and one round")
    samples = Samples([side.name for side in sides])
    for round_ in range(warmup + rounds):
        start = round_ % len(sides)
        for side in [*sides[start:], *sides[:start]]:
            sample = _measure(side)
            if round_ >= warmup:
                samples.add(side.name, sample)
    return samples


def _measure(side: Side) -> float | Mapping[str, float]:
    if side.measures:
        return side.call()
    start = time.perf_counter()
    side.call()
    return time.perf_counter() - start


def per_call(call: Callable[[], object], calls: int) -> float:
    """Seconds per call of `call`, over `calls` calls in a row (a side's sample of a batch)."""
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def median_per_call(call: Callable[[], object], calls: int) -> float:
    """The median seconds of `calls` calls of `call`, each timed alone (a sample of a batch
    whose slowest calls, a wake-up or another process's turn, the median leaves out)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6}


def report(
    samples: Samples,
    title: str,
    *,
    figure: str = WALL,
    unit: str = "ms",
    baseline: str | None = None,
    goals: Mapping[str, float] | None = None,
    sides: Iterable[str] | None = None,
) -> None:
    """Prints, under title, each side's median of figure (seconds, shown in unit; or another
    quantity with unit ""), and its ratio against the baseline's median, with the side's
    goal (the ratio it should stay within) where goals names one."""
    base = baseline or samples.sides[0]
    rounds = len(samples.of(base, figure))
    print(f"{title} (medians of {rounds} rounds, against {base})")
    against = samples.median(base, figure)
    for side in sides or samples.sides:
        ratio_line(side, samples.median(side, figure), against, unit, (goals or {}).get(side))


def ratio_line(
    label: str, value: float, baseline: float, unit: str = "ms", goal: float | None = None
) -> None:
    """Prints one side's figure and its ratio against a baseline figure (one a benchmark
    made of several sides' medians, such as a floor), with its goal if it has one."""
    scale = UNITS.get(unit, 1.0)
    against = f"{value / baseline:7.3f}x" if baseline else "      -"
    verdict = ""
    if goal is not None:
        verdict = f"  goal {goal:g}x: {'met' if value / baseline <= goal else 'NOT met'}"
    print(f"  {label:<42} {_number(value * scale):>10} {unit:<3} {against}{verdict}")


def _number(value: float) -> str:
    """A figure to about four significant digits, never in exponent form."""
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def with_environment(variable: str, value: str, call: Callable[[], T]) -> T:
    """call() with one environment variable set for its duration (a setting that the pool
    reads call by call, such as PJRT_POOL_COPY_THREADS), then restored."""
    before = os.environ.get(variable)
    os.environ[variable] = value
    try:
        return call()
    finally:
        if before is None:
            del os.environ[variable]
        else:
            os.environ[variable] = before


def with_plain_copies(call: Callable[[], T]) -> T:
    """call() with the pool's large copies into shared memory made plainly (numpy's copy,
    through the caches) instead of streamed around them (`_pjrt.stream_copy`)."""
    from pool.executor import copier

    native = copier._pjrt
    copier._pjrt = _PlainCopies  # type: ignore[assignment]
    try:
        return call()
    finally:
        copier._pjrt = native


class _PlainCopies:
    """What with_plain_copies puts where the Copier finds `_pjrt`: a plain stream_copy."""

    @staticmethod
    def stream_copy(destination: np.ndarray, source: np.ndarray) -> None:
        np.copyto(destination, source)


def cluster_arguments(
    description: str, parts: str, argv: list[str] | None
) -> tuple[argparse.Namespace, set[str]]:
    """The command line of a cluster benchmark (Dask's, Ray's): which parts to measure, the
    rounds of each, the tiny runs per round; returns the arguments and the parts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--parts", default=parts, help=f"comma-separated (default: {parts})")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of each part")
    parser.add_argument("--runs", type=int, default=2000, help="tiny runs per round")
    args = parser.parse_args(argv)
    return args, set(args.parts.split(","))
