"""Pool: compile and run programs in crash-isolated PJRT worker processes.

Data flow::

    caller threads                  manager thread                 workers
    ──────────────                  ──────────────                 ───────
    submit(program, args)
      check + convert args
      copy into a memfd  ──▶ pending ──▶ dispatch to an idle worker ──▶ python -m worker
      return Future                     (prefer one that has the       compile or load
                                         program loaded)               (shared disk cache)
                                                                       run: PJRT reads the
                                                                       memfd, writes outputs
                                    reply + output memfd  ◀────────── into a new memfd
    Future.result() ◀── numpy views of the output memfd
                                    worker died? ──▶ fail its task only, with the signal,
                                                     program and stderr tail; respawn
                                    task too slow? ──▶ kill that worker, fail, respawn

The manager thread is the only one that talks to workers after start-up. It
waits on one selector holding every worker's socket and output pipe plus a
wake-up pipe for new tasks: a worker's death shows as end-of-file on its
socket, so one wait point sees replies, deaths and new work alike, and the
next task deadline bounds the wait.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import logging
import os
import selectors
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from pool.compiling import CompileResult, CompilesMany
from pool.errors import (
    PoolClosedError,
    ProgramQuarantinedError,
    TaskTimeoutError,
    WorkerCrashedError,
    WorkerStartupError,
    describe_exit,
    likely_cause,
    rebuild_error,
)
from pool.segments import DEFAULT_CACHE_BYTES, SegmentCache
from pool.tasks import Task, program_id, stage_inputs
from pool.workers import ARENA_SIZE, State, WorkerProcess, pickle_initializer
from worker import protocol, shm
from worker.arguments import prepare_arguments
from worker.cache import CacheCounters
from worker.conformance_memo import warn_known_failures
from worker.records import ArrayType, CompileStatistics, LoweredProgram, ProgramSpec

logger = logging.getLogger("pjrt_pool.pool")


DIRECT_SPIN_SECONDS = 500e-6
"""How long Pool.run polls for a worker's reply before sleeping (protocol.spin_until_readable)."""

ARENA_INPUT_LIMIT = ARENA_SIZE // 4
"""Inputs up to this many bytes go through the worker's arena; outputs use the rest.

Smaller tasks then cost no system calls for memory, and their outputs are
copied out of the arena (cheaper than mapping a segment for a few KB). Larger
outputs get a segment of their own that the returned arrays view, with no copy.
"""

_live_pools: weakref.WeakSet[Pool] = weakref.WeakSet()


@atexit.register
def _terminate_live_pools() -> None:
    for live in list(_live_pools):
        live.terminate()


class Pool(CompilesMany):
    """Worker processes that compile and run LoweredPrograms, each with its own plugin.

    workers is the number of processes (default: the CPU count). platform
    names the plugin to load (default: PJRT_POOL_PLATFORM, else "cpu").
    cache_dir is the shared disk cache (default: PJRT_POOL_CACHE_DIR, else
    the user cache directory). task_timeout bounds each task's time in a
    worker (None: no bound); a task past it has its worker killed and
    replaced. initializer(*initargs) runs in each worker after its plugin
    loads, for example to register custom calls; if it raises, the pool does
    not start. A program that crashes max_crashes workers is quarantined.
    Each worker keeps max_loaded executables loaded. Up to segment_cache_bytes
    of shared memory from finished large inputs and outputs is kept for
    reuse, since fresh shared memory is slow to fault in.

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
    ) -> None:
        count = (os.cpu_count() or 1) if workers is None else workers
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"workers must be a positive int, not {workers!r}")
        if task_timeout is not None and task_timeout <= 0:
            raise ValueError(f"task_timeout must be positive or None, not {task_timeout!r}")
        self._platform = platform
        self._cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        self._task_timeout = task_timeout
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
        self._segments = SegmentCache(segment_cache_bytes)
        self._retired_counters = CacheCounters()
        self._startup_failures = 0
        self._started = threading.Event()
        self._startup_error: BaseException | None = None

        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._workers: list[WorkerProcess] = []
        try:
            for index in range(count):
                self._spawn(index)
        except BaseException:
            self._abandon_start()
            raise
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
    ) -> Future[list[np.ndarray]]:
        """Runs a program in a worker (compiling or loading it there first); returns a Future.

        The arguments are checked and converted to the program's input types
        here, raising the same TypeError or ValueError as Executable.run. The
        Future's result is the list of outputs as numpy arrays that view
        shared memory, freed when the arrays are.
        """
        return self._enqueue(self._run_task(program, arguments, name, timeout, zero_copy))

    def _run_task(
        self,
        program: LoweredProgram,
        arguments: Sequence[ArrayLike],
        name: str | None,
        timeout: float | None,
        zero_copy: bool | None,
    ) -> Task:
        checked = self._check_program(program)
        return self._staged(self._new_task("run", checked, name, timeout), arguments, zero_copy)

    def _staged(self, task: Task, arguments: Sequence[ArrayLike], zero_copy: bool | None) -> Task:
        """Checks and converts a run task's arguments and puts them in shared memory."""
        types = task.program.input_types if task.program is not None else task.spec_types
        arrays = prepare_arguments(arguments, types)
        task.zero_copy = self._zero_copy if zero_copy is None else zero_copy
        task.declared_types = types is not None
        layout = self._input_layout(task.program_id, types)
        stage_inputs(task, arrays, ARENA_INPUT_LIMIT, self._segments, layout)
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
        task = self._new_task("run", None, spec.name, timeout, spec=spec)
        return self._enqueue(self._staged(task, arguments, None))

    def run(
        self,
        program: LoweredProgram,
        arguments: Sequence[ArrayLike],
        *,
        name: str | None = None,
        timeout: float | None = None,
    ) -> list[np.ndarray]:
        """Runs a program in a worker and returns its outputs (see submit).

        When a worker is idle and no task waits, the calling thread talks to
        the worker itself instead of going through the manager thread: one
        thread switch less per call, which is most of a small program's
        round trip.
        """
        task = self._run_task(program, arguments, name, timeout, None)
        worker = self._claim_directly(task)
        if worker is None:
            return self._enqueue(task).result()
        return self._run_directly(worker, task)

    def _claim_directly(self, task: Task) -> WorkerProcess | None:
        """Claims an idle worker for the caller's thread, or returns None (use the queue)."""
        if task.timeout is not None:
            return None  # deadlines are the manager's to watch
        with self._lock:
            if self._closing or self._broken is not None or self._pending:
                return None
            if task.program_id in self._quarantined:
                return None  # the queue reports it
            idle = [w for w in self._workers if w.state is State.IDLE]
            if not idle:
                return None
            worker = next((w for w in idle if task.program_id in w.loaded), idle[0])
            worker.state = State.BUSY
            worker.task = task
            # The manager must not read this worker's replies meanwhile.
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(worker.sock)
        return worker

    def _run_directly(self, worker: WorkerProcess, task: Task) -> list[np.ndarray]:
        """Sends a claimed worker its task and reads the reply in the caller's thread."""
        message, fds = self._request_for(task, worker)
        task.future.set_running_or_notify_cancel()
        try:
            worker.send(message, fds)
            protocol.spin_until_readable(worker.sock, DIRECT_SPIN_SECONDS)
            reply, reply_fds = worker.receive()
        except (OSError, protocol.ConnectionLostError):
            # The worker died: hand it back, and the manager fails the task.
            self._hand_back(worker)
            return task.future.result()
        self._hand_back(worker)
        self._on_message(worker, reply, reply_fds)
        self._dispatch()  # a task requeued by the reply, or queued meanwhile
        return task.future.result()

    def _hand_back(self, worker: WorkerProcess) -> None:
        """Lets the manager watch a directly used worker's socket again."""
        with self._lock:
            if worker.state is not State.DEAD:
                # epoll takes the change even while the manager is waiting in it.
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.register(worker.sock, selectors.EVENT_READ, ("socket", worker))

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
        (one replica, one partition). The plugin checks it: malformed options
        can make the plugin abort, which fails only this task.
        """
        task = self._new_task("compile", self._check_program(program), name, timeout)
        if compile_options is not None:
            if not isinstance(compile_options, bytes):
                raise TypeError("compile_options must be bytes (a serialized CompileOptionsProto)")
            task.compile_options = compile_options
        return self._enqueue(task)

    def compile(
        self, program: LoweredProgram, *, name: str | None = None, timeout: float | None = None
    ) -> ProgramSpec:
        """Compiles (or loads) a program in a worker and returns its ProgramSpec."""
        return self.submit_compile(program, name=name, timeout=timeout).result().spec

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

        Workers get an Exit request, then SIGTERM, then SIGKILL, and are
        reaped. Calling close again does nothing.
        """
        with self._lock:
            self._closing = True
            if cancel_pending:
                self._cancel_pending_locked()
        self._wake()
        if self._manager.is_alive() and threading.current_thread() is not self._manager:
            self._manager.join()
        _live_pools.discard(self)

    def terminate(self) -> None:
        """Stops at once: cancels queued tasks, kills the workers, fails running tasks."""
        with self._lock:
            self._closing = True
            self._broken = self._broken or PoolClosedError("the pool was terminated")
            self._cancel_pending_locked()
            for worker in self._workers:
                worker.kill()
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

    # -- submission ---------------------------------------------------------

    @staticmethod
    def _check_program(program: Any) -> LoweredProgram:
        if not isinstance(program, LoweredProgram):
            raise TypeError(
                f"the pool runs LoweredPrograms (from pool.lower), not {type(program).__name__}"
            )
        return program

    def _new_task(
        self,
        kind: str,
        program: LoweredProgram | None,
        name: str | None,
        timeout: float | None,
        spec: ProgramSpec | None = None,
    ) -> Task:
        """A task for a program, or (program None) for the executable a ProgramSpec names."""
        if program is None:
            assert spec is not None
            identity, name, key = spec.key, name or spec.name, spec.key
        else:
            identity, name, key = program_id(program), name or program.name, None
        return Task(
            id=next(self._task_ids),
            kind=kind,
            program=program,
            program_id=identity,
            name=name,
            future=Future(),
            timeout=self._task_timeout if timeout is None else timeout,
            cache_key=key,
            spec_types=None if spec is None else spec.input_types,
        )

    def _enqueue(self, task: Task) -> Future[Any]:
        with self._lock:
            if self._closing or self._broken is not None:
                task.release()
                raise self._broken or PoolClosedError("the pool is closed")
            reason = self._quarantined.get(task.program_id)
            if reason is not None:
                task.release()
                raise ProgramQuarantinedError(reason)
            self._pending.append(task)
        # Dispatch from the caller's thread: waking the manager thread for it
        # would cost a thread switch (and a GIL hand-off) on every task.
        self._dispatch()
        if task.timeout is not None:
            self._wake()  # the manager's next wait must end at this deadline
        return task.future

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _cancel_pending_locked(self) -> None:
        while self._pending:
            task = self._pending.popleft()
            task.release()
            task.future.cancel()

    # -- processes (manager thread, except during start-up) -------------------

    def _spawn(self, index: int) -> WorkerProcess:
        worker = WorkerProcess(
            index, self._platform, self._cache_dir, self._max_loaded, self._initializer
        )
        self._selector.register(worker.sock, selectors.EVENT_READ, ("socket", worker))
        self._selector.register(worker.output_fd, selectors.EVENT_READ, ("output", worker))
        with self._lock:
            if index < len(self._workers):
                self._workers[index] = worker
            else:
                self._workers.append(worker)
        return worker

    def _abandon_start(self) -> None:
        for worker in self._workers:
            worker.kill()
            worker.stop(0.1)

    def _forget(self, worker: WorkerProcess) -> int | None:
        """Unregisters a dead worker, reaps it and collects the rest of its output."""
        for item in (worker.sock, worker.output_fd):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(item)
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
        with self._lock:  # settles a race with a thread claiming the worker directly
            if worker.state is State.DEAD:
                return
            was_starting = worker.state is State.STARTING
            worker.state = State.DEAD
        returncode = self._forget(worker)
        task, worker.task = worker.task, None
        tail = worker.output_tail()
        if task is not None:
            self._fail_crashed(task, worker, returncode, tail)
        elif was_starting:
            self._on_startup_failure(
                WorkerStartupError(
                    f"a worker {describe_exit(returncode)} while starting; its output ends "
                    f"with:\n{tail or '(nothing)'}"
                )
            )
        if not self._closing and self._broken is None:
            self._spawn(worker.index)

    def _fail_crashed(
        self, task: Task, worker: WorkerProcess, returncode: int | None, tail: str
    ) -> None:
        if worker.timed_out:
            error: BaseException = TaskTimeoutError(
                f"program {task.name!r} did not finish within {task.timeout:g} s "
                f"({task.kind}); its worker (pid {worker.pid}) was killed and replaced"
            )
        else:
            self._crashes[task.program_id] += 1
            crashes = self._crashes[task.program_id]
            message = (
                f"the worker (pid {worker.pid}) running program {task.name!r} ({task.kind}) "
                f"{describe_exit(returncode)}: {likely_cause(returncode)}. "
                "Only this task failed; a replacement worker was started."
            )
            if crashes >= self._max_crashes:
                reason = (
                    f"program {task.name!r} crashed {crashes} workers and is quarantined: "
                    "this pool will not run it again"
                )
                with self._lock:
                    self._quarantined[task.program_id] = reason
                message += f" It has now crashed {crashes} workers and is quarantined."
            message += f"\nThe worker's output ends with:\n{tail or '(nothing)'}"
            error = WorkerCrashedError(message, returncode, task.name, tail)
        task.release()
        _fail(task.future, error)

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
            self._broken = PoolClosedError(f"the pool is broken: {error}")
            self._broken.__cause__ = error
            pending = list(self._pending)
            self._pending.clear()
        for task in pending:
            task.release()
            _fail(task.future, self._broken)

    # -- messages (manager thread) -------------------------------------------

    def _on_message(self, worker: WorkerProcess, message: Any, fds: list[int]) -> None:
        if isinstance(message, protocol.Ready):
            _close_all(fds)
            self._on_ready(worker, message)
            return
        task = worker.task
        if not isinstance(message, protocol.Reply) or task is None or message.task_id != task.id:
            _close_all(fds)
            logger.warning("worker %d sent an unexpected message %r", worker.pid, message)
            return
        with self._lock:
            if message.counters is not None:
                worker.counters = message.counters
            if message.statistics is not None:
                self._statistics = self._statistics.add(message.statistics)
        outcome: Any
        try:
            outcome = self._outcome(worker, task, message, fds)
        except Exception as error:  # the task's own failure, or reading its outputs failed
            outcome = error
        finally:
            _close_all(fds)
        # Only now may the worker (and its arena) take another task.
        with self._lock:
            worker.task = None
            worker.state = State.IDLE
            if outcome is _RESEND:
                self._pending.appendleft(task)
                return
        task.release()
        if isinstance(outcome, BaseException):
            _fail(task.future, outcome)
        else:
            _resolve(task.future, outcome)

    def _outcome(
        self, worker: WorkerProcess, task: Task, reply: protocol.Reply, fds: list[int]
    ) -> Any:
        """Returns a reply's result (or _RESEND to send the task again); raises its error."""
        if reply.error is not None:
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
            return CompileResult(reply.spec, reply.statistics or CompileStatistics())
        types = reply.output_types
        if types is None:
            types = self._output_types[task.program_id]
        else:
            self._output_types[task.program_id] = types
        if reply.output_place == "arena":
            # The arena is reused by the next task: copy the (small) outputs out.
            return [view.copy() for view in shm.views(worker.arena, types, reply.output_offsets)]
        if reply.output_place == "given":
            fd, capacity = task.output_fd, task.output_capacity
            task.output_fd = -1  # the outputs' arrays own the segment now
        else:
            fd, capacity = fds.pop(0), reply.output_size
        segment = shm.attach(fd, capacity, keep_fd=True)
        # When the arrays are garbage, the segment goes back for reuse.
        self._segments.adopt(segment, fd, capacity)
        return shm.views(segment, types, reply.output_offsets)

    def _on_ready(self, worker: WorkerProcess, ready: protocol.Ready) -> None:
        if ready.error is not None:
            error = WorkerStartupError(
                f"a worker failed to start: {ready.error.qualname}: {ready.error.message}"
            )
            error.add_note(f"Raised in the worker:\n{ready.error.traceback}")
            worker.kill()
            self._forget(worker)
            self._on_startup_failure(error)
            return
        worker.state = State.IDLE
        worker.plugin = ready.plugin
        worker.startup_seconds = time.monotonic() - worker.started_at
        self._startup_failures = 0
        if not self._started.is_set() and all(w.state is not State.STARTING for w in self._workers):
            self._started.set()

    # -- dispatch and deadlines (manager thread) ------------------------------

    def _dispatch(self) -> None:
        """Sends pending tasks to idle workers; called by the manager and by submitters.

        A worker is claimed (made BUSY, given its task) under the lock, so only
        the claiming thread sends to it; the manager reads its reply later.
        """
        while True:
            with self._lock:
                idle = [w for w in self._workers if w.state is State.IDLE]
                if not idle or not self._pending or self._broken is not None:
                    return
                task = self._pending.popleft()
                reason = self._quarantined.get(task.program_id)
                if reason is None and not task.future.cancelled():
                    worker = next((w for w in idle if task.program_id in w.loaded), idle[0])
                    worker.state = State.BUSY
                    worker.task = task
                    if task.timeout is not None:
                        task.deadline = time.monotonic() + task.timeout
            if reason is not None:
                task.release()
                _fail(task.future, ProgramQuarantinedError(reason))
                continue
            if task.future.cancelled():
                task.release()
                continue
            message, fds = self._request_for(task, worker)
            # A Future cancelled from here on still runs; its result is dropped.
            if not task.future.running():
                task.future.set_running_or_notify_cancel()
            try:
                worker.send(message, fds)
            except OSError:
                # The worker died before taking the task: requeue the task, and
                # let the end-of-file on the worker's socket replace the worker.
                with self._lock:
                    worker.task = None
                    self._pending.appendleft(task)
                continue

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
        start = shm.aligned(task.input_size) if task.arrays is not None else 0
        if shm.layout(types, start)[1] <= ARENA_SIZE:
            return
        recycled = self._segments.take(shm.layout(types)[1])
        if recycled is not None:
            task.output_fd, task.output_capacity = recycled
            task.segments = self._segments

    def _expire(self) -> float | None:
        """Kills workers whose task is past its deadline; returns seconds to the next deadline."""
        now = time.monotonic()
        nearest = None
        for worker in list(self._workers):
            task = worker.task
            if task is None or task.deadline is None or worker.state is not State.BUSY:
                continue
            if now >= task.deadline:
                worker.timed_out = True
                worker.kill()
            else:
                remaining = task.deadline - now
                nearest = remaining if nearest is None else min(nearest, remaining)
        return nearest

    def _manage(self) -> None:
        try:
            self._manage_loop()
        except BaseException as error:  # a bug here must fail tasks, never hang them
            logger.exception("the pool's manager thread failed")
            self._break(error)
            for worker in self._workers:
                if worker.task is not None:
                    _fail(worker.task.future, PoolClosedError(f"the pool failed: {error}"))
        finally:
            self._stop_workers()

    def _manage_loop(self) -> None:
        while True:
            self._dispatch()
            with self._lock:
                busy = any(w.state in (State.BUSY, State.STARTING) for w in self._workers)
                finished = self._closing and not self._pending and not busy
            if finished or (self._broken is not None and not busy):
                return
            timeout = self._expire()
            for key, _ in self._selector.select(timeout):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 4096):
                            pass
                    continue
                kind, worker = key.data
                if worker.state is State.DEAD:
                    continue
                if kind == "output":
                    if not worker.read_output():
                        with contextlib.suppress(KeyError, ValueError):
                            self._selector.unregister(worker.output_fd)
                    continue
                try:
                    message, fds = worker.receive()
                except (protocol.ConnectionLostError, ConnectionResetError, OSError):
                    self._on_worker_lost(worker)
                    continue
                self._on_message(worker, message, fds)

    def _stop_workers(self) -> None:
        for worker in self._workers:
            if worker.state is not State.DEAD:
                for item in (worker.sock, worker.output_fd):
                    with contextlib.suppress(KeyError, ValueError):
                        self._selector.unregister(item)
                task = worker.task
                worker.stop(self._stop_grace)
                if task is not None:
                    task.release()
                    _fail(task.future, PoolClosedError("the pool was closed during the task"))
        with self._lock:
            self._cancel_pending_locked()
        self._selector.close()
        self._segments.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


_RESEND = object()
"""A reply's outcome that puts its task back in the queue."""


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _resolve(future: Future[Any], result: Any) -> None:
    if not future.done():  # a cancelled Future drops its result
        future.set_result(result)


def _fail(future: Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
