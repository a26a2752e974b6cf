"""Task bookkeeping: what was asked, how far it got, and the queue of tasks no worker has.

Kept apart from process bookkeeping (pool.executor.workers): a Task knows its
request, its staged inputs and its future, never a process's state. A task
is three things, each with one writer:

    request   what the caller asked (Request): checked once, never changed
    memory    its inputs as staged at submit and the shared memory it holds
              (pool.executor.inputs.TaskMemory), changed only by its own methods
    progress  its state and what its life has shown (a kill's error, requeues,
              a deadline), changed only by the Task's methods, under the pool's lock

Every move between states is checked against a table, as workers' are, so a
bookkeeping bug surfaces at once instead of hanging a caller::

    NEW     --queued (submit, or Pool.run found no idle worker)--> QUEUED
    NEW     --claimed with a worker by its caller (Pool.run)-----> CLAIMED
    QUEUED  --claimed with a worker (dispatch)-------------------> CLAIMED
    CLAIMED --its request is being sent--------------------------> SENT
    SENT    --a run that keeps every output went ahead of its
              reply: its handles were returned (dispatch_ahead)---> AHEAD
    CLAIMED --its claimer failed or was interrupted before
              sending; SENT --its worker died before starting it,
              or had unloaded its program-------------------------> QUEUED
                                                                  (at most MAX_REQUEUES
                                                                  times for deaths)
    any but DONE --settled: a reply, an error, a stop------------> DONE    (exactly once)

An AHEAD task is never queued again: its caller has its handles already, so
its reply (or its worker's end) only settles it, and an error is recorded
on the values it was to make (pool.executor.values.DeviceValue.fail).

A task is settled by exactly one thread: the one whose Task.settle() makes
the move to DONE under the pool's lock; that thread alone completes it
(resolves its future and gives back its shared memory: Task.complete).
Tasks holds the tasks no worker has: the queue, and the orphans the manager
is to fail.
"""

from __future__ import annotations

import collections
import enum
import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple

from pool.errors import PoolClosedError, PoolError
from pool.executor.futures import RunOutcome, fail, resolve
from pool.executor.wait_set import WaitSet
from worker.records import ArrayType, JaxCompile, LoweredProgram

if TYPE_CHECKING:
    from pool.executor.inputs import TaskMemory
    from pool.executor.values import DeviceValue
    from pool.executor.worker_memory import WorkerMemory

MAX_REQUEUES = 3
"""How often a task whose workers died before starting it is sent again before it fails."""


class Kind(enum.Enum):
    """What a task asks of a worker."""

    COMPILE = "compile"  # compile or load the program; the result is a CompileResult
    RUN = "run"  # run it; the result is its outputs
    VALUE = "value"  # put a value on a worker's device, or fetch one (ValueOp)

    # Members are singletons: hashing by identity is right, and C-fast (Enum's own hash
    # runs in Python), for the queues keyed by kind, looked up on every task.
    __hash__ = object.__hash__


class ValueOpKind(enum.Enum):
    """What a VALUE task does (its ValueOp's op)."""

    PUT = "put"  # its staged input goes on the device as a new value
    FETCH = "fetch"  # its value is copied into shared memory
    RELEASE = "release"  # only bring the worker what the pool let go of

    __hash__ = object.__hash__  # singletons, as Kind's


class ValueOp(NamedTuple):
    """What a VALUE task does (ValueOpKind): PUT its staged input, FETCH `value` (held alive
    by the task) into shared memory, or RELEASE."""

    op: ValueOpKind
    array_type: ArrayType
    value: DeviceValue | None = None


class Request(NamedTuple):
    """What a caller asked of the pool, checked once: a task's part that never changes."""

    id: int
    """The task's id, never reused within a pool."""
    kind: Kind
    program: LoweredProgram | None
    """The program, or None for a run by ProgramSpec (cache_key names its executable)."""
    program_id: str
    """Its identity within the pool (pool.executor.programs.program_id), or the spec's key."""
    name: str
    timeout: float | None
    """Seconds it may take in a worker; None: no bound."""
    cache_key: str | None = None
    """A run by ProgramSpec: the worker loads this key, with no program."""
    spec_types: tuple[ArrayType, ...] | None = None
    """That ProgramSpec's input types."""
    compile_options: bytes | None = None
    bundle: str | None = None
    """A run by ProgramSpec from a bundle (its absolute path or URL): the worker loads the
    program from it, read-only, instead of from the disk cache."""
    worker: WorkerMemory | None = None
    """The memory of the worker that must run it, which holds the task's values; None: any
    worker that takes its kind."""
    keep: tuple[int, ...] = ()
    """The outputs a run keeps in its worker, as values (their indices, ascending)."""
    value: ValueOp | None = None
    """A VALUE task's operation."""
    jax: JaxCompile | None = None
    """A COMPILE task for JAX's own cache: JAX's key and what its value is made for."""


class LifeState(enum.Enum):
    """A state in a life whose every move is checked against a table of the moves allowed
    (a task's, a worker's)."""

    # Members are singletons: hashing by identity is right, and C-fast (Enum's own
    # hash runs in Python), for the table checked on every move.
    __hash__ = object.__hash__


class TaskState(LifeState):
    """Where a task is in its life (see the module docstring)."""

    NEW = "new"
    QUEUED = "queued"
    CLAIMED = "claimed"
    SENT = "sent"
    AHEAD = "ahead"
    DONE = "done"


_MOVES: dict[TaskState, frozenset[TaskState]] = {
    TaskState.NEW: frozenset({TaskState.QUEUED, TaskState.CLAIMED, TaskState.DONE}),
    TaskState.QUEUED: frozenset({TaskState.CLAIMED, TaskState.DONE}),
    TaskState.CLAIMED: frozenset({TaskState.SENT, TaskState.QUEUED, TaskState.DONE}),
    TaskState.SENT: frozenset({TaskState.QUEUED, TaskState.AHEAD, TaskState.DONE}),
    TaskState.AHEAD: frozenset({TaskState.DONE}),
    TaskState.DONE: frozenset(),
}


class Task:
    """One compile or run request, its staged inputs, its progress and its future."""

    __slots__ = (
        "deadline",
        "future",
        "kill_error",
        "memory",
        "request",
        "requeues",
        "resend_program",
        "state",
    )

    def __init__(self, request: Request, future: Future[Any] | RunOutcome) -> None:
        self.request = request
        self.future = future
        self.memory: TaskMemory | None = None  # a run's, once staged
        self.state = TaskState.NEW
        self.kill_error: BaseException | None = None  # what to fail with if its worker is killed
        self.requeues = 0  # workers that died before starting it
        self.resend_program = False  # send the program with the next request (it was unloaded)
        self.deadline: float | None = None  # monotonic; set when a worker is claimed for it

    @property
    def done(self) -> bool:
        """Whether the task is settled."""
        return self.state is TaskState.DONE

    @property
    def sent(self) -> bool:
        """Whether its request went (or may have gone) to its current worker."""
        return self.state is TaskState.SENT

    def _move(self, to: TaskState) -> None:
        if to not in _MOVES[self.state]:
            raise RuntimeError(
                f"pjrt-pool bug: task {self.request.id} ({self.request.name!r}) cannot go "
                f"{self.state} -> {to}"
            )
        self.state = to

    # -- moves, each under the pool's lock ----------------------------------------

    def stage(self, memory: TaskMemory) -> None:
        """Takes a run's staged inputs (before it is queued or claimed)."""
        self.memory = memory

    def queued(self, lost_worker: bool = False) -> None:
        """Into the queue; lost_worker counts a worker that died before starting it."""
        self._move(TaskState.QUEUED)
        if lost_worker:
            self.requeues += 1

    def claimed(self) -> None:
        """A worker was claimed for it: its deadline starts now."""
        self._move(TaskState.CLAIMED)
        timeout = self.request.timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def sending(self) -> None:
        """Its request is about to go to its worker (from here on it may have gone)."""
        self._move(TaskState.SENT)

    def went_ahead(self) -> None:
        """Its request went and its caller got its handles before the reply (dispatch ahead):
        the reply, read later, only settles it."""
        self._move(TaskState.AHEAD)

    def resend_with_program(self) -> None:
        """Its worker had unloaded the program: the next request carries it."""
        self.resend_program = True

    def kill_with(self, error: BaseException) -> None:
        """The pool is killing its worker: it fails with `error` (the first reason stays)."""
        if self.kill_error is None:
            self.kill_error = error

    def settle(self) -> bool:
        """The one move to DONE: True for the single caller that makes it, which then
        completes the task."""
        if self.state is TaskState.DONE:
            return False
        self._move(TaskState.DONE)
        return True

    # -- completion, not under the lock -----------------------------------------

    def complete(self, outcome: Any) -> None:
        """Resolves a settled task's future with its outcome (an exception fails it) and gives
        back its shared memory; not under the lock (the future's callbacks run here)."""
        self.release()
        if isinstance(outcome, BaseException):
            fail(self.future, outcome)
        else:
            resolve(self.future, outcome)

    def release(self) -> None:
        """Gives the task's shared memory back once the worker is done with it."""
        memory = self.memory
        if memory is not None:
            memory.release()


class Tasks:
    """The tasks no worker has (the queue, the orphans) and whether the pool takes more.

    Everything here is read and changed under the pool's lock (methods named
    *_locked). An orphan is a task a thread settles but leaves to the manager
    thread to complete, so that its done-callbacks run there as every other
    callback does, and so that an interrupt in a caller's thread never
    leaves another thread waiting: a task a caller cannot send or finds
    cancelled, and the queued tasks a stop of the pool fails. The manager also
    makes the calls relayed to it: the done-callbacks of futures a caller's
    thread completed (pool.executor.futures.TaskFuture).
    """

    def __init__(self, wait_set: WaitSet) -> None:
        self._wait_set = wait_set  # woken when there are orphans or queued tasks for the manager
        self._ids = itertools.count()
        # One queue per kind of task, each in order: a pool whose compiles and runs go to
        # different workers (pool.executor.roles) sends each kind as its workers free up,
        # and one whose workers take both sends the older head first (dispatch).
        self._pending: dict[Kind, collections.deque[Task]] = {
            kind: collections.deque() for kind in Kind
        }
        # Tasks only one worker can run (it holds their values), by worker, in order:
        # they wait for that worker without holding up the tasks any worker takes.
        self._pinned: dict[WorkerMemory, collections.deque[Task]] = {}
        self._orphans: list[tuple[Task, BaseException]] = []
        self._relayed: list[Callable[[], object]] = []  # calls for the manager to make
        self._relaying = True  # the manager takes relayed calls (until it ends)
        self.closing = False  # close() or terminate() began: no task is taken any more
        self.broken: BaseException | None = None  # why no later task can run, once broken

    def next_id(self) -> int:
        """A new task's id: ids are never reused within a pool."""
        return next(self._ids)

    # -- the queue ------------------------------------------------------------------

    @property
    def queued(self) -> bool:
        """Whether any task is queued. Read without the lock it is a hint, which may be
        stale by the time the caller acts on it."""
        return any(self._pending.values()) or bool(self._pinned)

    def queued_of(self, kinds: frozenset[Kind]) -> bool:
        """Whether a task of one of the kinds is queued (a hint without the lock, as queued)."""
        if self._pinned:
            return True
        pending = self._pending
        return any(map(pending.__getitem__, kinds))  # no generator: this runs every run

    def _queue(self, task: Task) -> collections.deque[Task]:
        """The queue a task waits in: its kind's, or its worker's."""
        worker = task.request.worker
        if worker is None:
            return self._pending[task.request.kind]
        queue = self._pinned.get(worker)
        if queue is None:
            queue = self._pinned[worker] = collections.deque()
        return queue

    def push_locked(self, task: Task) -> None:
        """Queues a new task at the tail of its kind's queue (or its worker's)."""
        task.queued()
        self._queue(task).append(task)

    def requeue_locked(self, task: Task, lost_worker: bool = False) -> None:
        """Puts a task back at the head of its kind's queue (or its worker's), to be sent
        (again) to another worker; lost_worker counts a worker that died before starting it."""
        task.queued(lost_worker)
        self._queue(task).appendleft(task)

    def restore_head_locked(self, task: Task) -> None:
        """Puts a task taken from its queue's head back there, as it was (QUEUED), or again
        (requeue_locked) if a worker was claimed for it meanwhile."""
        if task.state is TaskState.QUEUED:
            self._queue(task).appendleft(task)
        else:
            self.requeue_locked(task)

    def pinned_head_locked(self, idle: list[WorkerMemory]) -> Task | None:
        """The oldest task at the head of the queues of these (idle) workers, left there."""
        heads = [self._pinned[worker][0] for worker in idle if worker in self._pinned]
        return min(heads, key=lambda task: task.request.id, default=None)

    def pop_pinned_locked(self, worker: WorkerMemory) -> Task:
        """Takes the task at the head of a worker's queue (the caller moves it on)."""
        queue = self._pinned[worker]
        task = queue.popleft()
        if not queue:
            del self._pinned[worker]
        return task

    def fail_pinned_locked(self, worker: WorkerMemory, error: BaseException) -> None:
        """Empties a worker's queue (it ended): each task is left to the manager, to fail with
        `error` (what it needed of that worker is gone)."""
        queue = self._pinned.pop(worker, ())
        self._orphans.extend((task, error) for task in queue)
        if queue:
            self._wait_set.wake()

    def head_locked(self, kinds: frozenset[Kind] = frozenset(Kind)) -> Task | None:
        """The oldest task at the head of the queues of these kinds, left there; None when
        none is queued. (Task ids grow with submission; a requeued task keeps its own.)"""
        heads = [self._pending[kind][0] for kind in kinds if self._pending[kind]]
        return min(heads, key=lambda task: task.request.id, default=None)

    def pop_head_locked(self, kind: Kind) -> Task:
        """Takes the task at the head of a kind's queue (the caller moves it on)."""
        return self._pending[kind].popleft()

    def unqueue_locked(self, task: Task) -> bool:
        """Takes a task out of the queue wherever it is; False when it is not queued."""
        queue = self._queue(task)
        try:
            queue.remove(task)
        except ValueError:
            return False
        finally:
            if not queue and task.request.worker is not None:
                self._pinned.pop(task.request.worker, None)
        return True

    def fail_queued_of_locked(self, kind: Kind, error: BaseException) -> None:
        """Empties one kind's queue: each task is left to the manager, to fail with `error`
        (the same error for all: why none of them can run)."""
        queue = self._pending[kind]
        self._orphans.extend((task, error) for task in queue)
        queue.clear()
        for worker, pinned in list(self._pinned.items()):
            kept = [task for task in pinned if task.request.kind is not kind]
            self._orphans.extend((task, error) for task in pinned if task.request.kind is kind)
            if kept:
                self._pinned[worker] = collections.deque(kept)
            else:
                del self._pinned[worker]
        self._wait_set.wake()

    # -- whether tasks are taken --------------------------------------------------------

    def refusal_locked(self) -> BaseException | None:
        """Why a new task is refused: the pool is closed or broken; else None."""
        if self.closing or self.broken is not None:
            return self.broken or PoolClosedError("the pool is closed")
        return None

    def close_locked(self) -> None:
        """No task is taken any more (close() and terminate())."""
        self.closing = True

    def break_locked(self, error: PoolClosedError) -> None:
        """No later task can run: each fails with `error` (the first reason given stays)."""
        self.broken = self.broken or error

    # -- orphans and relayed calls, for the manager ---------------------------------------

    def orphan_locked(self, task: Task, error: BaseException) -> None:
        """Leaves the failing of a task the calling thread does not own to the manager."""
        self._orphans.append((task, error))
        self._wait_set.wake()

    def fail_queued_locked(
        self, kind: type[PoolError], message: str, cause: BaseException | None = None
    ) -> None:
        """Empties the queue: each task is left to the manager, to fail with kind(message).

        The message says why they never ran.
        """
        for queue in [*self._pending.values(), *self._pinned.values()]:
            for task in queue:
                error = kind(message)
                error.__cause__ = cause
                self._orphans.append((task, error))
            queue.clear()
        self._pinned.clear()
        self._wait_set.wake()

    def relay_locked(self, call: Callable[[], object]) -> bool:
        """Leaves a call to the manager thread; False once that thread has ended."""
        if not self._relaying:
            return False
        self._relayed.append(call)
        self._wait_set.wake()
        return True

    def take_relayed_locked(self, last: bool = False) -> list[Callable[[], object]]:
        """The calls relayed to the manager, for it to make; with last, the manager is ending
        and takes no more."""
        if last:
            self._relaying = False
        relayed, self._relayed = self._relayed, []
        return relayed

    def take_orphans_locked(self) -> list[tuple[Task, BaseException]]:
        """The orphans this thread settled (an orphan settled before is dropped), to complete."""
        orphans, self._orphans = self._orphans, []
        return [(task, error) for task, error in orphans if task.settle()]
