"""The caller's path: what a calling thread does with the workers itself.

Most tasks a caller's thread hands to the pool never need the manager
thread: waking it and then the caller again costs two thread switches,
which is most of a small program's round trip. So the calling thread does
the work itself where it can, and this part is everything it does:

    enqueue          queue a task and dispatch from the caller's thread
    enqueue_compiled the same, for a run once the compile before it is done
    claim            an idle worker for the caller's own run (Pool.run), or one
                     whose runs sent ahead await their replies
    run_directly     send that worker the task and read its reply here; or, for
                     a run that keeps every output, send it ahead of its reply
                     (Pool's dispatch_ahead): its handles come back at once, and
                     its reply is read by the next call to the worker (drain)
                     or by the manager
    read_reply       a caller waiting in TaskFuture.result() takes the socket of
                     the worker running its task over and reads the reply itself
    relay            the done-callbacks of futures a caller completed go to the
                     manager thread, where every callback runs
    recover          after an exception in a caller's call (a Ctrl-C lands at
                     any call): give back the workers it holds, stop its task

Every change it makes to tasks and workers goes through their owners'
methods (pool.executor.tasks, pool.executor.workers) under the pool's lock.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pool.errors import PoolClosedError, PoolError
from pool.executor import forks
from pool.executor.dispatch import Dispatcher
from pool.executor.futures import TaskFuture, remaining
from pool.executor.quarantine import Quarantine
from pool.executor.requests import Requests
from pool.executor.tasks import Task, Tasks, TaskState
from pool.executor.values import failure_of
from pool.executor.wait_set import WaitSet
from pool.executor.worker_process import WorkerProcess
from pool.executor.workers import Workers
from worker.wire import protocol

DIRECT_SPIN_SECONDS = 500e-6
"""How long a caller polls for a worker's reply before sleeping (protocol.spin_until_readable)."""

LONG_SPIN_SECONDS = 2e-3
"""How long Pool.run's caller polls, at most, for the reply of a program whose last reply
came later than DIRECT_SPIN_SECONDS (a quarter longer than that reply took), where the
machine has CPUs to spare (LONG_SPIN_CPUS); a program slower than this is slept for."""

LONG_SPIN_CPUS = 4
"""The CPUs a process needs for its callers to spin past DIRECT_SPIN_SECONDS. A spinning
caller takes a CPU that the worker and the plugin's threads may want for the run; with
fewer (a 2-CPU machine) the poll stays DIRECT_SPIN_SECONDS (docs/facts.md, "Waiting for a
reply")."""


def spins_long() -> bool:
    """Whether this process may spin past DIRECT_SPIN_SECONDS for a reply (LONG_SPIN_CPUS)."""
    return len(os.sched_getaffinity(0)) >= LONG_SPIN_CPUS


class CallerPath:
    """What a calling thread does with the pool's workers itself (see the module docstring)."""

    def __init__(
        self,
        lock: threading.Lock,
        tasks: Tasks,
        workers: Workers,
        dispatcher: Dispatcher,
        quarantine: Quarantine,
        wait_set: WaitSet,
        manager: threading.Thread,
        owner: int,
        requests: Requests,
        ahead: int,
    ) -> None:
        self._lock = lock  # the pool's: claims, take-overs and settling happen under it
        self._tasks = tasks  # the queue its tasks join, the relayed calls, settling
        self._workers = workers  # claimed, taken over, given back, killed here
        self._dispatcher = dispatcher  # sends requests and handles replies on this thread
        self._quarantine = quarantine  # refuses a quarantined program's task
        self._wait_set = wait_set  # woken for what only the manager may do
        self._manager = manager  # reads every reply it holds: its own calls read none here
        self._owner = owner  # the process that made the pool (see pool.executor.forks)
        self._requests = requests  # says which runs may go ahead of their replies
        self._ahead = ahead  # how many runs may be out ahead of their replies (dispatch_ahead)
        # How long each program's last direct run took from its send to its reply read, where
        # callers may spin for as long (spins_long): a reply that comes after the short spin
        # costs a sleep's wake-up, which a run of a millisecond on a device feels.
        self._reply_seconds: dict[str, float] | None = {} if spins_long() else None

    # -- queueing ---------------------------------------------------------------

    def enqueue(self, task: Task) -> Future[Any]:
        """Queues a task and dispatches what is queued; the caller's except clause runs
        recover for whatever raises here."""
        with self._lock:
            refusal = self.refusal_locked(task)
            if refusal is None:
                self._tasks.push_locked(task)
        if refusal is not None:
            raise refusal
        # Dispatch from the caller's thread: waking the manager thread for it
        # would cost a thread switch (and a GIL hand-off) on every task.
        self._dispatcher.dispatch(threading.get_ident())
        return task.future

    def enqueue_compiled(self, task: Task, done: Future[Any]) -> None:
        """Queues a run whose program a compile worker compiled first, as the compile's future's
        done-callback (on whichever thread completed it): the compile's failure, or its
        cancellation, is the run's; so is the pool's closing meanwhile."""
        error = (
            done.exception()
            if not done.cancelled()
            else PoolClosedError(
                f"the compile of {task.request.name!r} before its run was cancelled"
            )
        )
        if error is None:
            try:
                self.enqueue(task)
                return
            except Exception as refused:  # the pool closed meanwhile
                error = refused
            except BaseException as interrupted:
                # A Ctrl-C in the caller's thread (the callback of a compile done
                # already runs there): a worker it claimed goes back, the run stops.
                self.recover(task, interrupted)
                raise
        if task.settle():
            task.complete(error)

    def refusal_locked(self, task: Task) -> BaseException | None:
        """Why the pool will not take a task now (closed, broken, quarantined); else None."""
        refusal = self._tasks.refusal_locked()
        pinned = task.request.worker
        if refusal is None and pinned is not None:
            refusal = self._workers.lost_locked(pinned)
        return refusal or self._quarantine.refusal_locked(task.request.program_id)

    # -- the direct path of Pool.run -----------------------------------------

    def claim(self, task: Task) -> WorkerProcess | None:
        """Claims an idle worker for the caller's thread, or returns None (use the queue)."""
        with self._lock:
            kind = task.request.kind
            competing = self._workers.competing_kinds(kind)
            if self._tasks.queued_of(competing) or self.refusal_locked(task) is not None:
                return None  # the queue keeps the order, or reports the refusal
            request = task.request
            worker = self._workers.idle_locked(request.program_id, kind, request.worker)
            if worker is None and self._ahead:
                worker = self._workers.ahead_locked(request.program_id, kind, request.worker)
            if worker is None:
                return None
            # No set_running_or_notify_cancel: Pool.run's future is its own, so
            # nothing can cancel it, and a pending future settles as well.
            self._workers.claim_locked(worker, task, threading.get_ident())
        return worker

    def run_directly(self, worker: WorkerProcess, task: Task) -> None:
        """Sends a claimed worker its task and reads the reply in the caller's thread.

        Handling the reply gives the worker back (idle); a dead worker is
        given back for the manager to reap (which fails or requeues the
        task); one that breaks the protocol is retired. An exception of
        this thread's own is put right by recover. A run that may go ahead
        of its reply (Requests.goes_ahead) is sent and not waited for. The
        replies of the runs sent ahead to the worker are read first (drain);
        one that failed to make a value this task takes fails it here, with
        that run's error.
        """
        ahead = self._ahead > 0 and self._requests.goes_ahead(task, worker)
        if worker.ahead:
            if not self._drain(worker, ahead):
                return  # it died: given back, the manager reaps it and settles the task
            # The replies read may change what the run goes as (a program unloaded).
            ahead = ahead and self._requests.goes_ahead(task, worker)
            if not ahead and worker.ahead and not self._drain(worker, False):
                return
            assert task.memory is not None
            operation = task.request.value  # a fetch's value
            named = task.memory.values.values()
            failure = failure_of(named if operation is None else (*named, operation.value))
            if failure is not None:
                raise failure  # recover gives the worker back and fails the task with it
        if ahead:
            self._dispatcher.send_ahead(worker, task)
            return
        if not self._dispatcher.send(worker, task):
            return  # dead or broken, and retired: it cannot have started the task
        program_id, sent = task.request.program_id, time.perf_counter()
        protocol.spin_until_readable(worker.poller, self._spin_seconds(program_id))
        self.receive_directly(worker)
        if self._reply_seconds is not None:
            self._reply_seconds[program_id] = time.perf_counter() - sent

    def _spin_seconds(self, program_id: str) -> float:
        """How long to poll for the reply of a run of this program before sleeping: a little
        past its last reply where callers spin long (spins_long), else DIRECT_SPIN_SECONDS; a
        reply later than LONG_SPIN_SECONDS is slept for (the wake-up is small beside it, and
        the spin would only burn the CPU)."""
        if self._reply_seconds is None:
            return DIRECT_SPIN_SECONDS
        expected = self._reply_seconds.get(program_id, 0.0) * 1.25
        return (
            expected if DIRECT_SPIN_SECONDS < expected <= LONG_SPIN_SECONDS else DIRECT_SPIN_SECONDS
        )

    def _drain(self, worker: WorkerProcess, ahead: bool) -> bool:
        """Reads the replies of the runs sent ahead to a worker this thread claimed, in
        order: every one before a run that waits for its own reply, else those there
        already, and the oldest while dispatch_ahead runs are out (a run sent ahead is
        answered once the worker dispatched it, so this waits for the worker, not the
        device). False when the worker died or broke the protocol (given back, for the
        manager to reap)."""
        poller, limit = worker.poller, self._ahead
        while worker.ahead:
            if ahead and len(worker.ahead) < limit:
                if not poller.poll(0):
                    break  # nothing there: read with a later call
            else:
                # No timeout: a deadline passed kills the worker, whose end of file ends this.
                protocol.wait_until_readable(poller, DIRECT_SPIN_SECONDS, None)
            if not self._dispatcher.receive(worker) or worker.holder is None:
                self._workers.give_back(worker)  # (nothing to give back once retired)
                return False
        return True

    def receive_directly(self, worker: WorkerProcess) -> None:
        """Reads and handles the reply of a worker the caller's thread holds, which handling
        gives back; then dispatches what was queued meanwhile."""
        if not self._dispatcher.receive(worker):
            self._workers.give_back(worker)  # it died: the manager reaps it and settles the task
        if self._tasks.queued:  # queued meanwhile, or the reply asked to send the task again
            self._dispatcher.dispatch(threading.get_ident())

    # -- a caller waiting for a future reads its reply (TaskFuture.result) ----------

    def read_reply(self, future: TaskFuture, timeout: float | None) -> float | None:
        """Reads the reply of a future's task in the caller's thread, if a worker runs the
        task, the manager is not reading its reply and no task is queued; returns the
        timeout left.

        The caller takes the worker's socket over (Workers.take_over_locked),
        waits for the reply as Pool.run does (a spin, then a sleep up to the
        timeout) and reads it: the task is settled here, with no wake-up of
        the manager thread and then of this one. Nothing within the timeout,
        or an exception while waiting (a Ctrl-C), gives the socket back with
        the task still running; an exception while reading stops the task
        (recover), as in Pool.run.
        """
        # With tasks queued the pool is saturated: the manager reads replies and
        # refills the workers anyway, and a caller spinning for one reply would take
        # a core from them. The queue is read here without the lock, as a hint, and
        # again under it before a take-over: the lock on every result() of a
        # saturated pool cost 8-14% of its throughput in alternating runs.
        if self._tasks.queued:
            return timeout
        me = threading.get_ident()
        if me == self._manager.ident or self._owner != forks.pid:
            return timeout  # the manager reads every reply it holds; a forked child none
        since = time.monotonic()
        task = None
        try:
            with self._lock:
                queued = self._tasks.queued  # the hint above may be stale
                worker = None if queued else self._workers.take_over_locked(future, me)
            if worker is None:
                return timeout
            task = worker.task
            if not protocol.wait_until_readable(worker.poller, DIRECT_SPIN_SECONDS, timeout):
                self._workers.give_back(worker)
                return remaining(timeout, since)
        except BaseException:
            self.give_back_held(me)  # nothing was read: the task runs on
            raise
        try:
            self.receive_directly(worker)
        except BaseException as error:
            assert task is not None
            self.recover(task, error)
            raise
        return remaining(timeout, since)

    def relay(self, call: Callable[[], object]) -> bool:
        """Has the manager thread make a call (a done-callback, see TaskFuture); False once
        the manager has ended."""
        with self._lock:
            return self._tasks.relay_locked(call)

    # -- putting right what an exception left ----------------------------------------

    def give_back_held(self, me: int) -> None:
        """Gives every worker this thread holds back to the manager, as they are."""
        with self._lock:
            for worker in self._workers.held_by_locked(me):
                self._workers.give_back_locked(worker)

    def recover(self, own: Task, error: BaseException) -> None:
        """Puts right what an exception left in a caller's call: its workers and its task.

        Runs in the except clause of every call that may claim a worker (run,
        and the submits), so that an exception (a Ctrl-C lands at any call)
        anywhere between claiming a worker and giving it back leaves the pool
        as it should be. A worker this thread still holds goes back to the
        manager: killed and replaced if its request may be out or cut short
        (another thread's task then goes to another worker), idle if nothing
        was sent (another thread's task back to the queue). The caller's own
        task is stopped: failed with the error, or with a PoolError for an
        interruption; a task settled already gets its shared memory back
        (giving back twice is harmless). Cheap and harmless when nothing is
        held, as after the task's own error.
        """
        me = threading.get_ident()
        failure = (
            error
            if isinstance(error, Exception)
            else PoolError(f"the call was interrupted ({type(error).__name__}); its task stopped")
        )
        settled = False
        workers, tasks = self._workers, self._tasks
        with self._lock:
            for worker in workers.held_by_locked(me):
                held = worker.task
                if worker.reading or (held is not None and held.sent):
                    workers.retire_locked(worker)  # a frame may be cut short, either way
                    continue
                if held is not None and held is not own:
                    tasks.requeue_locked(held)
                workers.unclaim_locked(worker)
            if own.state is TaskState.AHEAD:
                pass  # sent ahead, its handles made: its reply settles it
            elif not own.done:
                running = workers.running_locked(own)
                if running is not None:
                    workers.kill_task_locked(running, failure)
                else:
                    tasks.unqueue_locked(own)
                    settled = own.settle()
            if tasks.queued:
                self._wait_set.wake()
        if settled:
            own.complete(failure)
        elif own.done:
            # Settled before, but the interrupt may have cut its completion short: its
            # memory goes back, and a future left pending fails (nothing changes a done one).
            own.complete(failure)
