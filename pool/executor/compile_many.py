"""compile_many, for a Pool and a ClusterPool alike, and CompileResult: what one compile gives."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future
from typing import Any, NamedTuple

from pool.errors import PoolError
from pool.progress import ProgressDisplay
from worker.errors import NeverCompileError
from worker.records import CompileStatistics, JaxCompile, LoweredProgram, ProgramSpec

Progress = Callable[[int, int, "ProgramSpec | BaseException"], None]
"""A compile_many progress callback: (done, total, ProgramSpec or exception)."""


class CompileCall(NamedTuple):
    """What submit_compile was asked for, as a pool's own _submit_compile takes it."""

    program: Any
    """The program, as the caller gave it (each pool checks it)."""
    name: str | None
    """The task's name (default: the program's)."""
    timeout: float | None
    """Seconds the compile may take in a worker (None: the pool's task_timeout)."""
    options: bytes | None
    """Serialized compile options in place of the program's own."""
    jax: JaxCompile | None = None
    """For JAX's own cache: JAX's key and what its value is made for (pool.jax_cache)."""


class CompileResult(NamedTuple):
    """What compiling one program in a worker gave."""

    spec: ProgramSpec
    """The program's record: name, platform, cache key, types."""

    statistics: CompileStatistics
    """Whether it was compiled or loaded from the disk cache, and the seconds it took."""

    phases: dict[str, float] | None = None
    """Seconds per phase in the worker (key, lookup, lock_wait, slot_wait, compile,
    serialize, publish: see worker.phases); None when the worker had it loaded."""


def compile_many(
    submit_compile: Callable[..., Any],
    programs: Iterable[LoweredProgram | tuple[str, LoweredProgram]],
    *,
    timeout: float | None = None,
    progress: bool | Progress | None = None,
    return_exceptions: bool = False,
) -> list[Any]:
    """Compiles programs with submit_compile (a Pool's or a ClusterPool's); see Pool.compile_many.

    submit_compile(program, name=, timeout=) returns a future of a
    CompileResult; a PoolError (closed, quarantined) or NeverCompileError
    (never-compile mode, and not in the cache) it raises stands for that
    program's outcome, as a failed compile's does.
    """
    names, futures = [], []
    for item in programs:
        # A LoweredProgram is a tuple too: test for it first.
        name, program = (None, item) if isinstance(item, LoweredProgram) else item
        names.append(name or program.name)
        try:
            future = submit_compile(program, name=name, timeout=timeout)
        except (PoolError, NeverCompileError) as refused:  # closed, quarantined, not cached
            future = Future()
            future.set_exception(refused)
        futures.append(future)
    if progress:
        _report_progress(names, futures, progress)
    results = []
    for future in futures:
        try:
            error = future.exception()
        except CancelledError as cancelled:
            error = cancelled
        results.append(error if error is not None else future.result().spec)
    if not return_exceptions:
        for result in results:
            if isinstance(result, BaseException):
                raise result
    return results


def _report_progress(names: list[str], futures: list[Any], progress: bool | Progress) -> None:
    """Reports each program as it finishes: a ProgressDisplay for True, else the callback."""
    display = ProgressDisplay(len(futures)) if progress is True else None
    done_count = itertools.count(1)
    lock = threading.Lock()

    def on_done(name: str, future: Any) -> None:
        error = future.exception()
        with lock:
            done = next(done_count)
            if display is None:
                assert callable(progress)
                progress(done, len(futures), error or future.result().spec)
                return
            if error is not None:
                display.update(name, "failed", 0.0, f"{type(error).__name__}: {error}")
            else:
                statistics = future.result().statistics
                outcome = "compiled" if statistics.compiled else "loaded"
                seconds = statistics.compile_seconds + statistics.load_seconds
                display.update(name, outcome, seconds)
            if done == len(futures):
                display.close()

    for name, future in zip(names, futures, strict=True):
        future.add_done_callback(lambda f, name=name: on_done(name, f))
