"""Timing helpers shared by the benchmarks (and the tests that time something).

Not a benchmark itself: the scripts import it from their own folder, the
tests through the path conftest.py gives them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def per_call(call: Callable[[], object], calls: int) -> float:
    """Seconds per call of `call`, over `calls` calls in a row."""
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def median_seconds(action: Callable[[int], object], rounds: int) -> float:
    """The median time of action(i) over rounds calls (i from 0)."""
    times = []
    for i in range(rounds):
        start = time.perf_counter()
        action(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
