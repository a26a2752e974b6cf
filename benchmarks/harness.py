"""Timing helpers shared by the benchmarks, which import it from their own folder."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


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


def copy_threads_variable() -> str | None:
    """PJRT_POOL_COPY_THREADS in a tree whose pool spreads large copies over threads (so
    a benchmark can set it to 1 for the same call on one thread); None in older trees."""
    try:
        from pool.executor.copier import COPY_THREADS_VARIABLE
    except ImportError:
        return None
    return COPY_THREADS_VARIABLE


def with_plain_copies(call: Callable[[], T]) -> T:
    """call() with the pool's large copies into shared memory made plainly (numpy's copy,
    through the caches) where the tree streams them (`_pjrt.stream_copy`), so that a
    benchmark measures both in the same run; a tree that does not stream runs call()."""
    if not streams_copies():
        return call()
    from pool.executor import copier

    native = copier._pjrt
    copier._pjrt = _PlainCopies  # type: ignore[assignment]
    try:
        return call()
    finally:
        copier._pjrt = native


def streams_copies() -> bool:
    """Whether this tree's pool streams its large copies (with_plain_copies has a side)."""
    try:
        from pool.executor import copier
    except ImportError:
        return False
    return hasattr(getattr(copier, "_pjrt", None), "stream_copy")


class _PlainCopies:
    """What with_plain_copies puts where the Copier finds `_pjrt`: a plain stream_copy."""

    @staticmethod
    def stream_copy(destination: np.ndarray, source: np.ndarray) -> None:
        np.copyto(destination, source)


@contextlib.contextmanager
def marked(steps: Sequence[tuple[Any, str]], marks: dict[str, int]) -> Iterator[None]:
    """Within the block, each (owner, name) of `steps` is wrapped so that its first call
    since `marks` was last cleared notes when it started and ended ("NAME start", "NAME
    end", time.perf_counter_ns): where a call's time went, split at those steps. The
    originals are back once the block ends."""
    originals = [(owner, name, getattr(owner, name)) for owner, name in steps]

    def marking(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            marks.setdefault(name + " start", time.perf_counter_ns())
            try:
                return original(*args, **kwargs)
            finally:
                marks.setdefault(name + " end", time.perf_counter_ns())

        return call

    try:
        for owner, name, original in originals:
            setattr(owner, name, marking(name, original))
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
