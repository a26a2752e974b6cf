"""The Pool's dispatch: sending tasks to the workers claimed for them, reading replies, settling.

Any thread runs this part of the Pool: the manager thread; a thread in
Pool.run, which sends its request and reads the reply itself; a thread in
submit, which sends queued tasks itself (waking the manager for that would
cost a thread switch on every task). What keeps them apart:

- A worker is claimed under the lock (IDLE -> BUSY, see pool.executor.workers)
  by one thread, which alone sends to it. `holder` says which thread holds
  its socket, and Workers.give_back_locked returns it to the manager: after
  a caller sent a request, after it handled its reply, or in
  CallerPath.recover after an exception (a Ctrl-C can land at any call)
  anywhere in between.
- A task is settled by Task.settle, its one move to DONE, under the lock;
  only the thread that made it completes the task (Task.complete).
  A caller thread completes no task but its own; any other it cannot send,
  or finds cancelled, goes to the manager as an orphan (Tasks.orphan_locked),
  so that an interrupt there never leaves another thread waiting or memory
  held. So do the queued tasks a stop of the pool fails: every future but a
  caller's own is completed on the manager thread, where its done-callbacks
  run. An interrupt between settling its own task and completing it leaves
  the caller's CallerPath.recover to give back the task's memory.

One function does each step, whichever thread takes it: dispatch (claim
queued tasks), send (a claimed task's request, built by
pool.executor.requests), receive (one message, with what can go wrong in
reading it) and the reply's handling down to settling; a run that keeps
every output may go ahead of its reply (send_ahead, _finish_ahead).
"""

from __future__ import annotations

import enum
import logging
import threading
from concurrent.futures import CancelledError, Future
from typing import Any, Literal, NamedTuple

import numpy as np

from pool.errors import DeviceFailureError, PoolError, WorkerWarning, rebuild_error
from pool.executor.compile_many import CompileResult
from pool.executor.futures import resolve
from pool.executor.quarantine import Quarantine, count_crash
from pool.executor.requests import Requests
from pool.executor.segments import SegmentCache
from pool.executor.starts import WorkerStarts
from pool.executor.tasks import Kind, Task, Tasks, TaskState, ValueOpKind
from pool.executor.values import DeviceValue, Fetcher
from pool.executor.wait_set import WaitSet
from pool.executor.worker_process import ARENA_SIZE, State, WorkerProcess
from pool.executor.workers import Workers
from worker import log
from worker.cache.warn_once import WarnOnce, said_here
from worker.identity.keys import check_key
from worker.log import get_logger
from worker.records import ArrayType, CompileStatistics
from worker.wire import protocol, shm
from worker.wire.fds import close_all

logger = logging.getLogger("pjrt_pool.pool")


class Resend(enum.Enum):
    """The outcome of a reply that asks for the task to be sent again (neither a result nor
    an error): the worker had unloaded the program, so the task is queued again, with it."""

    WITH_PROGRAM = "with program"


Result = list[np.ndarray] | CompileResult | BaseException | Literal[Resend.WITH_PROGRAM]
"""What handling a reply gives its task: outputs, a CompileResult, an error, or a resend."""


class PoolCore(NamedTuple):
    """The parts of one pool that its dispatcher and its manager thread both hold, made once
    by the Pool (pool.executor.pool)."""

    lock: threading.Lock
    """The pool's: claims, the queue, workers' states and settling change under it."""
    tasks: Tasks
    """The queue: dispatched, resent tasks put back, orphans completed."""
    workers: Workers
    """Claimed, given back, freed, retired, killed at their deadline and reaped."""
    starts: WorkerStarts
    """Starts the workers, replaces each that ends, is told of each one's Ready."""
    quarantine: Quarantine
    """Refuses the tasks of programs that crashed workers; counts each crash."""
    segments: SegmentCache
    """The shared memory results' arrays view, kept for reuse and closed with the pool."""
    wait_set: WaitSet
    """The manager's one wait point (replies, deaths, output, wake-ups)."""


class Dispatcher:
    """Sending claimed tasks, reading replies and settling tasks (see the module docstring)."""

    def __init__(self, core: PoolCore, requests: Requests, owner: Fetcher) -> None:
        self._owner = owner  # what the handles of kept values fetch themselves through
        self._lock, self._tasks, self._workers = core.lock, core.tasks, core.workers
        self._starts, self._quarantine = core.starts, core.quarantine
        self._segments, self._wait_set = core.segments, core.wait_set
        self._requests = requests  # builds each request; learns programs' output types
        self.statistics = CompileStatistics()  # summed over every reply, under the lock
        # The workers' warnings, said once per pool (their output reaches only the debug log).
        self._said = WarnOnce(WorkerWarning, stacklevel=2, log=get_logger("pjrt_pool.worker"))

    # -- dispatch ---------------------------------------------------------------

    def dispatch(self, holder: int | None) -> None:
        """Sends queued tasks to idle workers; holder is the calling thread (None: the manager)."""
        tasks, workers = self._tasks, self._workers
        while True:
            worker: WorkerProcess | None = None
            error: BaseException | None = None
            with self._lock:
                head = self._head_locked()
                if tasks.broken is not None or head is None:
                    return
                request = head.request
                refusal = self._quarantine.refusal_locked(request.program_id)
                if refusal is not None:
                    if holder is not None:
                        self._wait_set.wake()  # the manager fails it (a caller completes its own)
                        return
                    task = self._pop_locked(head)
                    if not task.settle():
                        continue  # stopped, and left to the manager (Tasks.fail_queued_locked)
                    error = refusal
                else:
                    worker = workers.idle_locked(request.program_id, request.kind, request.worker)
                    if worker is None:
                        return
                    task = self._pop_locked(head)
                    try:
                        if task.done:
                            continue  # stopped, and left to the manager (fail_queued_locked)
                        if task.future.running() or task.future.set_running_or_notify_cancel():
                            workers.claim_locked(worker, task, holder)
                        elif holder is not None:
                            # Cancelled while it waited: the manager gives back its memory
                            # (a caller completes only its own task).
                            tasks.orphan_locked(task, CancelledError())
                            continue
                        else:
                            task.settle()
                            worker = None  # nobody waits for a cancelled future
                    except BaseException:
                        # A Ctrl-C in a caller's thread, between taking the task (maybe
                        # another thread's) and claiming its worker: both go back as they
                        # were, or the task was in no queue and on no worker for good.
                        self._put_back_locked(task, worker)
                        raise
            if worker is not None:
                self._send_claimed(worker, task)
            elif error is not None:
                task.complete(error)
            else:
                task.release()  # cancelled: only its memory to give back

    def _head_locked(self) -> Task | None:
        """The oldest task an idle worker can take: at the head of the queue of a kind some
        idle worker takes, or of an idle worker's own queue (tasks that need its values)."""
        tasks, workers = self._tasks, self._workers
        head = tasks.head_locked(workers.idle_kinds_locked())
        pinned = tasks.pinned_head_locked([w.memory for w in workers.idle_workers_locked()])
        if pinned is not None and (head is None or pinned.request.id < head.request.id):
            return pinned
        return head

    def _pop_locked(self, head: Task) -> Task:
        """Takes the task _head_locked found from its queue."""
        worker = head.request.worker
        if worker is None:
            return self._tasks.pop_head_locked(head.request.kind)
        return self._tasks.pop_pinned_locked(worker)

    def _put_back_locked(self, task: Task, worker: WorkerProcess) -> None:
        """Undoes dispatch's taking of a task from the queue's head and its claim of `worker`,
        however far they got: the worker idle again, the task back at the head (a
        cancelled one to the manager, a settled one dropped, as dispatch does)."""
        if worker.task is task:
            self._workers.unclaim_locked(worker)
        if task.done:
            return
        future = task.future
        if isinstance(future, Future) and future.cancelled():
            self._tasks.orphan_locked(task, CancelledError())
        else:
            self._tasks.restore_head_locked(task)

    def _send_claimed(self, worker: WorkerProcess, task: Task) -> None:
        """Sends a worker dispatch claimed its task; a caller then gives the worker back."""
        holder = worker.holder
        try:
            sent = self.send(worker, task)
        except Exception as error:  # shared memory could not be made: nothing was sent
            with self._lock:
                self._workers.unclaim_locked(worker)
                if holder is not None:
                    self._tasks.orphan_locked(task, error)
                settled = holder is None and task.settle()
            if settled:
                task.complete(error)
            return
        finally:
            if holder is None:  # the manager's send is over: a waiting caller may read the reply
                self._workers.manager_done(worker)
        if sent and holder is not None:
            self._workers.give_back(worker)

    def send(self, worker: WorkerProcess, task: Task) -> bool:
        """Sends a claimed worker its task; False when the worker is gone.

        A worker that is gone (dead, or its stream broken) is retired: the
        manager reaps it, and the task, which it cannot have started, goes to
        another worker. What making the request raises (no shared memory)
        comes out of here, with nothing sent.
        """
        message, fds, deliveries = self._requests.build(task, worker)
        task.sending()
        try:
            worker.send(message, fds)
        except OSError:
            self._workers.retire(worker)
            return False
        worker.memory.delivered(deliveries)  # once it went (see pool.executor.worker_memory)
        if task.memory is not None:  # (a compile's has none)
            task.memory.sent(deliveries.segments)
        return True

    def send_ahead(self, worker: WorkerProcess, task: Task) -> None:
        """Sends a claimed worker a run that goes ahead of its reply (Requests.goes_ahead),
        its small inputs in an arena region of their own: its handles are its outcome at
        once, and the worker, let go of, keeps it in `ahead` until its reply is read, in
        order (WorkerProcess.answering), by the next caller to claim it or the manager."""
        memory = task.memory
        assert memory is not None
        memory.place_in_arena(worker.arena_region())
        if not self.send(worker, task):
            return
        layout = memory.plan.layout  # type: ignore[union-attr]  # (planned: all kept)
        handles = self._with_kept(worker, task, layout.types, [], layout.nbytes)  # type: ignore[union-attr]
        memory.went_ahead(handles)
        with self._lock:
            self._workers.went_ahead_locked(worker, task)
        resolve(task.future, handles)

    # -- replies -------------------------------------------------------------------

    def receive(self, worker: WorkerProcess) -> bool:
        """Reads one message from a worker and handles it; False when its connection ended.

        A worker whose connection ended died: the caller gives it back, or (the
        manager) reaps it. One that sends what is not a frame of ours broke the
        protocol and is retired. A worker with a task always ends up given back.
        """
        fds: list[int] = []
        worker.reading_reply(True)  # until a frame is read whole (see CallerPath.recover)
        try:
            message, fds = worker.receive()
        except protocol.DescriptorLimitError as error:
            worker.reading_reply(False)
            self._handle(worker, error.message, [], error)
        except (protocol.ConnectionLostError, OSError):
            return False  # (still `reading`: nothing reads a dead worker again)
        except Exception as error:  # not a frame of ours: the worker broke the protocol
            logger.warning("worker %d sent garbage (%r): replacing it", worker.pid, error)
            self._workers.retire(worker)
        else:
            if not worker.ahead:  # else until the reply is handled (Workers.answered_locked)
                worker.reading_reply(False)
            try:
                self._handle(worker, message, fds)
            finally:
                if fds:  # an interrupt at _handle's entry: it took none
                    close_all(fds)
        return True

    def _handle(
        self,
        worker: WorkerProcess,
        message: Any,
        fds: list[int],
        dropped: BaseException | None = None,
    ) -> None:
        """Handles one message from a worker.

        dropped is the DescriptorLimitError of a reply whose descriptors the
        kernel dropped: the reply's task fails with it.
        """
        task = worker.answering()
        if type(message) is protocol.HotReply:
            self._handle_hot(worker, task, message, fds)
            return
        said = getattr(message, "warnings", ())  # a Ready's or a Reply's, untrusted
        if said:
            self._pass_on(worker, said)
        if isinstance(message, protocol.Ready):
            close_all(fds)
            self._starts.on_ready(worker, message)
            return
        if (
            not isinstance(message, protocol.Reply)
            or task is None
            or message.task_id != task.request.id
        ):
            self._unexpected(worker, message, fds)
            return
        outcome: Result | None = None
        try:
            if message.statistics is not None or message.counters is not None:
                with self._lock:
                    if message.counters is not None:
                        self._workers.note_counters_locked(
                            worker, message.counters, message.remote_counters
                        )
                    if message.statistics is not None:
                        self.statistics = self.statistics.add(message.statistics)
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

    def _pass_on(self, worker: WorkerProcess, said: Any) -> None:
        """Says each warning a worker gave, once per pool: logged on "pjrt_pool.worker" and
        issued as a WorkerWarning; not one this process said itself (the pool's checks as
        it started say what its workers would: an unusable cache, unsigned records). What
        is not a tuple of texts is no warning of a worker's."""
        if not isinstance(said, tuple):
            return
        for text in said[:16]:
            if isinstance(text, str) and not said_here(text[: log.MAX_SAID]):
                text = text[: log.MAX_SAID]
                self._said.warn(text, f"pjrt-pool worker {worker.pid}: {text}")

    def _handle_hot(
        self, worker: WorkerProcess, task: Task | None, reply: protocol.HotReply, fds: list[int]
    ) -> None:
        """Handles a HotReply: the task's outputs are in the arena where its hot slot has them."""
        program_id = None if task is None else task.request.program_id
        memory = None if task is None else task.memory
        placed = memory is not None and memory.plan is not None  # a PlacedRun's reply
        hot = None if program_id is None or placed else worker.hot.get(program_id)
        if task is None or (hot is None and not placed) or fds or reply.task_id != task.request.id:
            self._unexpected(worker, reply, fds)
            return
        outcome: Result | None = None
        try:
            if task.state is TaskState.AHEAD:  # its handles were made when it was sent
                worker.note_loaded(task.request.program_id, ())
            elif hot is None:
                outcome = self._placed_outputs(worker, task)
                worker.note_loaded(task.request.program_id, ())
            else:
                # The arena is reused by the next task: copy the (small) outputs out.
                outcome = [view.copy() for view in hot.outputs]
                worker.ran_hot(program_id)
        except Exception as error:  # no memory for the copies
            outcome = error
        except BaseException as error:  # interrupted while copying, as in _handle
            outcome = PoolError(f"reading the task's outputs was interrupted ({error!r})")
            raise
        finally:
            self._finish(worker, task, outcome)

    def _unexpected(self, worker: WorkerProcess, message: Any, fds: list[int]) -> None:
        """A message that answers no request of the worker's: it broke the protocol, retire it."""
        close_all(fds)
        dying = worker.state is State.DYING  # retired already: replies of runs sent ahead
        level = logging.DEBUG if dying else logging.WARNING  # come after the one cut short
        logger.log(level, "worker %d sent an unexpected message %r", worker.pid, message)
        self._workers.retire(worker)

    def _finish(self, worker: WorkerProcess, task: Task, outcome: Result | None) -> None:
        """A reply was handled: settle its task (or queue it again) and free the worker.

        A run or put that failed (in the worker, or in reading its reply) may
        have kept values no handle names: the worker is told to drop them with
        its next request (WorkerMemory.orphan). Any request that failed (or is sent
        again) sends its new segments again (WorkerMemory.failed)."""
        if task.state is TaskState.AHEAD:
            self._finish_ahead(worker, task, outcome)
            return
        memory = task.memory
        plan = None if memory is None else memory.plan
        if isinstance(outcome, BaseException) or outcome is Resend.WITH_PROGRAM:
            worker.memory.failed(() if memory is None else memory.sent_segments)
            if isinstance(outcome, BaseException) and plan is not None and plan.kept:
                worker.memory.orphan(plan.kept.values())
        with self._lock:
            self._workers.free_locked(worker, task)
            if outcome is Resend.WITH_PROGRAM and task.kill_error is None and not task.done:
                self._tasks.requeue_locked(task)
                settled = False
            else:
                if outcome is Resend.WITH_PROGRAM:  # too late to send it again: it is stopping
                    outcome = task.kill_error
                settled = task.settle()
        if settled:
            task.complete(outcome)

    def _finish_ahead(self, worker: WorkerProcess, task: Task, outcome: Result | None) -> None:
        """The reply to a run sent ahead settles it. A failure (no value made) is recorded on
        its values, raised where they are used; one for want of a value an earlier run
        failed to make records that run's error."""
        memory = task.memory
        assert memory is not None
        if outcome is Resend.WITH_PROGRAM:  # it cannot be sent again: its handles are out
            outcome = PoolError(f"the worker had unloaded program {task.request.name!r}")
        if isinstance(outcome, BaseException):
            worker.memory.failed(memory.sent_segments)
            root = memory.fail_made(outcome, task.request.name)
            logger.info("run %r, sent ahead of its reply, failed: %s", task.request.name, root)
        with self._lock:
            settled = self._workers.answered_locked(worker, task)
        if settled:
            task.release()  # its outcome, the handles, was set when it was sent

    def _outcome(
        self, worker: WorkerProcess, task: Task, reply: protocol.Reply, fds: list[int]
    ) -> Result:
        """Returns a reply's result (or a Resend to send the task again); raises its error."""
        request = task.request
        program_id = request.program_id
        if reply.error is not None:
            if reply.fatal:
                raise self._device_failure(worker, task, reply.error)
            lost = reply.error.qualname == "LookupError" and request.kind is Kind.RUN
            loadable = request.program is not None or request.cache_key is not None
            if lost and loadable and not task.resend_program:
                # The worker unloaded the program although the parent's mirror
                # said otherwise: send it again, with the program this time.
                worker.forget(program_id)
                task.resend_with_program()
                return Resend.WITH_PROGRAM
            raise rebuild_error(reply.error)
        if request.kind is not Kind.VALUE:
            worker.note_loaded(program_id, reply.evicted)
        if request.kind is Kind.COMPILE:
            assert reply.spec is not None
            check_key(reply.spec.key, "the key in a worker's reply")  # it goes into manifests
            return CompileResult(reply.spec, reply.statistics or CompileStatistics(), reply.phases)
        memory = task.memory
        assert memory is not None, "a run's reply answers a staged run"
        if request.kind is Kind.VALUE:
            if reply.values_held >= 0:
                worker.memory.reported_values = reply.values_held
            return self._value_outcome(worker, task)
        return self._run_outcome(worker, task, reply, fds)

    def _run_outcome(
        self, worker: WorkerProcess, task: Task, reply: protocol.Reply, fds: list[int]
    ) -> list[Any]:
        """A run's outputs from its Reply: where its request placed them, or where the worker
        laid them out (the arena, the inputs' segment its request offered, or a segment it
        sent), each checked first."""
        program_id = task.request.program_id
        memory = task.memory
        assert memory is not None
        types = reply.output_types
        if types is None:
            types = self._requests.output_types(program_id)
        if reply.placed_slot >= 0:
            worker.memory.note_placed(program_id, reply.placed_slot, memory.all_types)
        place, offsets = reply.output_place, reply.output_offsets
        if place == "placed":
            if memory.plan is None or memory.plan.destinations is None:
                raise self._broken_reply(worker, task, ValueError("outputs placed unasked"))
            if reply.output_types is not None:
                self._requests.note_output_types(program_id, types)
            return self._placed_outputs(worker, task)
        kept = {} if memory.plan is None else memory.plan.kept
        placed_types = [t for index, t in enumerate(types) if index not in kept]
        placed_offsets = tuple(o for index, o in enumerate(offsets) if index not in kept)
        spare = None if memory.plan is None else memory.plan.spare  # offered: Run.spare
        # Nothing the reply says is mapped or viewed before it is checked against what
        # the parent knows: a wrong size or offset would fault (SIGBUS) in this process.
        try:
            if len(offsets) != len(types):
                raise ValueError(f"{len(offsets)} offsets for {len(types)} outputs")
            if place == "arena":
                shm.check_layout(placed_types, placed_offsets, ARENA_SIZE, "the worker's arena")
            elif place == "new" and len(fds) == 1:
                size = reply.output_size
                shm.check_layout(placed_types, placed_offsets, size, "its output segment")
                shm.check_received(fds[0], size, "its output segment")
            elif place == "spare" and not fds and spare is not None:
                size = spare.capacity
                shm.check_layout(placed_types, placed_offsets, size, "the inputs' segment")
            else:
                raise ValueError(f"outputs in {place!r} with {len(fds)} descriptors")
        except (ValueError, TypeError, AttributeError) as problem:
            raise self._broken_reply(worker, task, problem) from None
        if reply.output_types is not None:
            self._requests.note_output_types(program_id, types)
        if place == "arena":
            if reply.hot_slot >= 0 and not kept:
                worker.note_hot(
                    program_id,
                    reply.hot_slot,
                    (memory.types, memory.offsets),
                    (types, offsets),
                )
            # The arena is reused by the next task: copy the (small) outputs out.
            arrays = [view.copy() for view in shm.views(worker.arena, placed_types, placed_offsets)]
        else:  # over the task's own copy of its inputs (theirs now), or in the one sent
            if place == "spare" and spare is not None:
                lease = self._segments.adopt(spare)
            else:
                lease = self._segments.adopt_received(fds, reply.output_size)
            arrays = lease.views(placed_types, placed_offsets)
        return self._with_kept(worker, task, types, arrays)

    def _placed_outputs(self, worker: WorkerProcess, task: Task) -> list[Any]:
        """The outputs of a run that went where its request said (OutputPlan): copied out of
        the arena, viewing its output segment, or kept (handles)."""
        memory = task.memory
        assert memory is not None and memory.plan is not None
        layout = memory.plan.layout
        assert layout is not None
        if layout.in_arena or not layout.placed:
            views = shm.views(worker.arena, layout.placed, layout.offsets)
            arrays = [view.copy() for view in views]
        else:
            assert memory.output is not None
            lease = self._segments.adopt(memory.output)
            arrays = lease.views(layout.placed, layout.offsets)
        return self._with_kept(worker, task, layout.types, arrays, layout.nbytes)

    def _with_kept(
        self,
        worker: WorkerProcess,
        task: Task,
        types: tuple[ArrayType, ...],
        arrays: list[np.ndarray],
        nbytes: tuple[int, ...] | None = None,
    ) -> list[Any]:
        """A run's outputs in order: its arrays, and a handle for each output it kept
        (nbytes: every output's bytes, where they are known)."""
        memory = task.memory
        assert memory is not None
        kept = {} if memory.plan is None else memory.plan.kept
        if not kept:
            return arrays
        found = iter(arrays)
        outputs: list[Any] = []
        label = task.request.name
        for index, array_type in enumerate(types):
            value_id = kept.get(index)
            if value_id is None:
                outputs.append(next(found))
                continue
            size = array_type.nbytes if nbytes is None else nbytes[index]
            outputs.append(self._keep(worker, value_id, array_type, label, size, index))
        return outputs

    def _keep(
        self,
        worker: WorkerProcess,
        value_id: int,
        array_type: ArrayType,
        made_by: str,
        nbytes: int,
        output: int = -1,
    ) -> Any:
        """The handle of a value a worker now keeps (of nbytes bytes; output: which output
        of the task made_by names it is, or -1 for a put), recorded in the worker's memory."""
        memory = worker.memory
        value = DeviceValue(self._owner, memory, value_id, array_type, made_by, nbytes, output)
        memory.keep(value)
        return value

    def _value_outcome(self, worker: WorkerProcess, task: Task) -> Any:
        """A Put's handle, or a Fetch's array."""
        request = task.request
        operation = request.value
        memory = task.memory
        assert operation is not None and memory is not None and memory.plan is not None
        if operation.op is ValueOpKind.PUT:
            (value_id,) = memory.plan.kept.values()
            array_type = operation.array_type
            return self._keep(worker, value_id, array_type, request.name, array_type.nbytes)
        if operation.op is ValueOpKind.RELEASE:
            return None
        return self._placed_outputs(worker, task)[0]

    def _broken_reply(self, worker: WorkerProcess, task: Task, problem: Exception) -> PoolError:
        """A reply that cannot be true (outputs outside their memory): the worker broke the
        protocol, so it is retired, and only its task fails."""
        self._workers.retire(worker)
        request = task.request
        return PoolError(
            f"the worker (pid {worker.pid}) running program {request.name!r} gave a reply "
            f"that does not fit its shared memory ({problem}); it was replaced, and only this "
            "task failed"
        )

    def _device_failure(
        self, worker: WorkerProcess, task: Task, remote: protocol.RemoteError
    ) -> DeviceFailureError:
        """A device error left the worker unusable: retire it and count a crash."""
        self._workers.retire(worker)
        request = task.request
        message = (
            f"the device failed while the worker (pid {worker.pid}) ran program "
            f"{request.name!r} ({request.kind.value}): {remote.message}. Such an error leaves "
            "the process's device context unusable, so the worker was replaced; only this "
            "task failed." + count_crash(self._quarantine, request)
        )
        error = DeviceFailureError(message, None, request.name, worker.output_tail())
        error.add_note(f"Raised in a pjrt-pool worker:\n{remote.traceback}")
        return error
