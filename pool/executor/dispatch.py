"""The Pool's dispatch: claiming workers, sending them tasks, reading replies, settling tasks.

Any thread runs this part of the Pool: the manager thread; a thread in
Pool.run, which sends its request and reads the reply itself; a thread in
submit, which sends queued tasks itself (waking the manager for that would
cost a thread switch on every task). What keeps them apart:

- A worker is claimed under the lock (IDLE -> BUSY, see pool.executor.workers) by
  one thread, which alone sends to it. `holder` says which thread holds its
  socket, and _give_back_locked returns it to the manager: after a caller
  sent a request, after it handled its reply, or in Pool._recover after an
  exception (a Ctrl-C can land at any call) anywhere in between.
- A task is settled by _settle_locked, which flips `task.done` once under
  the lock; only the thread that flipped it completes the task (resolves
  its future, gives back its shared memory: _complete). A caller thread
  completes no task but its own; any other it cannot send, or finds
  cancelled, goes to the manager as an orphan, so that an interrupt there
  never leaves another thread waiting or memory held. So do the queued
  tasks a stop of the pool fails (_fail_queued_locked): every future but a
  caller's own is completed on the manager thread, where its done-callbacks
  run. An interrupt between settling its own task and completing it leaves
  the caller's Pool._recover to give back the task's memory.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, InvalidStateError
from typing import Any

from pool.errors import (
    DeviceFailureError,
    PoolError,
    ProgramQuarantinedError,
    rebuild_error,
)
from pool.executor.compiling import CompileResult
from pool.executor.segments import Segment, SegmentCache, map_segment
from pool.executor.tasks import Task
from pool.executor.watch import Watch
from pool.executor.workers import ARENA_SIZE, State, WorkerProcess
from worker import protocol, shm
from worker.cache.key import check_key
from worker.records import ArrayType, CompileStatistics

logger = logging.getLogger("pjrt_pool.pool")

RESEND = object()
"""A reply's outcome that puts its task back in the queue (the worker had unloaded it)."""


class Dispatch:
    """Claiming, sending, replies and settling; mixed into Pool (see the module docstring)."""

    _lock: threading.Lock
    _pending: collections.deque[Task]
    _workers: list[WorkerProcess]
    _watch: Watch
    _wake_w: int
    _closing: bool
    _broken: BaseException | None
    _quarantined: dict[str, str]
    _crashes: collections.Counter[str]
    _max_crashes: int
    _statistics: CompileStatistics
    _output_types: dict[str, tuple[ArrayType, ...]]
    _segments: SegmentCache
    _orphans: list[tuple[Task, BaseException]]
    _on_ready: Callable[[WorkerProcess, protocol.Ready], None]  # the Manager's

    # -- workers: claim and give back ------------------------------------------

    def _idle_worker_locked(self, program_key: str) -> WorkerProcess | None:
        """An idle worker, one that has the program loaded if there is one."""
        first = None
        for worker in self._workers:
            if worker.state is State.IDLE and worker.holder is None:
                if program_key in worker.loaded:
                    return worker
                first = first or worker
        return first

    def _claim_locked(self, worker: WorkerProcess, task: Task, holder: int | None) -> None:
        """IDLE -> BUSY with `task`, held by `holder` (a caller's thread id; None: the manager)."""
        # Plain stores first, then calls: an interrupt lands after a call,
        # and by then this thread holds the worker, so Pool._recover finds it.
        worker.task = task
        worker.holder = holder
        task.sending = False
        task.deadline = None if task.timeout is None else time.monotonic() + task.timeout
        worker.move(State.BUSY)
        if holder is not None:
            self._watch.remove(worker.sock.fileno())
            if task.deadline is not None:
                self._wake()  # the manager's wait must end at this deadline

    def _give_back_locked(self, worker: WorkerProcess) -> None:
        """Returns a caller-held worker to the manager: its socket into the wait set, then holder.

        In that order, so that an interrupt between the two leaves the worker
        held (and Pool._recover gives it back again; adding twice is fine).
        """
        if worker.holder is None:
            return
        if worker.state is not State.DEAD:
            self._watch.add(worker.sock.fileno(), ("socket", worker))
        worker.holder = None
        if self._closing:
            self._wake()  # close() waits for this worker to be free

    def _give_back(self, worker: WorkerProcess) -> None:
        with self._lock:
            self._give_back_locked(worker)

    def _unclaim_locked(self, worker: WorkerProcess) -> None:
        """Nothing was sent: BUSY -> IDLE, without its task, back to the manager."""
        worker.task = None
        if worker.state is State.BUSY:
            worker.move(State.IDLE)
        self._give_back_locked(worker)

    def _kill_locked(self, worker: WorkerProcess) -> None:
        """Kills a worker: it becomes DYING, and its end of file finishes it (Manager)."""
        if worker.state is State.DEAD:
            return
        if worker.state is not State.DYING:
            worker.move(State.DYING)
        worker.kill()

    def _retire_locked(self, worker: WorkerProcess) -> None:
        """Kills a worker for a reason that is not its task's fault (the task goes elsewhere)
        and gives it back to the manager, which reaps it."""
        worker.killed_by_pool = True
        self._kill_locked(worker)
        self._give_back_locked(worker)

    def _retire(self, worker: WorkerProcess) -> None:
        with self._lock:
            self._retire_locked(worker)

    # -- tasks: settle and complete ----------------------------------------------

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

    def _orphan_locked(self, task: Task, error: BaseException) -> None:
        """Leaves the failing of a task the calling thread does not own to the manager."""
        self._orphans.append((task, error))
        self._wake()

    def _fail_queued_locked(
        self, kind: type[PoolError], message: str, cause: BaseException | None = None
    ) -> None:
        """Empties the queue: each task is left to the manager, to fail with kind(message).

        The manager completes them, so that their done-callbacks run on it as
        every other callback does; the message says why they never ran.
        """
        for task in self._pending:
            error = kind(message)
            error.__cause__ = cause
            self._orphans.append((task, error))
        self._pending.clear()
        self._wake()

    def _wake(self) -> None:
        """Ends the manager's wait (called under the lock: the pipe is closed under it)."""
        if self._wake_w >= 0:
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"\0")

    # -- dispatch ---------------------------------------------------------------

    def _dispatch(self, holder: int | None) -> None:
        """Sends queued tasks to idle workers; holder is the calling thread (None: the manager)."""
        while True:
            finished: Any = None
            with self._lock:
                if self._broken is not None or not self._pending:
                    return
                head = self._pending[0]
                if head.program_id in self._quarantined and holder is not None:
                    self._wake()  # the manager fails it (a caller completes only its own task)
                    return
                if head.program_id in self._quarantined:
                    task = self._pending.popleft()
                    if not self._settle_locked(task):
                        continue  # stopped, and left to the manager (_fail_queued_locked)
                    finished = ProgramQuarantinedError(self._quarantined[task.program_id])
                else:
                    worker = self._idle_worker_locked(head.program_id)
                    if worker is None:
                        return
                    task = self._pending.popleft()
                    if task.done:
                        continue  # stopped, and left to the manager (_fail_queued_locked)
                    if task.future.running() or task.future.set_running_or_notify_cancel():
                        self._claim_locked(worker, task, holder)
                    elif holder is not None:
                        # Cancelled while it waited: the manager gives back its memory
                        # (a caller completes only its own task).
                        self._orphan_locked(task, CancelledError())
                        continue
                    else:
                        self._settle_locked(task)
                        finished = _CANCELLED
            if finished is _CANCELLED:
                task.release()  # nobody waits for a cancelled future: only memory to give back
            elif finished is not None:
                self._complete(task, finished)
            else:
                self._send(worker, task)

    def _send(self, worker: WorkerProcess, task: Task) -> None:
        """Sends a claimed worker its task; a caller then gives the worker to the manager."""
        holder = worker.holder
        try:
            message, fds = self._request_for(task, worker)
        except Exception as error:  # shared memory could not be made: nothing was sent
            with self._lock:
                self._unclaim_locked(worker)
                if holder is not None:
                    self._orphan_locked(task, error)
                settled = holder is None and self._settle_locked(task)
            if settled:
                self._complete(task, error)
            return
        task.sending = True
        try:
            worker.send(message, fds)
        except OSError:
            # Dead, or its stream broken: the manager reaps it, and the task
            # (which it cannot have started) goes to another worker.
            self._retire(worker)
            return
        if holder is not None:
            self._give_back(worker)

    def _request_for(self, task: Task, worker: WorkerProcess) -> tuple[Any, tuple[int, ...]]:
        """The message (and descriptors) that give a task to the worker claimed for it."""
        if task.kind == "run" and (task.output is None or task.output.fd < 0):
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
        task.segments = self._segments
        if task.output is None:
            task.output = Segment()
        self._segments.take(task.output, shm.layout(types)[1])

    # -- replies -------------------------------------------------------------------

    def _on_message(
        self,
        worker: WorkerProcess,
        message: Any,
        fds: list[int],
        dropped: BaseException | None = None,
    ) -> None:
        """Handles one message from a worker; a worker with a task always ends up given back.

        dropped is the DescriptorLimitError of a reply whose descriptors the
        kernel dropped: the reply's task fails with it.
        """
        if isinstance(message, protocol.Ready):
            close_all(fds)
            self._on_ready(worker, message)
            return
        task = worker.task
        if not isinstance(message, protocol.Reply) or task is None or message.task_id != task.id:
            close_all(fds)
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
            try:
                self._finish(worker, task, outcome)
            finally:
                close_all(fds)

    def _finish(self, worker: WorkerProcess, task: Task, outcome: Any) -> None:
        """A reply was handled: settle its task (or queue it again) and free the worker."""
        with self._lock:
            if worker.task is task:
                worker.task = None
            if worker.state is State.BUSY:
                worker.move(State.IDLE)
            self._give_back_locked(worker)
            if outcome is RESEND and task.kill_error is None and not task.done:
                task.sending = False
                self._pending.appendleft(task)
                settled = False
            else:
                if outcome is RESEND:  # too late to send it again: it is being stopped
                    outcome = task.kill_error
                settled = self._settle_locked(task)
        if settled:
            self._complete(task, outcome)

    def _outcome(
        self, worker: WorkerProcess, task: Task, reply: protocol.Reply, fds: list[int]
    ) -> Any:
        """Returns a reply's result (or RESEND to send the task again); raises its error."""
        if reply.error is not None:
            if reply.fatal:
                raise self._device_failure(worker, task, reply.error)
            lost = reply.error.qualname == "LookupError" and task.program is not None
            if lost and not task.resend_program:
                # The worker unloaded the program although the parent's mirror
                # said otherwise: send it again, with the program this time.
                worker.loaded.pop(task.program_id, None)
                task.resend_program = True
                return RESEND
            raise rebuild_error(reply.error)
        worker.note_loaded(task.program_id, reply.evicted)
        if task.kind == "compile":
            check_key(reply.spec.key, "the key in a worker's reply")  # it goes into manifests
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
            segment = task.output  # the one offered with the request (see _offer_output_segment)
            if segment is None or segment.fd < 0:
                raise RuntimeError("the worker wrote into an output segment it was not given")
        else:
            segment = Segment()
            segment.capacity = reply.output_size
            segment.fd = fds[0]
            del fds[0]  # the segment holds it now (no call since the line above)
        try:
            mapping = map_segment(segment.fd, segment.capacity)
            # The arrays view the mapping; the cache gets the segment back after them.
            self._segments.adopt(segment, mapping)
        except BaseException:
            if segment is not task.output:  # the task's own goes back with the task
                self._segments.give(segment)
            raise
        return shm.views(mapping, types, reply.output_offsets)

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


_CANCELLED = object()
"""A queued task whose future was cancelled (only its memory to give back)."""


def close_all(fds: list[int]) -> None:
    """Closes received descriptors that nothing took, each out of the list as it is closed."""
    while fds:
        fd = fds[-1]
        del fds[-1]  # out of the list and closed with no call between
        os.closerange(fd, fd + 1)  # never raises: no try, so no call before it


def _resolve(future: Any, result: Any) -> None:
    try:  # noqa: SIM105 (not contextlib.suppress: this is on every task's path)
        future.set_result(result)
    except InvalidStateError:
        pass  # a cancelled Future drops its result


def _fail(future: Any, error: BaseException) -> None:
    try:  # noqa: SIM105 (as in _resolve)
        future.set_exception(error)
    except InvalidStateError:
        pass
