"""The Pool's manager thread: it watches the workers, their deadlines and their deaths.

One thread waits on one epoll set (pool.executor.watch) holding the socket and output
pipe of every worker it holds, plus a wake-up pipe: a worker's death shows
as end of file on its socket, so a single wait point sees replies, deaths,
output and wake-ups alike, and the nearest task deadline (or replacement
due) bounds the wait. Only this thread spawns and reaps workers: their
PR_SET_PDEATHSIG is tied to the thread that spawned them, which outlives
them all. Each turn of its loop:

    complete orphans    tasks a caller thread settled but left to it
    dispatch            queued tasks to idle workers
    finished?           closing with nothing queued or running, or broken
    expire              kill workers whose task is past its deadline
    respawn due         replace workers that could not be started before
    wait                replies, deaths, output, wake-ups
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

from pool.errors import (
    PoolClosedError,
    TaskTimeoutError,
    WorkerCrashedError,
    WorkerStartupError,
    describe_exit,
    likely_cause,
)
from pool.executor.dispatch import Dispatch
from pool.executor.tasks import MAX_REQUEUES, Task
from pool.executor.workers import State, WorkerProcess, stop_all
from worker import protocol
from worker.cache import CacheCounters

logger = logging.getLogger("pjrt_pool.pool")

RESPAWN_BACKOFF_SECONDS = 0.5
"""How long after a replacement worker failed to start the pool tries again; the wait
doubles with each failure in a row, up to MAX_RESPAWN_BACKOFF_SECONDS."""

MAX_RESPAWN_BACKOFF_SECONDS = 30.0

FAILED_STARTS_TO_FAIL_QUEUE = 3
"""Failed starts in a row after which, while no worker runs, queued tasks fail (the pool
keeps trying to start workers for later tasks)."""

HAND_BACK_SECONDS = 10.0
"""How long a stopping manager waits for callers to give back the workers they hold."""


class Manager(Dispatch):
    """The manager thread's part of the Pool (see the module docstring)."""

    _worker_count: int
    _spawn_worker: Callable[[int], WorkerProcess]
    _wake_r: int
    _stop_grace: float
    _started: threading.Event
    _startup_error: BaseException | None
    _startup_failures: int
    _respawns: dict[int, float]
    _retired_counters: CacheCounters

    def _manage(self) -> None:
        try:
            try:
                for index in range(self._worker_count):
                    self._spawn(index)
            except Exception as error:
                self._start_failed(0, WorkerStartupError(f"a worker could not start: {error}"))
                return
            self._manage_loop()
        except BaseException as error:  # a bug here must fail tasks, never hang them
            logger.exception("the pool's manager thread failed")
            self._break(error)
        finally:
            self._stop_workers()

    def _manage_loop(self) -> None:
        while True:
            self._complete_orphans()
            self._dispatch(None)
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

    def _complete_orphans(self) -> None:
        with self._lock:
            orphans, self._orphans = self._orphans, []
            settled = [(task, error) for task, error in orphans if self._settle_locked(task)]
        for task, error in settled:
            self._complete(task, error)

    def _on_readable(self, worker: WorkerProcess) -> None:
        """A worker's socket has a message or its end of file."""
        with self._lock:
            if worker.state is State.DEAD or worker.holder is not None:
                return  # a caller holds it: it is the caller's to read (or give back)
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
        except Exception as error:  # not a frame of ours: the worker broke the protocol
            logger.warning("worker %d sent garbage (%r): replacing it", worker.pid, error)
            self._retire(worker)
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

    # -- workers' lives ----------------------------------------------------------

    def _spawn(self, index: int) -> None:
        worker = self._spawn_worker(index)
        with self._lock:
            self._watch.add(worker.sock.fileno(), ("socket", worker))
            self._watch.add(worker.output_fd, ("output", worker))
            if index < len(self._workers):
                self._workers[index] = worker
            else:
                self._workers.append(worker)

    def _on_ready(self, worker: WorkerProcess, ready: protocol.Ready) -> None:
        if ready.error is not None:
            error = WorkerStartupError(
                f"a worker failed to start: {ready.error.qualname}: {ready.error.message}"
            )
            error.add_note(f"Raised in the worker:\n{ready.error.traceback}")
            with self._lock:
                worker.startup_failure = error  # reported when its end is seen
                self._kill_locked(worker)
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

    def _reap(self, worker: WorkerProcess) -> int | None:
        """Unwatches a dead worker, reaps it and collects the rest of its output."""
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
        failure = worker.startup_failure
        if failure is None and was_starting:
            failure = WorkerStartupError(
                f"a worker {describe_exit(returncode)} while starting; its output ends "
                f"with:\n{tail or '(nothing)'}"
            )
        if failure is None:
            self._respawn(worker.index)
        else:
            self._start_failed(worker.index, failure)

    def _on_task_lost(
        self, task: Task, worker: WorkerProcess, started: bool, returncode: int | None, tail: str
    ) -> None:
        """Decides the fate of a task whose worker ended before it replied."""
        error: BaseException | None = None
        with self._lock:
            if task.done:
                return
            if task.kill_error is not None:
                error = task.kill_error  # its deadline, its caller, or terminate()
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
                    task.sending = False
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

    def _respawn(self, index: int) -> None:
        """Starts a replacement worker (if that fails, _start_failed schedules another try).

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
            self._start_failed(index, WorkerStartupError(f"a worker could not start: {error}"))
        else:
            self._respawns.pop(index, None)

    def _respawn_due(self) -> float | None:
        """Retries the replacements that are due; returns seconds to the next one."""
        now = time.monotonic()
        for index, due in list(self._respawns.items()):
            if due <= now:
                self._respawn(index)
        waits = [due - now for due in self._respawns.values()]
        return max(0.0, min(waits)) if waits else None

    def _start_failed(self, index: int, error: BaseException) -> None:
        """A worker did not start: the pool's start fails, or the slot is tried again later.

        After the pool started, each failure in a row doubles the wait before
        the next try and is logged. While no worker runs, queued tasks
        fail once FAILED_STARTS_TO_FAIL_QUEUE starts in a row have failed,
        since nothing could run them; the pool itself goes on trying.
        """
        if not self._started.is_set():
            self._startup_error = error
            self._started.set()
            return
        self._startup_failures += 1
        failures = self._startup_failures
        delay = min(RESPAWN_BACKOFF_SECONDS * 2 ** (failures - 1), MAX_RESPAWN_BACKOFF_SECONDS)
        self._respawns[index] = time.monotonic() + delay
        logger.warning(
            "a replacement worker failed to start (%d in a row); trying again in %.1f s: %s",
            failures,
            delay,
            error,
        )
        with self._lock:
            running = any(w.state in (State.IDLE, State.BUSY) for w in self._workers)
            if not running and failures >= FAILED_STARTS_TO_FAIL_QUEUE:
                self._fail_queued_locked(
                    WorkerStartupError,
                    f"no worker is running, and the last {failures} attempts to start one "
                    f"failed ({error}); the pool tries again in {delay:.1f} s",
                    error,
                )

    def _break(self, error: BaseException) -> None:
        """A failure of the manager thread itself: no later task can run; the queued ones fail."""
        with self._lock:
            if self._broken is None:
                self._broken = PoolClosedError(f"the pool is broken: {error}")
                self._broken.__cause__ = error
            self._fail_queued_locked(PoolClosedError, str(self._broken), error)

    # -- the end ---------------------------------------------------------------

    def _stop_workers(self) -> None:
        """The manager's last act: stop every worker, fail what still runs, close what is ours."""
        deadline = time.monotonic() + HAND_BACK_SECONDS
        while True:  # only after a failure of this thread can a caller still hold a worker
            with self._lock:
                held = [w for w in self._workers if w.holder is not None]
                for worker in held:
                    self._kill_locked(worker)
            if not held or time.monotonic() > deadline:
                break
            self._watch.wait(0.05)
            self._drain_wake()
        closed = PoolClosedError("the pool was closed during the task")
        self._complete_orphans()
        with self._lock:
            stopping = [w for w in self._workers if w.state is not State.DEAD]
            unsettled = []
            for worker in self._workers:
                task, worker.task = worker.task, None
                if task is not None and self._settle_locked(task):
                    unsettled.append(task)
            self._fail_queued_locked(PoolClosedError, "the pool was closed before the task ran")
        for worker in stopping:
            self._watch.remove(worker.sock.fileno())
            self._watch.remove(worker.output_fd)
        # A worker a caller still holds (it never gave it back) is killed and
        # reaped, but its socket stays open: that caller may still use it.
        stop_all([w for w in stopping if w.holder is None], self._stop_grace)
        for worker in stopping:
            if worker.holder is not None:
                worker.wait_exit(1.0)
        with self._lock:
            for worker in stopping:
                worker.move(State.DEAD)
        for task in unsettled:
            self._complete(task, task.kill_error or self._broken or closed)
        self._complete_orphans()
        self._segments.close()
        with self._lock:  # _wake writes to the pipe under the lock: close it under the lock
            self._watch.close()
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 4096):
                pass


def _earliest(*seconds: float | None) -> float | None:
    """The smallest of some waits, where None means no limit."""
    limits = [s for s in seconds if s is not None]
    return min(limits) if limits else None
