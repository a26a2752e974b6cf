"""Lowering many programs, overlapped with compiling and optionally in parallel.

Lowering costs about a quarter of compiling, so with several compile workers
a parent that lowers one program after another becomes the bottleneck. A
Lowerer lowers in a background thread of this process (processes=0), so that
lowering overlaps compiling, or in N extra processes that receive each
function through cloudpickle. Those are fresh interpreters (spawned, never
forked from a parent that imported JAX) that import JAX once each.

Not every function survives that trip: pickling can fail (a closure over a
lock), and a function can unpickle into one that no longer works (classes
sent by value lose registrations made at import, such as pytree nodes; an
equinox module's fields). A program whose lowering fails in a lowering
process is therefore lowered again in this process: if that works, it
carries a note saying that it could not be sent; if not, this process's
error is the program's lowering error.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, NamedTuple

import cloudpickle

from pool.jax_cache.keys import jax_program
from pool.jax_cache.target import JaxTarget
from pool.lowering.lower import lower
from pool.warm.spec_file import WarmProgram
from worker.records import JaxCompile, LoweredProgram


class Lowered(NamedTuple):
    """A lowered program, the seconds its lowering took, and a note on how it was lowered."""

    program: LoweredProgram
    seconds: float
    note: str | None = None
    """Set when the program could not be sent to a lowering process and was lowered here."""
    jax: JaxCompile | None = None
    """For JAX's own cache: JAX's key and what its value is made for (pool.jax_cache)."""


OnLowered = Callable[[int, "Future[Lowered]"], None]


def _lower_pickled(payload: bytes) -> Lowered:
    """Runs in a lowering process: unpickles a WarmProgram, the run's platform and JAX
    target, and lowers."""
    started = time.perf_counter()
    program, platform, jax_target = cloudpickle.loads(payload)
    lowered, jax = lower_warm_program(program, platform, jax_target)
    return Lowered(lowered, time.perf_counter() - started, jax=jax)


def lower_warm_program(
    program: WarmProgram, platform: str | None, jax_target: JaxTarget | None = None
) -> tuple[LoweredProgram, JaxCompile | None]:
    """A spec's program lowered for its platform (else `platform`): what warm compiles; for
    JAX's own cache (jax_target), the module and options JAX compiles on the target, and
    what a worker files its value under (pool.jax_cache)."""
    if jax_target is not None:
        if program.function is None:
            raise ValueError(
                "a program for JAX's cache is made from its function as the script calls it: "
                "give (name, function, shapes), not a LoweredProgram"
            )
        return jax_program(program.function, program.shapes, None, jax_target).compile_request(
            jax_target
        )
    if program.lowered is not None:
        return program.lowered, None
    assert program.function is not None
    return lower(
        program.function,
        program.shapes,
        platform=program.platform or platform,
        custom_calls=tuple(program.custom_calls),
        in_shardings=program.in_shardings,
        out_shardings=program.out_shardings,
    ), None


class Lowerer:
    """Lowers WarmPrograms in a background thread or in `processes` spawned processes.

    close() (leaving the with block) returns once no lowering runs in this
    process: the thread that lowers here is stopped after the program it is
    lowering and joined. JAX lowers in native code (jaxlib's, with the GIL
    released); a thread still in it when the interpreter finalizes is ended
    by CPython as it takes the GIL back, and that unwinds through jaxlib's
    frames, which abort the process ("terminate called after throwing an
    instance of ''", "FATAL: exception not rethrown"): a Ctrl-C that ended a
    warm while a program was being lowered did that. The thread is a daemon
    all the same, so that a lowering that never returns cannot keep the
    interpreter from exiting: a second Ctrl-C stops close() from waiting.
    """

    def __init__(
        self, processes: int = 0, platform: str | None = None, jax_target: JaxTarget | None = None
    ) -> None:
        if processes < 0:
            raise ValueError(f"lowering processes cannot be negative: {processes}")
        self._platform = platform
        self._jax_target = jax_target
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._executor: ProcessPoolExecutor | None = None
        # Lowers here what could not be sent to (or lowered in) a lowering process.
        self._fallback: ThreadPoolExecutor | None = None
        if processes:
            # A terminal's Ctrl-C reaches the lowering processes too (they are in its
            # process group): they leave it to this process, which stops them.
            self._executor = ProcessPoolExecutor(
                processes,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=signal.signal,
                initargs=(signal.SIGINT, signal.SIG_IGN),
            )
            self._fallback = ThreadPoolExecutor(1, thread_name_prefix="pjrt-pool-lowering")

    def lower_all(self, programs: list[WarmProgram], on_lowered: OnLowered) -> None:
        """Starts lowering every program; calls on_lowered(index, future) as each finishes.

        Each future's result is a Lowered: the program, the seconds spent
        lowering it, and a note when it had to be lowered in this process.

        In-process lowering runs in a thread, whose callbacks come from it;
        with processes, the callbacks come from the executor's thread.
        """
        if self._executor is None:
            self._thread = threading.Thread(
                target=self._lower_serially,
                args=(programs, on_lowered),
                name="pjrt-pool-lowering",
                daemon=True,  # see the class docstring
            )
            self._thread.start()
            return
        for module in {sys.modules.get(getattr(p.function, "__module__", "")) for p in programs}:
            if module is not None and module.__name__ not in ("__main__", "builtins"):
                # Spec modules are not importable in the lowering processes:
                # send their functions by value.
                cloudpickle.register_pickle_by_value(module)
        for index, program in enumerate(programs):
            future: Future[Lowered] = Future()
            future.add_done_callback(lambda f, i=index: on_lowered(i, f))
            if program.lowered is not None and self._jax_target is None:
                future.set_result(Lowered(program.lowered, 0.0))
                continue
            try:
                payload = cloudpickle.dumps((program, self._platform, self._jax_target))
            except Exception as error:  # pickling runs the user's __reduce__ and the like
                self._lower_here(program, future, f"pickling failed: {_describe(error)}")
                continue
            remote = self._executor.submit(_lower_pickled, payload)
            remote.add_done_callback(lambda r, p=program, f=future: self._settle(r, p, f))

    def _settle(
        self, remote: Future[Lowered], program: WarmProgram, future: Future[Lowered]
    ) -> None:
        """Passes on a lowering process's result; lowers here what failed there."""
        if remote.cancelled():
            future.cancel()
            return
        error = remote.exception()
        if error is None:
            future.set_result(remote.result())
            return
        self._lower_here(program, future, f"lowering there failed: {_describe(error)}")

    def _lower_here(self, program: WarmProgram, future: Future[Lowered], reason: str) -> None:
        """Lowers a program in this process (in the fallback thread), noting why."""

        def run() -> None:
            if self._stopped.is_set():
                future.cancel()
                return
            started = time.perf_counter()
            try:
                lowered, jax = lower_warm_program(program, self._platform, self._jax_target)
            except Exception as error:  # this process's error is the program's error
                future.set_exception(error)
                return
            note = (
                f"could not be sent to a lowering process ({reason}); "
                "lowered in this process instead"
            )
            future.set_result(Lowered(lowered, time.perf_counter() - started, note, jax))

        assert self._fallback is not None
        self._fallback.submit(run)

    def _lower_serially(self, programs: list[WarmProgram], on_lowered: OnLowered) -> None:
        for index, program in enumerate(programs):
            future: Future[Lowered] = Future()
            if self._stopped.is_set():
                future.cancel()
                on_lowered(index, future)
                continue
            started = time.perf_counter()
            try:
                lowered, jax = lower_warm_program(program, self._platform, self._jax_target)
                future.set_result(Lowered(lowered, time.perf_counter() - started, jax=jax))
            except Exception as error:  # a lowering error is that program's outcome
                future.set_exception(error)
            on_lowered(index, future)

    def close(self, cancel: bool = False) -> None:
        """Waits for the lowering to end, or (cancel) stops it after the programs being lowered.

        Whatever is not lowered by then is cancelled (its callback still comes).
        A program's lowering cannot be cut short: a Ctrl-C while this waits for
        it stops the wait, and leaves the lowering running (see the class
        docstring).
        """
        if cancel:
            self._stopped.set()
        if self._thread is not None:
            self._thread.join()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=cancel)
        if self._fallback is not None:  # after the executor, whose callbacks submit to it
            # Not cancel_futures: each queued job must settle its program's
            # future (cancelled, once _stopped is set), or warm() waits forever.
            self._fallback.shutdown(wait=True)

    def __enter__(self) -> Lowerer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(cancel=exc[0] is not None)


def _describe(error: BaseException) -> str:
    """An error in one line: its type and message."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"
