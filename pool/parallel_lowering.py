"""Lowering many programs, overlapped with compiling and optionally in parallel.

Lowering costs about a quarter of compiling, so with several compile workers
a parent that lowers one program after another becomes the bottleneck. A
Lowerer lowers in a background thread of this process (processes=0), so that
lowering overlaps compiling, or in N extra processes that receive each
function through cloudpickle. Those are fresh interpreters (spawned, never
forked from a parent that imported JAX) that import JAX once each.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import cloudpickle

from pool.lowering import lower
from pool.spec import WarmProgram
from worker.records import LoweredProgram

Lowered = tuple[LoweredProgram, float]
"""A lowered program and the seconds its lowering took."""

OnLowered = Callable[[int, "Future[Lowered]"], None]


def _lower_pickled(payload: bytes) -> Lowered:
    """Runs in a lowering process: unpickles (function, shapes, platform, calls) and lowers."""
    started = time.perf_counter()
    function, shapes, platform, custom_calls = cloudpickle.loads(payload)
    program = lower(function, shapes, platform=platform, custom_calls=custom_calls)
    return program, time.perf_counter() - started


def _lower_one(program: WarmProgram, platform: str | None) -> LoweredProgram:
    if program.lowered is not None:
        return program.lowered
    assert program.function is not None
    return lower(
        program.function,
        program.shapes,
        platform=program.platform or platform,
        custom_calls=tuple(program.custom_calls),
    )


class Lowerer:
    """Lowers WarmPrograms in a background thread or in `processes` spawned processes."""

    def __init__(self, processes: int = 0, platform: str | None = None) -> None:
        if processes < 0:
            raise ValueError(f"lowering processes cannot be negative: {processes}")
        self._platform = platform
        self._stopped = threading.Event()
        self._executor: ProcessPoolExecutor | None = None
        if processes:
            self._executor = ProcessPoolExecutor(
                processes, mp_context=multiprocessing.get_context("spawn")
            )

    def lower_all(
        self, programs: list[WarmProgram], on_lowered: OnLowered
    ) -> threading.Thread | None:
        """Starts lowering every program; calls on_lowered(index, future) as each finishes.

        Each future's result is (LoweredProgram, seconds spent lowering it).

        In-process lowering runs in a returned thread (join it to wait);
        with processes, the callbacks come from the executor's thread.
        """
        if self._executor is None:
            thread = threading.Thread(
                target=self._lower_serially,
                args=(programs, on_lowered),
                name="pjrt-pool-lowering",
                daemon=True,
            )
            thread.start()
            return thread
        for module in {sys.modules.get(getattr(p.function, "__module__", "")) for p in programs}:
            if module is not None and module.__name__ not in ("__main__", "builtins"):
                # Spec modules are not importable in the lowering processes:
                # send their functions by value.
                cloudpickle.register_pickle_by_value(module)
        for index, program in enumerate(programs):
            future: Future[Lowered]
            if program.lowered is not None:
                future = Future()
                future.set_result((program.lowered, 0.0))
            else:
                payload = cloudpickle.dumps(
                    (
                        program.function,
                        list(program.shapes),
                        program.platform or self._platform,
                        tuple(program.custom_calls),
                    )
                )
                future = self._executor.submit(_lower_pickled, payload)
            future.add_done_callback(lambda f, i=index: on_lowered(i, f))
        return None

    def _lower_serially(self, programs: list[WarmProgram], on_lowered: OnLowered) -> None:
        for index, program in enumerate(programs):
            future: Future[Lowered] = Future()
            if self._stopped.is_set():
                future.cancel()
                on_lowered(index, future)
                continue
            started = time.perf_counter()
            try:
                lowered = _lower_one(program, self._platform)
                future.set_result((lowered, time.perf_counter() - started))
            except Exception as error:  # a lowering error is that program's outcome
                future.set_exception(error)
            on_lowered(index, future)

    def close(self, cancel: bool = False) -> None:
        """Stops the lowering processes (cancelling queued work when asked)."""
        if cancel:
            self._stopped.set()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=cancel)

    def __enter__(self) -> Lowerer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(cancel=exc[0] is not None)
