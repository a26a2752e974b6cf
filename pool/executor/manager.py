"""The Pool's manager thread: it watches the workers, their deadlines and their deaths.

One thread waits on one epoll set (pool.executor.wait_set) holding the socket and output
pipe of every worker it holds, plus a wake-up pipe: a worker's death shows
as end of file on its socket, so a single wait point sees replies, deaths,
output and wake-ups alike, and the nearest task deadline (or replacement
due) bounds the wait. Only this thread spawns and reaps workers: their
PR_SET_PDEATHSIG is tied to the thread that spawned them, which outlives
them all. Each turn of its loop:

    complete orphans    tasks a caller thread settled but left to it, and the
                        done-callbacks relayed to it (futures.TaskFuture)
    dispatch            queued tasks to idle workers
    finished?           closing with nothing queued or running, or broken
    expire              kill workers whose task is past its deadline
    respawn due         replace workers that could not be started before
    start when needed   start the device workers deferred until a task needs
                        them or the compiles are done (pool.executor.starts)
    wait                replies, deaths, output, wake-ups

It uses the pool's parts and changes none of them but through their own
methods; nothing below it calls back into it.
"""

from __future__ import annotations

import logging
import socket
import time

import numpy as np

from pool.errors import (
    PoolClosedError,
    TaskTimeoutError,
    WorkerCrashedError,
    WorkerStartupError,
    describe_exit,
    likely_cause,
)
from pool.executor.dispatch import Dispatcher, PoolCore
from pool.executor.futures import ManagerThread, PoolFuture
from pool.executor.inputs import TaskMemory
from pool.executor.quarantine import count_crash
from pool.executor.segments import SegmentCache
from pool.executor.tasks import MAX_REQUEUES, Kind, Request, Task, ValueOp, ValueOpKind
from pool.executor.worker_memory import NOTHING, WorkerMemory
from pool.executor.worker_process import State, WorkerProcess
from pool.executor.workers import PARKED_SECONDS, Source
from worker.records import ArrayType

logger = logging.getLogger("pjrt_pool.pool")

_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)  # an int: IntFlag's | runs in Python

HAND_BACK_SECONDS = 10.0
"""How long a stopping manager waits for callers to give back the workers they hold."""


class Manager(ManagerThread):
    """The manager thread of one pool (see the module docstring)."""

    def __init__(
        self, core: PoolCore, dispatcher: Dispatcher, stop_grace: float, start_timeout: float
    ) -> None:
        super().__init__(name="pjrt-pool-manager", daemon=True)
        # The pool's parts it borrows (PoolCore says what each is to it too): the lock; the
        # queue it dispatches and whose orphans it completes, which says whether the pool
        # is closing (it ends once nothing is queued or running) or broken; the workers it
        # kills at their deadline, reaps and stops; their starts; the quarantine that
        # counts a crash; the shared memory closed when the pool ends; its one wait point.
        self._lock, self._tasks, self._workers = core.lock, core.tasks, core.workers
        self._starts, self._quarantine = core.starts, core.quarantine
        self._segments, self._wait_set = core.segments, core.wait_set
        # Sends queued tasks and reads the replies of the workers it holds.
        self._dispatcher = dispatcher
        # Seconds between the exit request, SIGTERM and SIGKILL when it stops the workers.
        self._stop_grace = stop_grace
        # Seconds a worker may take to start once the pool has (WorkerStarts.expire_starts).
        self._start_timeout = start_timeout

    def run(self) -> None:
        try:
            try:
                self._starts.start()
            except Exception as error:
                self._starts.start_failed(
                    0, WorkerStartupError(f"a worker could not start: {error}")
                )
                return
            self._loop()
        except BaseException as error:  # a bug here must fail tasks, never hang them
            logger.exception("the pool's manager thread failed")
            self._break(error)
        finally:
            self._stop_workers()

    def _loop(self) -> None:
        tasks, workers = self._tasks, self._workers
        idle = False  # the last wait saw nothing: the pool is quiet
        while True:
            self._complete_orphans()
            if idle:  # only then: a busy pool's requests bring the same, and cost no turn
                self._segments.collect()
                self._hand_back_released()
            self._dispatcher.dispatch(None)
            with self._lock:
                done = not workers.busy_locked() and (
                    tasks.broken is not None or (tasks.closing and not tasks.queued)
                )
            if done:
                return
            with self._lock:
                workers.unpark_locked()  # see pool.executor.workers: parked sockets go back
            timeout = _earliest(
                self._expire(),
                self._starts.respawn_due(),
                self._starts.start_when_needed(idle),
                PARKED_SECONDS,
            )
            takeovers = workers.takeovers  # a report may be stale if this changes (below)
            found = self._wait_set.wait(timeout)
            idle = not found
            for source, worker in found:
                if source is Source.OUTPUT:
                    if not worker.read_output():
                        self._wait_set.remove(worker.output_fd)
                    continue
                self._on_readable(worker, takeovers)

    def _hand_back_released(self) -> None:
        """Queues a release for each idle worker the pool let go of something on (values
        dropped, segments closed: WorkerMemory.pending), so that dropping a value frees its
        device memory within a quiet turn of this loop (its waits last PARKED_SECONDS at
        most), not only at the worker's next request. Only while nothing else is queued:
        a queued task brings the same to its worker."""
        with self._lock:
            if self._tasks.queued or self._tasks.closing:
                return
            for worker in self._workers.idle_workers_locked():
                if worker.memory.pending(self._segments) is not NOTHING:
                    self._tasks.push_locked(
                        _release_task(self._tasks.next_id(), worker.memory, self._segments)
                    )

    def _complete_orphans(self, last: bool = False) -> None:
        """Completes the orphans and makes the relayed calls; last: the manager is ending."""
        with self._lock:
            settled = self._tasks.take_orphans_locked()
            relayed = self._tasks.take_relayed_locked(last)
        for task, error in settled:
            task.complete(error)
        for call in relayed:
            call()

    def _on_readable(self, worker: WorkerProcess, takeovers: int) -> None:
        """A worker's socket has a message or its end of file, as a wait that began when
        the workers had seen `takeovers` take-overs reported."""
        workers = self._workers
        with self._lock:
            if worker.state is State.DEAD or worker.holder is not None:
                return  # a caller holds it: it is the caller's to read (or give back)
            if workers.takeovers != takeovers and not _has_input(worker):
                # The wait saw a reply that a caller took the socket over for and read
                # before this turn (futures.TaskFuture): nothing is there now. Only
                # then can a report be stale, so only then is the socket peeked at,
                # which keeps a system call off every other reply.
                return
            if not workers.manager_reads_locked(worker):
                return
        try:
            alive = self._dispatcher.receive(worker)
        finally:
            workers.manager_done(worker)
        if not alive:
            self._on_worker_lost(worker)

    def _expire(self) -> float | None:
        """Kills workers whose task is past its deadline; returns seconds to the next deadline."""
        now = time.monotonic()
        nearest = None
        self._starts.expire_starts(self._start_timeout)
        with self._lock:
            for worker in self._workers:
                if worker.state is not State.BUSY:
                    continue
                # Its task, and the runs sent ahead of their replies (each's deadline runs
                # until its reply is read).
                for task in (worker.task, *worker.ahead):
                    if task is None or task.deadline is None:
                        continue
                    if now >= task.deadline:
                        request = task.request
                        timed_out = TaskTimeoutError(
                            f"program {request.name!r} did not finish within "
                            f"{request.timeout:g} s ({request.kind.value}); its worker (pid "
                            f"{worker.pid}) was killed and replaced"
                        )
                        self._workers.kill_task_locked(worker, timed_out, task)
                        break
                    remaining = task.deadline - now
                    nearest = remaining if nearest is None else min(nearest, remaining)
        return nearest

    # -- deaths ------------------------------------------------------------------

    def _on_worker_lost(self, worker: WorkerProcess) -> None:
        """A worker's socket ended: reap it, settle or requeue its task, start a replacement."""
        with self._lock:
            ahead, begun = self._workers.take_ahead_locked(worker)
            task, started, was_starting = self._workers.lose_locked(worker)
        returncode = self._workers.reap(worker)
        tail = worker.output_tail()
        with self._lock:
            # Its values went with it, those of the runs sent ahead too (kept when they were
            # sent): what needed them fails, naming them.
            lost = worker.memory.lose(describe_exit(returncode))
            self._tasks.fail_pinned_locked(
                worker.memory, lost or WorkerCrashedError(f"the worker {describe_exit(returncode)}")
            )
        self._settle_ahead(worker, ahead, begun, returncode)
        if task is not None:
            self._on_task_lost(task, worker, started, returncode, tail)
        failure = worker.startup_failure
        if failure is None and was_starting:
            failure = WorkerStartupError(
                f"a worker {describe_exit(returncode)} while starting; its output ends "
                f"with:\n{tail or '(nothing)'}"
            )
        self._starts.replace(worker.index, failure)

    def _settle_ahead(
        self, worker: WorkerProcess, ahead: list[Task], begun: Task | None, returncode: int | None
    ) -> None:
        """Settles the runs sent ahead to a worker that ended before their replies: their
        values are lost (WorkerMemory.lose names them), but those of a run killed for its
        deadline fail with that. The run it was in counts as a crash of its program, unless
        the pool killed the worker."""
        with self._lock:
            for task in ahead:
                if task.kill_error is not None and task.memory is not None:
                    for value in task.memory.made:
                        value.fail(task.kill_error)
            settled = [task for task in ahead if task.settle()]
        if begun is not None and begun.kill_error is None and not worker.killed_by_pool:
            logger.warning(
                "the worker (pid %d) running program %r, sent ahead of its reply, %s: %s.%s",
                worker.pid, begun.request.name, describe_exit(returncode),
                likely_cause(returncode), count_crash(self._quarantine, begun.request),
            )  # fmt: skip
        for task in settled:
            task.release()

    def _on_task_lost(
        self, task: Task, worker: WorkerProcess, started: bool, returncode: int | None, tail: str
    ) -> None:
        """Decides the fate of a task whose worker ended before it replied."""
        error: BaseException | None = None
        request = task.request
        with self._lock:
            if task.done:
                return
            if task.kill_error is not None:
                error = task.kill_error  # its deadline, its caller, or terminate()
            elif worker.killed_by_pool or not started:
                # Not the program's fault: the worker died before taking the task
                # up, or was retired for another reason. Send it elsewhere, unless
                # it needed that worker's values, which are gone.
                if self._tasks.broken is not None:
                    error = self._tasks.broken
                elif request.worker is not None:
                    error = worker.memory.lost or WorkerCrashedError(
                        f"the worker that held the task's values {describe_exit(returncode)}"
                    )
                elif task.requeues >= MAX_REQUEUES:
                    error = WorkerCrashedError(
                        f"program {request.name!r} ({request.kind.value}) was given to "
                        f"{task.requeues + 1} workers that each died before starting it; the "
                        f"last {describe_exit(returncode)}. Its output ends with:\n"
                        f"{tail or '(nothing)'}",
                        returncode,
                        request.name,
                        tail,
                    )
                else:
                    self._tasks.requeue_locked(task, lost_worker=True)
                    return
            settled = task.settle()
        if not settled:
            return
        if error is None:
            message = (
                f"the worker (pid {worker.pid}) running program {request.name!r} "
                f"({request.kind.value}) {describe_exit(returncode)}: {likely_cause(returncode)}. "
                "Only this task failed; a replacement worker was started."
                + count_crash(self._quarantine, request)
                + f"\nThe worker's output ends with:\n{tail or '(nothing)'}"
            )
            error = WorkerCrashedError(message, returncode, request.name, tail)
        task.complete(error)

    def _break(self, error: BaseException) -> None:
        """A failure of the manager thread itself: no later task can run; the queued ones fail."""
        with self._lock:
            broken = PoolClosedError(f"the pool is broken: {error}")
            broken.__cause__ = error
            self._tasks.break_locked(broken)
            self._tasks.fail_queued_locked(PoolClosedError, str(self._tasks.broken), error)

    # -- the end ---------------------------------------------------------------

    def _stop_workers(self) -> None:
        """The manager's last act: stop every worker, fail what still runs, close what is ours."""
        workers = self._workers
        deadline = time.monotonic() + HAND_BACK_SECONDS
        while True:  # only after a failure of this thread can a caller still hold a worker
            with self._lock:
                held = workers.held_locked()
                for worker in held:
                    workers.kill_locked(worker)
            if not held or time.monotonic() > deadline:
                break
            self._wait_set.wait(0.05)
        closed = PoolClosedError("the pool was closed during the task")
        self._complete_orphans()
        with self._lock:
            stopping = [w for w in workers if w.state is not State.DEAD]
            unsettled = []
            ahead = []
            for worker in workers:
                task = workers.take_task_locked(worker)
                if task is not None and task.settle():
                    unsettled.append(task)
                ahead += [t for t in workers.take_ahead_locked(worker)[0] if t.settle()]
            self._tasks.fail_queued_locked(
                PoolClosedError, "the pool was closed before the task ran"
            )
        workers.stop(stopping, self._stop_grace)
        for task in unsettled:
            task.complete(task.kill_error or self._tasks.broken or closed)
        for task in ahead:  # their handles are out; their values die with the workers
            task.release()
        self._complete_orphans()
        self._segments.close()
        with self._lock:  # wakes write to the pipe under the lock: close it under the lock
            self._wait_set.close()
        self._complete_orphans(last=True)  # callbacks relayed since, and no more after


def _release_task(task_id: int, memory: WorkerMemory, segments: SegmentCache) -> Task:
    """A task that brings one worker what the pool let go of, and does nothing else (its
    request is a Fetch of no value: pool.executor.requests)."""
    nothing = ArrayType(np.dtype(np.uint8), (0,))
    request = Request(
        task_id,
        Kind.VALUE,
        None,
        "(release)",
        "hand back what the pool let go of",
        None,
        worker=memory,
        value=ValueOp(ValueOpKind.RELEASE, nothing),
    )
    task = Task(request, PoolFuture())
    staged = TaskMemory(zero_copy=True, declared_types=False)
    task.stage(staged)
    staged.lay_out([], None)
    staged.copy_in([], 1 << 10, segments, caller_waits=False)
    return task


def _has_input(worker: WorkerProcess) -> bool:
    """Whether a worker's socket has a message or its end of file (without reading it)."""
    try:
        worker.sock.recv(1, _PEEK)
    except BlockingIOError:
        return False
    except OSError:
        return True  # an error to read: receiving reports it
    return True


def _earliest(*seconds: float | None) -> float | None:
    """The smallest of some waits, where None means no limit."""
    limits = [s for s in seconds if s is not None]
    return min(limits) if limits else None
