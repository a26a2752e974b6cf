"""Pool: compile and run programs in crash-isolated PJRT worker processes.

Data flow::

    caller threads                  manager thread                 workers
    ──────────────                  ──────────────                 ───────
    submit(program, args)
      check + convert + copy args
      ──▶ pending ──▶ claim an idle worker (any thread) ──send──▶ python -m worker
      return Future                 (prefer one that has the       compile or load
                                     program loaded)               (shared disk cache)
                                                                   run: PJRT reads the
                                    reply + output memfd  ◀─────── inputs, writes outputs
    Future.result() ◀── numpy views of the output memfd             into shared memory
                                    worker died? ──▶ its task failed (it had started:
                                                     signal, program, output tail) or
                                                     sent again (it had not); respawn
                                    deadline passed? ──▶ kill that worker, fail, respawn

    run(program, args): claims an idle worker and does send + receive in the
    caller's thread (one thread switch less per call), then hands it back.

Ownership. Each worker has exactly one owner at a time (pool.workers.Owner):
the manager thread, whose wait set (pool.watch) holds the socket, or one
caller thread, with the socket out of that set. Every state change is a move under
``self._lock`` (see pool.workers for the table); a caller hands its worker
back in a ``finally`` (and wakes the manager when it must know). Deadlines
live on tasks; the manager watches every busy worker's, whoever dispatched
it, and kills the worker when one passes. A task is settled exactly once:
``_settle_locked`` flips ``task.done`` under the lock, and only the thread
that flipped it resolves the future and gives back its shared memory.

The manager waits on one epoll set holding every manager-owned worker's
socket and output pipe plus a wake-up pipe: a worker's death shows as end of
file on its socket, so one wait point sees replies, deaths and wake-ups
alike, and the next deadline bounds the wait. Only the manager spawns and
reaps workers (their PR_SET_PDEATHSIG is tied to its thread).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import logging
import math
import numbers
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from pool.compiling import CompileResult, CompilesMany
from pool.errors import (
    DeviceFailureError,
    PoolClosedError,
    PoolError,
    ProgramQuarantinedError,
    TaskTimeoutError,
    WorkerCrashedError,
    WorkerStartupError,
    describe_exit,
    likely_cause,
    rebuild_error,
)
from pool.segments import DEFAULT_CACHE_BYTES, DEFAULT_MAX_FDS, Mapping, SegmentCache
from pool.tasks import MAX_REQUEUES, Task, program_id, stage_inputs
from pool.watch import Watch
from pool.workers import (
    ARENA_SIZE,
    Owner,
    State,
    WorkerProcess,
    pickle_initializer,
    stop_all,
)
from worker import protocol, shm
from worker.arguments import prepare_arguments
from worker.cache import CacheCounters, check_cache_dir
from worker.conformance_memo import warn_known_failures
from worker.records import ArrayType, CompileStatistics, LoweredProgram, ProgramSpec

if TYPE_CHECKING:
    from pool.function import PoolFunction

logger = logging.getLogger("pjrt_pool.pool")


DIRECT_SPIN_SECONDS = 500e-6
"""How long Pool.run polls for a worker's reply before sleeping (protocol.spin_until_readable)."""

ARENA_INPUT_LIMIT = ARENA_SIZE // 4
"""Inputs up to this many bytes go through the worker's arena; outputs use the rest.

Smaller tasks then cost no system calls for memory, and their outputs are
copied out of the arena (cheaper than mapping a segment for a few KB). Larger
outputs get a segment of their own that the returned arrays view, with no copy.
"""

RESPAWN_RETRY_SECONDS = 1.0
"""How long after a replacement worker failed to spawn the pool tries again."""

HAND_BACK_SECONDS = 10.0
"""How long a failed manager waits for callers to hand back the workers they hold."""

_live_pools: weakref.WeakSet[Pool] = weakref.WeakSet()


@atexit.register
def _terminate_live_pools() -> None:
    for live in list(_live_pools):
        live.terminate()


def check_timeout(value: Any, what: str = "timeout") -> float | None:
    """Returns a timeout in seconds: None for none, math.inf for no limit; refuses the rest.

    A timeout is a positive number of seconds; inf means no limit. NaN, zero,
    negative numbers, booleans and strings raise before any work starts.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{what} must be a number of seconds (or None), not {type(value).__name__} {value!r}"
        )
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(
            f"{what} must be a positive number of seconds (inf: no limit), not {value!r}"
        )
    return seconds


class Pool(CompilesMany):
    """Worker processes that compile and run LoweredPrograms, each with its own plugin.

    workers is the number of processes (default: the CPU count). platform
    names the plugin to load (default: PJRT_POOL_PLATFORM, else "cpu").
    cache_dir is the shared disk cache (default: PJRT_POOL_CACHE_DIR, else
    the user cache directory). task_timeout bounds each task's time in a
    worker (None or inf: no bound); a task past it has its worker killed
    and replaced. initializer(*initargs) runs in each worker after its
    plugin loads, for example to register custom calls; if it raises, the
    pool does not start. A program that crashes max_crashes workers is
    quarantined. Each worker keeps max_loaded executables loaded. Up to
    segment_cache_bytes of shared memory from finished large inputs and
    outputs is kept for reuse, since fresh shared memory is slow to fault
    in; segment_fds bounds the descriptors the pool keeps for shared memory
    beyond those of running tasks (queued large inputs, live large results,
    segments kept for reuse), so a deep queue or many kept results never
    exhaust the process's descriptor limit.

    Submission is thread-safe. The pool is a context manager; close() waits
    for submitted tasks and stops the workers, and may be called twice.
    """

    def __init__(
        self,
        workers: int | None = None,
        *,
        platform: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        task_timeout: float | None = None,
        start_timeout: float = 120.0,
        initializer: Callable[..., Any] | None = None,
        initargs: Sequence[Any] = (),
        max_loaded: int = 64,
        max_crashes: int = 2,
        zero_copy: bool = True,
        stop_grace: float = 2.0,
        segment_cache_bytes: int = DEFAULT_CACHE_BYTES,
        segment_fds: int = DEFAULT_MAX_FDS,
    ) -> None:
        count = (os.cpu_count() or 1) if workers is None else workers
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"workers must be a positive int, not {workers!r}")
        if isinstance(segment_fds, bool) or not isinstance(segment_fds, int) or segment_fds < 0:
            raise ValueError(f"segment_fds must be a non-negative int, not {segment_fds!r}")
        self._task_timeout = check_timeout(task_timeout, "task_timeout")
        check_timeout(start_timeout, "start_timeout")
        self._platform = platform
        self._cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        check_cache_dir(self._cache_dir)  # fail fast on a cache directory others could write
        self._worker_count = count
        self._max_loaded = max_loaded
        self._max_crashes = max_crashes
        self._zero_copy = zero_copy
        self._stop_grace = stop_grace
        self._initializer = pickle_initializer(initializer, tuple(initargs))

        self._lock = threading.Lock()
        self._pending: collections.deque[Task] = collections.deque()
        self._closing = False
        self._broken: BaseException | None = None
        self._task_ids = itertools.count()
        self._crashes: collections.Counter[str] = collections.Counter()
        self._quarantined: dict[str, str] = {}
        self._statistics = CompileStatistics()
        self._output_types: dict[str, tuple[ArrayType, ...]] = {}  # by program id
        self._input_layouts: dict[str, tuple[tuple[ArrayType, ...], tuple[int, ...], int]] = {}
        self._segments = SegmentCache(segment_cache_bytes, segment_fds)
        self._retired_counters = CacheCounters()
        self._startup_failures = 0
        self._respawns: dict[int, float] = {}  # worker index -> when to try starting it again
        self._started = threading.Event()
        self._startup_error: BaseException | None = None

        self._watch = Watch()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._watch.add(self._wake_r, None)
        self._workers: list[WorkerProcess] = []
        # The manager spawns the workers: their PR_SET_PDEATHSIG follows the
        # thread that spawned them, and the manager outlives every worker.
        self._manager = threading.Thread(target=self._manage, name="pjrt-pool-manager", daemon=True)
        self._manager.start()
        if not self._started.wait(start_timeout):
            self.terminate()
            raise WorkerStartupError(
                f"the workers did not start within {start_timeout:.0f} s "
                "(plugin loading hung?); raise start_timeout if plugins load slowly here"
            )
        if self._startup_error is not None:
            self.terminate()
            raise self._startup_error
        _live_pools.add(self)
        warn_known_failures(self._workers[0].plugin.get("path"), self._cache_dir)

    # -- public API -------------------------------------------------------

    def submit(
        self,
        program: LoweredProgram,
        arguments: Sequence[ArrayLike],
        *,
        name: str | None = None,
        timeout: float | None = None,
        zero_copy: bool | None = None,
        compile_options: bytes | None = None,
    ) -> Future[list[np.ndarray]]:
        """Runs a program in a worker (compiling or loading it there first); returns a Future.

        The arguments are checked, converted to the program's input types and
        copied here, raising the same TypeError or ValueError as
        Executable.run; changing them after submit returns does not change
        the task. The Future's result is the list of outputs as numpy arrays
        (large ones view shared memory, freed when the arrays are).
        timeout (seconds; inf for none) overrides the pool's task_timeout.
        compile_options compiles the program with other options than the
        default, as submit_compile does.
        """
        task = self._run_task(
            program, arguments, name, timeout, zero_copy, compile_options, caller_waits=False
        )
        return self._enqueue(task)

    def run(
        self,
        program: LoweredProgram,
        arguments: Sequence[ArrayLike],
        *,
        name: str | None = None,
        timeout: float | None = None,
        compile_options: bytes | None = None,
    ) -> list[np.ndarray]:
        """Runs a program in a worker and returns its outputs (see submit).

        When a worker is idle and no task waits, the calling thread talks to
        the worker itself instead of going through the manager thread: one
        thread switch less per call, which is most of a small program's
        round trip. An exception while waiting (Ctrl-C) stops the task: its
        worker is killed and replaced, and the pool goes on.
        """
        task = self._run_task(program, arguments, name, timeout, None, compile_options, True)
        worker = self._claim_for_caller(task)
        if worker is None:
            self._enqueue(task)
            return self._wait(task)
        return self._run_directly(worker, task)

    def submit_spec(
        self,
        spec: ProgramSpec,
        arguments: Sequence[ArrayLike],
        *,
        timeout: float | None = None,
    ) -> Future[list[np.ndarray]]:
        """Runs the executable a ProgramSpec names (by its cache key), as a manifest does.

        The executable must be in the pool's disk cache (put there by warming
        or compiling the program with the same plugin); no program is needed.
        """
        if not isinstance(spec, ProgramSpec):
            raise TypeError(f"submit_spec takes a ProgramSpec, not {type(spec).__name__}")
        task = self._new_task("run", None, spec.name, timeout, None, spec=spec)
        return self._enqueue(self._staged(task, arguments, None, caller_waits=False))

    def submit_compile(
        self,
        program: LoweredProgram,
        *,
        name: str | None = None,
        timeout: float | None = None,
        compile_options: bytes | None = None,
    ) -> Future[CompileResult]:
        """Compiles (or loads) a program in a worker; the Future's result is a CompileResult.

        compile_options replaces the default serialized CompileOptionsProto
        (one replica, one partition); it is part of the program's identity,
        so the spec's key is the one compile_program gives for these options,
        and runs with other options use their own executable. The plugin
        checks it: malformed options can make the plugin abort, which fails
        only this task.
        """
        task = self._new_task(
            "compile", self._check_program(program), name, timeout, compile_options
        )
        return self._enqueue(task)

    def compile(
        self, program: LoweredProgram, *, name: str | None = None, timeout: float | None = None
    ) -> ProgramSpec:
        """Compiles (or loads) a program in a worker and returns its ProgramSpec."""
        return self.submit_compile(program, name=name, timeout=timeout).result().spec

    def function(
        self,
        function: Callable[..., Any],
        *,
        static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = (),
        platform: str | None = None,
        custom_calls: Sequence[str] = (),
        name: str | None = None,
    ) -> PoolFunction:
        """Returns function as a callable that runs in this pool's workers, like jax.jit(function).

        Calling it lowers the function in this process once per signature (the
        arguments' tree structure, shapes, dtypes and weak types, the static
        arguments' values and jax_enable_x64, as jax.jit caches), then runs
        the program with Pool.run: a worker compiles it or loads it from the
        disk cache. It returns the result in the structure
        jax.jit(function)(*args) returns, with numpy arrays as leaves; typed
        PRNG keys come back as keys. Arguments are pytrees of numpy arrays,
        JAX arrays, Python scalars (weakly typed, as in jax.jit) and typed
        keys; keyword arguments are dynamic. static_argnums and custom_calls
        mean what they mean for jax.jit and lower; platform is the one to
        lower for (default: that of this pool's plugin); name names the tasks
        (default: the program's name). Its submit method returns a Future of
        the result and its lower method the LoweredProgram a call runs. Crash
        isolation, timeouts and quarantine are those of submit.

        donate_argnums is accepted and ignored, with a warning: arguments are
        copied into shared memory for the worker, so donated arrays stay
        valid and no memory is saved.
        """
        from pool.function import PoolFunction

        return PoolFunction(
            self,
            function,
            static_argnums=static_argnums,
            donate_argnums=donate_argnums,
            platform=platform,
            custom_calls=custom_calls,
            name=name,
        )

    @property
    def cache_counters(self) -> CacheCounters:
        """Disk cache hits, misses, repairs and evictions, summed over every worker."""
        with self._lock:
            total = self._retired_counters
            for worker in self._workers:
                total = total.add(CacheCounters(**worker.counters))
            return total

    @property
    def worker_info(self) -> list[dict[str, Any]]:
        """Each worker's pid, state, start-up seconds, plugin, loaded program count and task."""
        with self._lock:
            return [
                {
                    "pid": w.pid,
                    "state": w.state.value,
                    "startup_seconds": w.startup_seconds,
                    "plugin": dict(w.plugin),
                    "loaded": len(w.loaded),
                    "task": None if w.task is None else w.task.name,
                }
                for w in self._workers
            ]

    def close(self, cancel_pending: bool = False) -> None:
        """Waits for submitted tasks (or cancels queued ones), then stops every worker.

        It returns when the last running task ends (bounded by the tasks'
        timeouts, if any) plus the time to stop the workers: an Exit request,
        then SIGTERM after stop_grace seconds, then SIGKILL after as many
        again, all workers at once. Calling close again does nothing.
        """
        with self._lock:
            self._closing = True
            cancelled = self._take_pending_locked() if cancel_pending else []
        _cancel(cancelled)
        self._wake()
        if self._manager.is_alive() and threading.current_thread() is not self._manager:
            self._manager.join()
        _live_pools.discard(self)

    def terminate(self) -> None:
        """Stops at once: cancels queued tasks, kills the workers, fails running tasks.

        Returns as soon as the killed workers are reaped (well under a
        second unless the system is stalled).
        """
        with self._lock:
            self._closing = True
            self._broken = self._broken or PoolClosedError("the pool was terminated")
            cancelled = self._take_pending_locked()
            for worker in self._workers:
                task = worker.task
                if task is not None and not task.done and task.kill_error is None:
                    task.kill_error = PoolClosedError("the pool was terminated during the task")
                self._kill_locked(worker)
        _cancel(cancelled)
        self._wake()
        manager = getattr(self, "_manager", None)
        if manager is not None and manager.is_alive() and threading.current_thread() is not manager:
            manager.join()
        _live_pools.discard(self)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if isinstance(value, KeyboardInterrupt):
            self.terminate()
        else:
            self.close(cancel_pending=value is not None)

    # -- tasks (caller threads) ----------------------------------------------

    @staticmethod
    def _check_program(program: Any) -> LoweredProgram:
        if not isinstance(program, LoweredProgram):
            raise TypeError(
                f"the pool runs LoweredPrograms (from pool.lower), not {type(program).__name__}"
            )
        return program

    def _run_task(
        self,
        program: LoweredProgram,
        arguments: Sequence[ArrayLike],
        name: str | None,
        timeout: float | None,
        zero_copy: bool | None,
        compile_options: bytes | None,
        caller_waits: bool,
    ) -> Task:
        task = self._new_task("run", self._check_program(program), name, timeout, compile_options)
        return self._staged(task, arguments, zero_copy, caller_waits)

    def _new_task(
        self,
        kind: str,
        program: LoweredProgram | None,
        name: str | None,
        timeout: float | None,
        compile_options: bytes | None,
        spec: ProgramSpec | None = None,
    ) -> Task:
        """A task for a program, or (program None) for the executable a ProgramSpec names.

        Everything a caller gives is checked here, before any worker is claimed.
        """
        seconds = self._task_timeout if timeout is None else check_timeout(timeout)
        if compile_options is not None and not isinstance(compile_options, bytes):
            raise TypeError("compile_options must be bytes (a serialized CompileOptionsProto)")
        if program is None:
            assert spec is not None
            identity, name, key = spec.key, name or spec.name, spec.key
        else:
            identity, name, key = program_id(program, compile_options), name or program.name, None
        return Task(
            id=next(self._task_ids),
            kind=kind,
            program=program,
            program_id=identity,
            name=name,
            future=Future(),
            timeout=seconds,
            cache_key=key,
            spec_types=None if spec is None else spec.input_types,
            compile_options=compile_options,
        )

    def _staged(
        self,
        task: Task,
        arguments: Sequence[ArrayLike],
        zero_copy: bool | None,
        caller_waits: bool,
    ) -> Task:
        """Checks and converts a run task's arguments and stages them (see stage_inputs)."""
        types = task.program.input_types if task.program is not None else task.spec_types
        arrays = prepare_arguments(arguments, types)
        task.zero_copy = self._zero_copy if zero_copy is None else zero_copy
        task.declared_types = types is not None
        layout = self._input_layout(task.program_id, types)
        stage_inputs(task, arrays, ARENA_INPUT_LIMIT, self._segments, layout, caller_waits)
        return task

    def _input_layout(
        self, program_key: str, types: tuple[ArrayType, ...] | None
    ) -> tuple[tuple[ArrayType, ...], tuple[int, ...], int] | None:
        """The shared-memory layout of a program's declared inputs, computed once."""
        if types is None:
            return None
        layout = self._input_layouts.get(program_key)
        if layout is None:
            offsets, size = shm.layout(types)
            layout = self._input_layouts[program_key] = (types, offsets, size)
        return layout

    def _enqueue(self, task: Task) -> Future[Any]:
        with self._lock:
            refusal = self._refusal_locked(task)
            if refusal is None:
                self._pending.append(task)
        if refusal is not None:
            task.release()
            raise refusal
        # Dispatch from the caller's thread: waking the manager thread for it
        # would cost a thread switch (and a GIL hand-off) on every task.
        self._dispatch(Owner.CALLER)
        return task.future

    def _refusal_locked(self, task: Task) -> BaseException | None:
        if self._closing or self._broken is not None:
            return self._broken or PoolClosedError("the pool is closed")
        reason = self._quarantined.get(task.program_id)
        return None if reason is None else ProgramQuarantinedError(reason)

    def _wait(self, task: Task) -> list[np.ndarray]:
        """Waits for the caller's own task; if the wait is interrupted, stops the task."""
        try:
            return task.future.result()
        except BaseException as error:
            if not task.future.done():
                self._abandon(task, error)
            raise

    def _abandon(self, task: Task, error: BaseException) -> None:
        """Stops a task its caller gave up on: unqueued if waiting, its worker killed if running."""
        reason = PoolError(f"the task's caller stopped waiting ({type(error).__name__})")
        with self._lock:
            if task.done:
                return
            if task in self._pending:
                self._pending.remove(task)
                task.done = True
            else:
                task.kill_error = reason
                for worker in self._workers:
                    if worker.task is task:
                        self._kill_locked(worker)
                return
        _cancel([task], reason)

    # -- the direct path of Pool.run (the caller's thread) ----------------------

    def _claim_for_caller(self, task: Task) -> WorkerProcess | None:
        """Claims an idle worker for the caller's thread, or returns None (use the queue)."""
        with self._lock:
            if self._pending or self._refusal_locked(task) is not None:
                return None  # the queue keeps the order, or reports the refusal
            worker = self._idle_worker_locked(task.program_id)
            if worker is None:
                return None
            task.future.set_running_or_notify_cancel()
            self._claim_locked(worker, task, Owner.CALLER)
            # This thread reads the reply: the manager must not even wake for it.
            self._unwatch_locked(worker)
        return worker

    def _run_directly(self, worker: WorkerProcess, task: Task) -> list[np.ndarray]:
        """Sends a claimed worker its task and reads the reply in the caller's thread.

        Whatever happens, the worker goes back to the manager: the reply's
        handling returns it (idle), a dead worker is handed over for the
        manager to reap (which fails or requeues the task), and an
        interruption kills it first (a frame may be cut short, and the
        caller no longer wants the task).
        """
        try:
            message, fds = self._request_for(task, worker)
        except BaseException as error:
            self._unclaim(worker, task, error)
            raise
        handled = False
        try:
            worker.send(message, fds)
            protocol.spin_until_readable(worker.sock, DIRECT_SPIN_SECONDS)
            try:
                reply, reply_fds = worker.receive()
                dropped = None
            except protocol.DescriptorLimitError as error:
                reply, reply_fds, dropped = error.message, [], error
            handled = True
            self._on_message(worker, reply, reply_fds, dropped)
        except (OSError, protocol.ConnectionLostError):
            if not handled:  # the worker died: the manager reaps it and settles the task
                self._hand_over(worker)
        except BaseException as error:
            if not handled:
                self._stop_task_of(worker, task, error)
            raise
        if self._pending:  # queued meanwhile, or the reply asked to send the task again
            self._dispatch(Owner.CALLER)
        return self._wait(task)

    def _stop_task_of(self, worker: WorkerProcess, task: Task, error: BaseException) -> None:
        """The caller was interrupted while it held the worker: kill it and hand it over."""
        with self._lock:
            if not task.done and task.kill_error is None:
                task.kill_error = PoolError(
                    f"the task's caller was interrupted ({type(error).__name__}); the task was "
                    "stopped and its worker replaced"
                )
            self._kill_locked(worker)
            self._return_locked(worker)

    # -- claiming and handing back workers (any thread) --------------------------

    def _idle_worker_locked(self, program_key: str) -> WorkerProcess | None:
        """An idle worker, one that has the program loaded if there is one."""
        first = None
        for worker in self._workers:
            if worker.state is State.IDLE:
                if program_key in worker.loaded:
                    return worker
                first = first or worker
        return first

    def _claim_locked(self, worker: WorkerProcess, task: Task, owner: Owner) -> None:
        """IDLE -> BUSY with `task`, owned by the claiming thread."""
        worker.move(State.BUSY)
        worker.task = task
        worker.owner = owner
        task.deadline = None
        if task.timeout is not None and math.isfinite(task.timeout):
            task.deadline = time.monotonic() + task.timeout
            if owner is Owner.CALLER:
                self._wake()  # the manager's wait must end at this deadline

    def _unwatch_locked(self, worker: WorkerProcess) -> None:
        """Takes a worker's socket out of the manager's wait set (a caller holds it)."""
        if worker.watched:
            self._watch.remove(worker.sock.fileno())
            worker.watched = False

    def _return_locked(self, worker: WorkerProcess) -> None:
        """Gives a caller-owned worker back to the manager (its socket into the wait set)."""
        if worker.owner is Owner.CALLER:
            worker.owner = Owner.MANAGER
            if not worker.watched and worker.state is not State.DEAD:
                # epoll takes the change even while the manager is waiting in it.
                self._watch.add(worker.sock.fileno(), ("socket", worker))
                worker.watched = True
            if self._closing:
                self._wake()  # close() waits for this worker to be free

    def _hand_over(self, worker: WorkerProcess) -> None:
        """A caller sent a request (or failed to): the manager reads what follows."""
        with self._lock:
            self._return_locked(worker)

    def _unclaim(self, worker: WorkerProcess, task: Task, error: BaseException) -> None:
        """Nothing was sent: the worker goes back to IDLE; the task fails, or waits again."""
        with self._lock:
            worker.task = None
            if worker.state is State.BUSY:
                worker.move(State.IDLE)
            self._return_locked(worker)
            if isinstance(error, Exception):
                settled = self._settle_locked(task)
            else:  # interrupted: the task stays for another worker
                self._pending.appendleft(task)
                settled = False
        if settled:
            self._complete(task, error)

    def _kill_locked(self, worker: WorkerProcess) -> None:
        """Kills a worker (it becomes DYING; its end of file finishes it)."""
        if worker.state in (State.STARTING, State.IDLE, State.BUSY):
            worker.move(State.DYING)
            worker.kill()

    def _retire(self, worker: WorkerProcess) -> None:
        """Kills a worker for a reason that is not its task's fault (the task goes elsewhere)."""
        with self._lock:
            worker.killed_by_pool = True
            self._kill_locked(worker)
            self._return_locked(worker)

    # -- settling tasks ------------------------------------------------------------

    def _settle_locked(self, task: Task) -> bool:
        """The one transition to DONE: True for the single caller that makes it."""
        if task.done:
            return False
        task.done = True
        return True

    @staticmethod
    def _complete(task: Task, outcome: Any) -> None:
        """Resolves a settled task's future and gives back its shared memory (not locked)."""
        task.release()
        if isinstance(outcome, BaseException):
            _fail(task.future, outcome)
        else:
            _resolve(task.future, outcome)

    def _finish(self, worker: WorkerProcess, task: Task, outcome: Any) -> None:
        """A reply was handled: settle its task (or queue it again) and free the worker."""
        with self._lock:
            if worker.task is task:
                worker.task = None
            if worker.state is State.BUSY:
                worker.move(State.IDLE)
            self._return_locked(worker)
            if outcome is _RESEND and not task.done:
                self._pending.appendleft(task)
                settled = False
            else:
                settled = self._settle_locked(task)
        if settled:
            self._complete(task, outcome)

    # -- dispatch (any thread) ---------------------------------------------------------

    def _dispatch(self, owner: Owner) -> None:
        """Sends pending tasks to idle workers; `owner` is who calls (the manager or a caller).

        A worker is claimed under the lock, so only the claiming thread sends
        to it; a caller then hands it to the manager, which reads the reply.
        """
        while True:
            dropped: Any = None
            with self._lock:
                if self._broken is not None or not self._pending:
                    return
                worker = self._idle_worker_locked(self._pending[0].program_id)
                if worker is None:
                    return
                task = self._pending.popleft()  # never settled while queued
                reason = self._quarantined.get(task.program_id)
                if reason is not None:
                    task.done = True
                    dropped = ProgramQuarantinedError(reason)
                elif not (task.future.running() or task.future.set_running_or_notify_cancel()):
                    task.done = True  # cancelled while queued
                    dropped = _CANCELLED
                else:
                    self._claim_locked(worker, task, owner)
            if dropped is _CANCELLED:
                task.release()
            elif dropped is not None:
                self._complete(task, dropped)
            else:
                self._send(worker, task, owner)

    def _send(self, worker: WorkerProcess, task: Task, owner: Owner) -> None:
        """Sends a claimed worker its task; hands the worker to the manager if a caller sent."""
        try:
            message, fds = self._request_for(task, worker)
        except BaseException as error:
            self._unclaim(worker, task, error)
            if not isinstance(error, Exception):
                raise
            return
        try:
            worker.send(message, fds)
        except OSError:
            pass  # it died: the manager sees its end of file and sends the task elsewhere
        except BaseException:
            self._retire(worker)  # interrupted mid-frame: the stream is broken
            raise
        if owner is Owner.CALLER:
            self._hand_over(worker)

    def _request_for(self, task: Task, worker: WorkerProcess) -> tuple[Any, tuple[int, ...]]:
        """The message (and descriptors) that give a task to the worker claimed for it."""
        if task.kind == "run" and task.output_fd < 0:
            self._offer_output_segment(task)
        return task.request(
            task.program_id in worker.loaded,
            worker.arena,
            want_output_types=task.program_id not in self._output_types,
        )

    def _offer_output_segment(self, task: Task) -> None:
        """Gives a run whose outputs will not fit the arena a recycled segment, if one fits."""
        types = self._output_types.get(task.program_id)
        if types is None:
            return  # the first run of a program: its output size is not known yet
        start = shm.aligned(task.input_size) if task.in_arena else 0
        if shm.layout(types, start)[1] <= ARENA_SIZE:
            return
        recycled = self._segments.take(shm.layout(types)[1])
        if recycled is not None:
            task.output_fd, task.output_capacity = recycled
            task.segments = self._segments

    # -- replies (the worker's owner: the manager, or Pool.run's caller) ---------

    def _on_message(
        self,
        worker: WorkerProcess,
        message: Any,
        fds: list[int],
        dropped: BaseException | None = None,
    ) -> None:
        """Handles one message from a worker; a BUSY worker always ends up handed back."""
        if isinstance(message, protocol.Ready):
            _close_all(fds)
            self._on_ready(worker, message)
            return
        task = worker.task
        if not isinstance(message, protocol.Reply) or task is None or message.task_id != task.id:
            _close_all(fds)
            logger.warning("worker %d sent an unexpected message %r", worker.pid, message)
            self._retire(worker)
            return
        outcome: Any = None
        try:
            if message.statistics is not None or message.counters is not None:
                with self._lock:
                    if message.counters is not None:
                        worker.counters = message.counters
                    if message.statistics is not None:
                        self._statistics = self._statistics.add(message.statistics)
            if dropped is not None:
                raise dropped
            outcome = self._outcome(worker, task, message, fds)
        except Exception as error:  # the task's own failure, or reading its outputs failed
            outcome = error
        except BaseException as error:  # interrupted while reading the outputs
            outcome = PoolError(f"reading the task's outputs was interrupted ({error!r})")
            raise
        finally:
            _close_all(fds)
            self._finish(worker, task, outcome)

    def _outcome(
        self, worker: WorkerProcess, task: Task, reply: protocol.Reply, fds: list[int]
    ) -> Any:
        """Returns a reply's result (or _RESEND to send the task again); raises its error."""
        if reply.error is not None:
            if reply.fatal:
                raise self._device_failure(worker, task, reply.error)
            lost = reply.error.qualname == "LookupError" and task.program is not None
            if lost and not task.resend_program:
                # The worker unloaded the program although the parent's mirror
                # said otherwise: send it again, with the program this time.
                worker.loaded.pop(task.program_id, None)
                task.resend_program = True
                return _RESEND
            raise rebuild_error(reply.error)
        worker.note_loaded(task.program_id, reply.evicted)
        if task.kind == "compile":
            return CompileResult(reply.spec, reply.statistics or CompileStatistics(), reply.phases)
        types = reply.output_types
        if types is None:
            types = self._output_types[task.program_id]
        else:
            self._output_types[task.program_id] = types
        if reply.output_place == "arena":
            # The arena is reused by the next task: copy the (small) outputs out.
            return [view.copy() for view in shm.views(worker.arena, types, reply.output_offsets)]
        if reply.output_place == "given":
            fd, capacity, lent = task.output_fd, task.output_capacity, True
            task.output_fd = -1  # the outputs' arrays own the segment now
        else:
            fd, capacity = fds.pop(0), reply.output_size
            lent = self._segments.try_lend()
        try:
            mapping = Mapping(fd, capacity)
        except BaseException:
            if lent:
                self._segments.give(fd, capacity)
            else:
                os.close(fd)
            raise
        if lent:
            # When the arrays are garbage, the segment goes back for reuse.
            self._segments.adopt(fd, capacity, mapping)
        else:
            os.close(fd)  # past the descriptor bound: the mapping alone keeps the memory
        return shm.views(mapping.as_array(), types, reply.output_offsets)

    def _device_failure(
        self, worker: WorkerProcess, task: Task, remote: protocol.RemoteError
    ) -> DeviceFailureError:
        """A device error left the worker unusable: retire it and count a crash."""
        self._retire(worker)
        message = (
            f"the device failed while the worker (pid {worker.pid}) ran program {task.name!r} "
            f"({task.kind}): {remote.message}. Such an error leaves the process's device "
            "context unusable, so the worker was replaced; only this task failed."
            + self._count_crash(task)
        )
        error = DeviceFailureError(message, None, task.name, worker.output_tail())
        error.add_note(f"Raised in a pjrt-pool worker:\n{remote.traceback}")
        return error

    def _count_crash(self, task: Task) -> str:
        """Counts a crash of the task's program; returns what to add to its message."""
        with self._lock:
            self._crashes[task.program_id] += 1
            crashes = self._crashes[task.program_id]
            if crashes < self._max_crashes:
                return ""
            self._quarantined[task.program_id] = (
                f"program {task.name!r} crashed {crashes} workers and is quarantined: "
                "this pool will not run it again"
            )
        return f" It has now crashed {crashes} workers and is quarantined."

    def _on_ready(self, worker: WorkerProcess, ready: protocol.Ready) -> None:
        if ready.error is not None:
            error = WorkerStartupError(
                f"a worker failed to start: {ready.error.qualname}: {ready.error.message}"
            )
            error.add_note(f"Raised in the worker:\n{ready.error.traceback}")
            with self._lock:
                self._kill_locked(worker)
            self._on_startup_failure(error)
            return
        with self._lock:
            if worker.state is not State.STARTING:
                return  # killed while starting (terminate)
            worker.move(State.IDLE)
            worker.plugin = ready.plugin
            worker.startup_seconds = time.monotonic() - worker.started_at
            self._startup_failures = 0
            everyone = all(w.state is not State.STARTING for w in self._workers)
        if everyone and not self._started.is_set():
            self._started.set()

    # -- the manager thread --------------------------------------------------------

    def _manage(self) -> None:
        try:
            try:
                for index in range(self._worker_count):
                    self._spawn(index)
            except Exception as error:
                self._on_startup_failure(WorkerStartupError(f"a worker could not start: {error}"))
                return
            self._manage_loop()
        except BaseException as error:  # a bug here must fail tasks, never hang them
            logger.exception("the pool's manager thread failed")
            self._break(error)
        finally:
            self._stop_workers()

    def _manage_loop(self) -> None:
        while True:
            self._dispatch(Owner.MANAGER)
            with self._lock:
                busy = any(w.state in (State.BUSY, State.DYING) for w in self._workers)
                done = not busy and (
                    self._broken is not None or (self._closing and not self._pending)
                )
            if done:
                return
            timeout = _earliest(self._expire(), self._respawn_due())
            for what in self._watch.wait(timeout):
                if what is None:
                    self._drain_wake()
                    continue
                kind, worker = what
                if kind == "output":
                    if not worker.read_output():
                        self._watch.remove(worker.output_fd)
                    continue
                self._on_readable(worker)

    def _on_readable(self, worker: WorkerProcess) -> None:
        """A manager-owned worker's socket has a message or its end of file."""
        with self._lock:
            if worker.state is State.DEAD:
                return
            if worker.owner is not Owner.MANAGER:
                # A caller holds it (sending a task it dispatched): its reply or
                # end of file is the manager's once the caller hands it back.
                self._unwatch_locked(worker)
                return
            if worker.state is State.IDLE:
                # An idle worker sends nothing: this is its end of file (or a
                # protocol error). Keep it from being claimed while it is read.
                worker.move(State.DYING)
                worker.killed_by_pool = True
        try:
            message, fds = worker.receive()
        except protocol.DescriptorLimitError as error:
            self._on_message(worker, error.message, [], error)
        except (protocol.ConnectionLostError, OSError):
            self._on_worker_lost(worker)
        else:
            self._on_message(worker, message, fds)

    def _expire(self) -> float | None:
        """Kills workers whose task is past its deadline; returns seconds to the next deadline."""
        now = time.monotonic()
        nearest = None
        with self._lock:
            for worker in self._workers:
                task = worker.task
                if worker.state is not State.BUSY or task is None or task.deadline is None:
                    continue
                if now >= task.deadline:
                    task.kill_error = TaskTimeoutError(
                        f"program {task.name!r} did not finish within {task.timeout:g} s "
                        f"({task.kind}); its worker (pid {worker.pid}) was killed and replaced"
                    )
                    self._kill_locked(worker)
                else:
                    remaining = task.deadline - now
                    nearest = remaining if nearest is None else min(nearest, remaining)
        return nearest

    def _spawn(self, index: int) -> None:
        worker = WorkerProcess(
            index, self._platform, self._cache_dir, self._max_loaded, self._initializer
        )
        with self._lock:
            self._watch.add(worker.sock.fileno(), ("socket", worker))
            self._watch.add(worker.output_fd, ("output", worker))
            if index < len(self._workers):
                self._workers[index] = worker
            else:
                self._workers.append(worker)

    def _reap(self, worker: WorkerProcess) -> int | None:
        """Unregisters a dead worker, reaps it and collects the rest of its output."""
        self._watch.remove(worker.sock.fileno())
        self._watch.remove(worker.output_fd)
        returncode = worker.wait_exit(5.0)
        if returncode is None:
            worker.kill()
            returncode = worker.wait_exit(10.0)
        worker.close()
        with self._lock:
            self._retired_counters = self._retired_counters.add(CacheCounters(**worker.counters))
            worker.counters = {}
        return returncode

    def _on_worker_lost(self, worker: WorkerProcess) -> None:
        """A worker's socket ended: reap it, settle or requeue its task, start a replacement."""
        with self._lock:
            was_starting = worker.state is State.STARTING
            task, worker.task = worker.task, None
            started = task is not None and worker.started(task.id)
            worker.move(State.DEAD)
        returncode = self._reap(worker)
        tail = worker.output_tail()
        if task is not None:
            self._on_task_lost(task, worker, started, returncode, tail)
        elif was_starting:
            self._on_startup_failure(
                WorkerStartupError(
                    f"a worker {describe_exit(returncode)} while starting; its output ends "
                    f"with:\n{tail or '(nothing)'}"
                )
            )
        self._respawn(worker.index)

    def _respawn(self, index: int) -> None:
        """Starts a replacement worker; if that fails, _respawn_due tries again a second later.

        Not after the pool broke, nor while closing with nothing left to run
        (close() waits for queued tasks, which need workers).
        """
        with self._lock:
            wanted = self._broken is None and (not self._closing or bool(self._pending))
        if not wanted:
            self._respawns.pop(index, None)
            return
        try:
            self._spawn(index)
        except Exception as error:
            self._respawns[index] = time.monotonic() + RESPAWN_RETRY_SECONDS
            self._on_startup_failure(WorkerStartupError(f"a worker could not start: {error}"))
        else:
            self._respawns.pop(index, None)

    def _respawn_due(self) -> float | None:
        """Retries the replacements that are due; returns seconds to the next one."""
        now = time.monotonic()
        for index, due in list(self._respawns.items()):
            if due <= now:
                self._respawn(index)
        pending = [due - now for due in self._respawns.values()]
        return max(0.0, min(pending)) if pending else None

    def _on_task_lost(
        self, task: Task, worker: WorkerProcess, started: bool, returncode: int | None, tail: str
    ) -> None:
        """Decides the fate of a task whose worker ended before it replied."""
        error: BaseException | None = None
        with self._lock:
            if task.done:
                return
            if task.kill_error is not None:
                error = task.kill_error  # its deadline, its caller or terminate()
            elif worker.killed_by_pool or not started:
                # Not the program's fault: the worker died before taking the task
                # up, or was retired for another reason. Send it elsewhere.
                if self._broken is not None:
                    error = self._broken
                elif task.requeues >= MAX_REQUEUES:
                    error = WorkerCrashedError(
                        f"program {task.name!r} ({task.kind}) was given to {task.requeues + 1} "
                        f"workers that each died before starting it; the last "
                        f"{describe_exit(returncode)}. Its output ends with:\n"
                        f"{tail or '(nothing)'}",
                        returncode,
                        task.name,
                        tail,
                    )
                else:
                    task.requeues += 1
                    self._pending.appendleft(task)
                    return
            settled = self._settle_locked(task)
        if not settled:
            return
        if error is None:
            message = (
                f"the worker (pid {worker.pid}) running program {task.name!r} ({task.kind}) "
                f"{describe_exit(returncode)}: {likely_cause(returncode)}. "
                "Only this task failed; a replacement worker was started."
                + self._count_crash(task)
                + f"\nThe worker's output ends with:\n{tail or '(nothing)'}"
            )
            error = WorkerCrashedError(message, returncode, task.name, tail)
        self._complete(task, error)

    def _on_startup_failure(self, error: BaseException) -> None:
        if not self._started.is_set():
            self._startup_error = error
            self._started.set()
            return
        self._startup_failures += 1
        logger.warning("a replacement worker failed to start: %s", error)
        if self._startup_failures >= 3:
            self._break(error)

    def _break(self, error: BaseException) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = PoolClosedError(f"the pool is broken: {error}")
                self._broken.__cause__ = error
            pending = self._take_pending_locked()
        for task in pending:
            self._complete(task, self._broken)

    def _stop_workers(self) -> None:
        """The manager's last act: stop every worker, fail what still runs, free memory."""
        deadline = time.monotonic() + HAND_BACK_SECONDS
        while True:
            with self._lock:
                held = [w for w in self._workers if w.owner is Owner.CALLER]
                for worker in held:
                    self._kill_locked(worker)  # only after a manager failure
            if not held or time.monotonic() > deadline:
                break
            self._watch.wait(0.05)
            self._drain_wake()
        closed = PoolClosedError("the pool was closed during the task")
        with self._lock:
            stopping = [w for w in self._workers if w.owner is Owner.MANAGER]
            unsettled = []
            for worker in self._workers:
                task, worker.task = worker.task, None
                if task is not None and self._settle_locked(task):
                    unsettled.append(task)
            pending = self._take_pending_locked()
        for worker in stopping:
            self._watch.remove(worker.sock.fileno())
            self._watch.remove(worker.output_fd)
        stop_all([w for w in stopping if w.state is not State.DEAD], self._stop_grace)
        for task in unsettled:
            self._complete(task, task.kill_error or self._broken or closed)
        _cancel(pending)
        self._watch.close()
        self._segments.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- small helpers -----------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 4096):
                pass

    def _take_pending_locked(self) -> list[Task]:
        """Empties the queue; the tasks are settled (to be failed or cancelled by the caller)."""
        taken = [task for task in self._pending if self._settle_locked(task)]
        self._pending.clear()
        return taken


_RESEND = object()
"""A reply's outcome that puts its task back in the queue."""

_CANCELLED = object()
"""A queued task whose future was cancelled."""


def _earliest(*seconds: float | None) -> float | None:
    """The smallest of some waits, where None means no limit."""
    limits = [s for s in seconds if s is not None]
    return min(limits) if limits else None


def _cancel(tasks: list[Task], reason: BaseException | None = None) -> None:
    """Cancels settled tasks that never ran; a task sent again after a worker died
    (its future running already) fails with `reason` instead."""
    for task in tasks:
        task.release()
        if not task.future.cancel():
            _fail(task.future, reason or PoolClosedError("the pool was closed before the task ran"))


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _resolve(future: Future[Any], result: Any) -> None:
    try:  # noqa: SIM105 (not contextlib.suppress: this is on every task's path)
        future.set_result(result)
    except InvalidStateError:
        pass  # a cancelled Future drops its result


def _fail(future: Future[Any], error: BaseException) -> None:
    try:  # noqa: SIM105 (as in _resolve)
        future.set_exception(error)
    except InvalidStateError:
        pass
