"""A pool's workers: the list, who holds each worker's socket, and the moves between their
states that any thread makes (claiming, giving back, freeing, killing, retiring).

Each worker's record and its state table are pool.executor.worker_process's;
the Pool moves workers between states, always under its lock, through the
methods here, which change a WorkerProcess only through its own. Starting
and replacing workers is pool.executor.starts'; spawning and stopping their
processes is pool.executor.processes'.

Who holds the socket is `holder`, a second fact: None for the pool's
manager thread, whose wait set (pool.executor.wait_set) has the socket then, or the id
of one caller thread, with the socket out of that set::

    manager --claimed by a caller (Pool.run; a submit that dispatches)--> caller
    manager --taken over by the caller waiting for its BUSY worker's
              reply (TaskFuture.result), unless the manager reads it------> caller
    caller  --request sent (submit), reply handled (run, result), nothing
              came within the caller's timeout, or the caller failed or
              was interrupted (CallerPath.recover)------------------------> manager

Only Workers.claim_locked, Workers.take_over_locked, Workers.give_back_locked
and Workers.free_locked change it, so "the manager's wait set has the socket
exactly when the manager holds it" holds everywhere else, with one exception:
a worker `parked` by the caller that freed it. Taking a socket out of the
epoll set and putting it back costs two system calls (about 2 us) on every
Pool.run, so a caller that frees an idle worker leaves its socket out
(parked: IDLE, holder None), and the next caller to claim it takes it as it
is. The manager puts every parked socket back at each turn of its loop (its
waits last at most PARKED_SECONDS), before it claims a worker, and when a
worker is killed, so an idle worker's death is seen within that time, or by
the next caller that claims it (which gives it back, dead, to the manager). A wait
of the manager's may still report a reply that a caller took the socket
over for and read meanwhile: the manager looks before it reads.

Only the manager thread adds (a worker it spawned) and reaps workers.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from pool.errors import WorkerCrashedError, WorkerStartupError
from pool.executor.processes import stop_all
from pool.executor.roles import Role, WorkerPlan
from pool.executor.tasks import Kind, Task, Tasks
from pool.executor.wait_set import WaitSet
from pool.executor.worker_memory import WorkerMemory
from pool.executor.worker_process import State, WorkerProcess
from worker.cache import CacheCounters
from worker.cache.counters import summed
from worker.cache.remote import RemoteCounters

PARKED_SECONDS = 0.1
"""The longest a parked worker's socket stays out of the manager's wait set (see the module
docstring): the manager's waits last at most this long."""


NOT_STARTED = "not started"
"""Pool.worker_info's state of a worker slot started only when first needed, until then (a
device worker waiting for the compiles to end, or for a run: pool.executor.roles)."""


class Source(enum.Enum):
    """What a worker's descriptor in the manager's wait set (pool.executor.wait_set) carries."""

    SOCKET = "socket"  # its messages, and its end of file when it dies
    OUTPUT = "output"  # what it prints on stdout and stderr


class Workers:
    """A pool's worker processes: who holds each, the moves any thread makes, reaping them.

    The list and every worker's state and holder are changed under the
    pool's lock (methods named *_locked need it held). Claiming, giving back,
    killing and retiring happen on any thread; adding and reaping only on
    the manager thread (see the module docstring).
    """

    def __init__(
        self, plan: tuple[WorkerPlan, ...], lock: threading.Lock, wait_set: WaitSet, tasks: Tasks
    ) -> None:
        self._lock = lock  # the pool's: every move of a worker between states is under it
        self._wait_set = wait_set  # the manager's: the sockets it holds, every output pipe
        # The pool's tasks: whether it is closing (a worker given back then wakes the
        # manager, which waits for every worker to be free).
        self._tasks = tasks
        self._all: list[WorkerProcess] = []  # by index; a replacement takes its slot
        self._retired_counters = CacheCounters()  # the disk cache counters of reaped workers
        self._retired_remote = RemoteCounters()
        self.takeovers = 0  # sockets callers took over so far (take_over_locked), under the lock
        roles = {slot.role for slot in plan}
        self._competing = {
            kind: frozenset(
                other for other in Kind if any(r.takes(kind) and r.takes(other) for r in roles)
            )
            for kind in Kind
        }

    def __iter__(self) -> Iterator[WorkerProcess]:
        """Every worker, by index (under the lock)."""
        return iter(self._all)

    @property
    def plugin(self) -> dict[str, Any]:
        """What the first worker said of its plugin when it started (path, key parts, ...)."""
        return self._all[0].plugin

    # -- claiming and giving back (any thread) -------------------------------------------

    def idle_locked(
        self, program_id: str, kind: Kind, pinned: WorkerMemory | None = None
    ) -> WorkerProcess | None:
        """An idle worker that takes tasks of the kind (pool.executor.roles), one that has the
        program loaded if there is one; with `pinned` (the memory of the worker that holds a
        task's values), that worker if it is idle."""
        if pinned is not None:
            for worker in self._all:
                if worker.memory is pinned:
                    idle = worker.state is State.IDLE and worker.holder is None
                    return worker if idle else None
            return None
        first = None
        for worker in self._all:
            if worker.state is State.IDLE and worker.holder is None and worker.role.takes(kind):
                if program_id in worker.loaded:
                    return worker
                first = first or worker
        return first

    def lost_locked(self, memory: WorkerMemory) -> BaseException | None:
        """Why a task that needs the values of the worker with this memory cannot run: the
        worker ended or is ending (they are lost). None while it lives."""
        if memory.lost is not None:
            return memory.lost
        for worker in self._all:  # a loop, not next() of a generator: this runs every call
            if worker.memory is memory:
                break
        else:
            worker = None
        if worker is None or worker.state in (State.DYING, State.DEAD):
            return WorkerCrashedError(
                f"the worker (pid {memory.pid}) that holds the task's values is ending, and "
                "its values with it"
            )
        return None

    def ahead_locked(
        self, program_id: str, kind: Kind, pinned: WorkerMemory | None = None
    ) -> WorkerProcess | None:
        """A worker with runs sent ahead of their replies and no task, that no thread holds
        or reads: a caller may claim it to send the next run (having read their replies
        first, CallerPath.run_directly); with `pinned`, that worker, else one that takes
        the kind and has the program loaded."""
        for worker in self._all:
            if (
                worker.ahead
                and worker.task is None
                and worker.holder is None
                and not worker.manager_using
                and worker.state is State.BUSY
                and (worker.memory is pinned if pinned is not None else program_id in worker.loaded)
                and worker.role.takes(kind)
            ):
                return worker
        return None

    def idle_workers_locked(self) -> list[WorkerProcess]:
        """The workers idle now, with no caller holding them."""
        return [w for w in self._all if w.state is State.IDLE and w.holder is None]

    def idle_kinds_locked(self) -> frozenset[Kind]:
        """The kinds of task some idle worker takes now."""
        return frozenset(
            kind
            for kind in Kind
            for worker in self._all
            if worker.state is State.IDLE and worker.holder is None and worker.role.takes(kind)
        )

    def competing_kinds(self, kind: Kind) -> frozenset[Kind]:
        """The kinds of task that wait for the same workers as tasks of `kind` (roles never
        change, so this is known from the pool's plan)."""
        return self._competing[kind]

    def claim_locked(self, worker: WorkerProcess, task: Task, holder: int | None) -> None:
        """IDLE -> BUSY with `task`, held by `holder` (a caller's thread id; None: the manager);
        or a BUSY worker with runs sent ahead (ahead_locked), by a caller."""
        worker.claimed(task, holder)
        task.claimed()
        if worker.parked:
            worker.park(False)
            if holder is None:  # the manager waits for the reply in its wait set
                self._wait_set.add(worker.sock.fileno(), (Source.SOCKET, worker))
        elif holder is not None:
            self._wait_set.remove(worker.sock.fileno())
        if worker.ahead:
            # A reply the manager's wait saw may be read by the caller first: the manager
            # then peeks before it reads (as for take_over_locked).
            self.takeovers += 1
        if holder is not None and task.deadline is not None:
            self._wait_set.wake()  # the manager's wait must end at this deadline

    def take_over_locked(self, future: object, holder: int) -> WorkerProcess | None:
        """manager -> caller: the BUSY worker whose task has `future`, for the caller waiting
        for its reply; None if no worker has that task, or the manager is reading its reply,
        or another caller holds the worker."""
        for worker in self._all:
            task = worker.task
            if task is None or task.future is not future:
                continue
            if worker.state is not State.BUSY or worker.holder is not None:
                return None
            if worker.manager_using:
                return None
            worker.held_by(holder)  # first, as in claim_locked
            # Out of the set before it is counted: a manager's wait that began after the
            # count must not see the socket, or its report passes as fresh (the manager
            # then read an idle worker the caller had freed, and blocked on it).
            self._wait_set.remove(worker.sock.fileno())
            self.takeovers += 1
            return worker
        return None

    def give_back_locked(self, worker: WorkerProcess) -> None:
        """Returns a caller-held worker to the manager: its socket into the wait set, then holder.

        In that order, so that an interrupt between the two leaves the worker
        held (and CallerPath.recover gives it back again; adding twice is fine).
        """
        if worker.holder is None:
            return
        self._unpark_locked(worker)  # also ends a park an interrupt cut short
        worker.held_by(None)
        if self._tasks.closing:
            self._wait_set.wake()  # close() waits for this worker to be free

    def give_back(self, worker: WorkerProcess) -> None:
        """give_back_locked, taking the lock."""
        with self._lock:
            self.give_back_locked(worker)

    def free_locked(self, worker: WorkerProcess, task: Task) -> None:
        """A reply to `task` was handled: BUSY -> IDLE, without its task, back to the manager
        (parked, when a caller frees an idle worker of a pool that is not closing)."""
        worker.take_task(task)
        if worker.state is State.BUSY and not worker.ahead:
            worker.move(State.IDLE)
        if worker.holder is not None and worker.state is State.IDLE and not self._tasks.closing:
            worker.park(True)  # first, as in give_back_locked: the socket stays out of the set
            worker.held_by(None)
            return
        self.give_back_locked(worker)

    def went_ahead_locked(self, worker: WorkerProcess, task: Task) -> None:
        """A caller sent its worker `task`, a run that goes ahead of its reply (AHEAD): the
        task waits in the worker's `ahead`, and the caller lets go of the worker, parked
        (BUSY: the manager puts its socket back at its next turn and reads the replies
        nobody else reads), or given back while the pool closes."""
        task.went_ahead()
        worker.went_ahead(task)
        if self._tasks.closing:
            self.give_back_locked(worker)
            return
        worker.park(True)  # first, as in free_locked
        worker.held_by(None)

    def answered_locked(self, worker: WorkerProcess, task: Task) -> bool:
        """The reply to `task`, the oldest run sent ahead to the worker, was read: the worker
        goes IDLE when it has no other; returns whether this call settled the task."""
        worker.answered(task)
        worker.reading_reply(False)  # its reply is read and handled: the stream is whole
        if not worker.ahead and worker.task is None and worker.state is State.BUSY:
            worker.move(State.IDLE)  # read by the manager, which keeps it in its wait set
        return task.settle()

    def take_ahead_locked(self, worker: WorkerProcess) -> tuple[list[Task], Task | None]:
        """Takes a worker's runs sent ahead (it ended, or the pool is ending), and the one it
        had begun, if it had (before it is reaped: its arena is still open)."""
        ahead = worker.take_ahead()
        begun = next((t for t in ahead if worker.started(t.request.id)), None)
        return ahead, begun

    def unpark_locked(self) -> None:
        """Puts the socket of every parked worker back into the manager's wait set."""
        for worker in self._all:
            if worker.parked:
                self._unpark_locked(worker)

    def _unpark_locked(self, worker: WorkerProcess) -> None:
        """Its socket into the manager's wait set (unless it is dead), then not parked."""
        if worker.state is not State.DEAD:
            self._wait_set.add(worker.sock.fileno(), (Source.SOCKET, worker))
        worker.park(False)

    def unclaim_locked(self, worker: WorkerProcess) -> None:
        """Nothing was sent: BUSY -> IDLE (unless runs sent ahead await their replies),
        without its task, back to the manager."""
        worker.take_task()
        if worker.state is State.BUSY and not worker.ahead:
            worker.move(State.IDLE)
        self.give_back_locked(worker)

    def kill_locked(self, worker: WorkerProcess) -> None:
        """Kills a worker: it becomes DYING, and its end of file finishes it (the manager)."""
        if worker.state is State.DEAD:
            return
        if worker.parked:  # the manager must see its end of file
            self._unpark_locked(worker)
        if worker.state is not State.DYING:
            worker.move(State.DYING)
        worker.kill()

    def kill_task_locked(
        self, worker: WorkerProcess, error: BaseException, task: Task | None = None
    ) -> None:
        """Kills a worker for its task (or `task`, a run sent ahead to it), which fails with
        `error` (the first reason given stays)."""
        task = task or worker.task
        if task is not None and not task.done:
            task.kill_with(error)
        self.kill_locked(worker)

    def retire_locked(self, worker: WorkerProcess) -> None:
        """Kills a worker for a reason that is not its task's fault (the task goes elsewhere)
        and gives it back to the manager, which reaps it."""
        worker.killed_for_the_pool()
        self.kill_locked(worker)
        self.give_back_locked(worker)

    def mark_dying_locked(self, worker: WorkerProcess) -> None:
        """An idle worker's socket is readable: that is its end of file (or a protocol error),
        so it is retired, and no one claims it while the manager reads it."""
        worker.move(State.DYING)
        worker.killed_for_the_pool()

    def manager_reads_locked(self, worker: WorkerProcess) -> bool:
        """The manager is to read a worker's readable socket: False when a caller holds it or
        it is dead (nothing for the manager then); an idle one is marked dying."""
        if worker.state is State.DEAD or worker.holder is not None:
            return False
        if worker.state is State.IDLE:
            self.mark_dying_locked(worker)
        worker.manager_use(True)  # no caller takes the socket over meanwhile
        return True

    def manager_done(self, worker: WorkerProcess) -> None:
        """The manager's send to, or read from, a worker is over: a waiting caller may take its
        socket over. A plain store, made without the lock as a claim's is read under it."""
        worker.manager_use(False)

    def lose_locked(self, worker: WorkerProcess) -> tuple[Task | None, bool, bool]:
        """A worker's socket ended: it is DEAD. Returns the task it had, whether it had begun
        that task, and whether it was still starting."""
        was_starting = worker.state is State.STARTING
        task = worker.take_task()
        started = task is not None and worker.started(task.request.id)
        worker.move(State.DEAD)
        return task, started, was_starting

    def take_task_locked(self, worker: WorkerProcess) -> Task | None:
        """Takes a worker's task from it (the pool is ending: the caller settles it)."""
        return worker.take_task()

    def note_counters_locked(
        self, worker: WorkerProcess, counters: dict[str, int], remote: dict[str, int] | None
    ) -> None:
        """Records the disk cache (and remote tier) counters a worker's reply gave."""
        worker.note_counters(counters, remote)

    def retire(self, worker: WorkerProcess) -> None:
        """retire_locked, taking the lock."""
        with self._lock:
            self.retire_locked(worker)

    def held_by_locked(self, holder: int) -> list[WorkerProcess]:
        """The workers a caller's thread holds."""
        return [w for w in self._all if w.holder == holder]

    def held_locked(self) -> list[WorkerProcess]:
        """The workers any caller's thread holds."""
        return [w for w in self._all if w.holder is not None]

    def running_locked(self, task: Task) -> WorkerProcess | None:
        """The worker that has the task, if one has."""
        return next((w for w in self._all if w.task is task), None)

    def busy_locked(self, roles: frozenset[Role] | None = None) -> bool:
        """Whether a worker (of these roles, if given) has a task or is dying (its end settles
        or requeues its task)."""
        return any(
            w.state in (State.BUSY, State.DYING) and (roles is None or w.role in roles)
            for w in self._all
        )

    def counters_locked(self) -> CacheCounters:
        """The disk cache counters of every worker, the reaped ones too."""
        return summed((CacheCounters(**w.counters) for w in self._all), self._retired_counters)

    def remote_counters_locked(self) -> RemoteCounters:
        """The remote tier counters of every worker, the reaped ones too."""
        return summed(
            (RemoteCounters(**w.remote_counters) for w in self._all), self._retired_remote
        )

    def info_locked(self, not_started: Sequence[Role] = ()) -> list[dict[str, Any]]:
        """Each worker's pid, state, start-up seconds, plugin, loaded program count, task,
        and whether it has begun that task (see Pool.worker_info), then a row for each slot
        not started yet, of these roles (pool.executor.starts: started when first needed),
        in state NOT_STARTED, without a process."""
        waiting = [
            {
                "pid": None,
                "state": NOT_STARTED,
                "startup_seconds": 0.0,
                "plugin": {},
                "loaded": 0,
                "hot_runs": 0,
                "role": role.value,
                "values": 0,
                "value_bytes": 0,
                "task": None,
                "started": False,
                "ahead": 0,
            }
            for role in not_started
        ]
        return [
            {
                "pid": w.pid,
                "state": w.state.value,
                "startup_seconds": w.startup_seconds,
                "plugin": dict(w.plugin),
                "loaded": len(w.loaded),
                "hot_runs": w.hot_runs,
                "role": w.role.value,
                "values": w.memory.value_count,
                "value_bytes": w.memory.value_bytes,
                "task": None if w.task is None else w.task.request.name,
                # A dead worker has no task (its arena is closed by then).
                "started": w.task is not None and w.started(w.task.request.id),
                "ahead": len(w.ahead),  # runs sent ahead of their replies (dispatch_ahead)
            }
            for w in self._all
        ] + waiting

    def starting_locked(self, roles: frozenset[Role] | None = None) -> bool:
        """Whether some worker (of these roles, if given) is still starting."""
        return any(
            w.state is State.STARTING and (roles is None or w.role in roles) for w in self._all
        )

    def working_locked(self, kind: Kind | None = None) -> bool:
        """Whether some worker (that takes tasks of this kind, if given) is up (idle or
        busy): it can run what is queued."""
        return any(
            w.state in (State.IDLE, State.BUSY) and (kind is None or w.role.takes(kind))
            for w in self._all
        )

    def expire_starts_locked(self, timeout: float) -> None:
        """Kills the workers still starting after `timeout` seconds (the caller calls this
        once the pool has started: a device worker that opens its chip beside the pool's
        start, or one started when first needed, or a replacement; each counts from its
        own spawning): each is a failed start, as one that exits is."""
        now = time.monotonic()
        for worker in self._all:
            if worker.state is State.STARTING and now - worker.started_at > timeout:
                worker.failed_to_start(
                    WorkerStartupError(
                        f"a worker (pid {worker.pid}, {worker.role.value}) did not start within "
                        f"{timeout:.0f} s (start_timeout); it was killed"
                    )
                )
                self.kill_locked(worker)

    def slots_locked(self) -> set[int]:
        """The slots (indices in the pool's plan) that have a worker, in any state."""
        return {w.index for w in self._all}

    def pids_locked(self) -> set[int]:
        """The process ids of the pool's workers, the dead ones not reaped yet too."""
        return {w.pid for w in self._all}

    # -- adding, reaping, stopping (the manager thread) ----------------------------------

    def add(self, worker: WorkerProcess) -> None:
        """A worker just spawned for its slot (a replacement takes the dead one's, the list
        stays in the order of the slots, some of which start later: pool.executor.starts):
        its socket and output are watched from now on."""
        with self._lock:
            self._wait_set.add(worker.sock.fileno(), (Source.SOCKET, worker))
            self._wait_set.add(worker.output_fd, (Source.OUTPUT, worker))
            at = next((i for i, w in enumerate(self._all) if w.index >= worker.index), None)
            if at is None:
                self._all.append(worker)
            elif self._all[at].index == worker.index:
                self._all[at] = worker
            else:
                self._all.insert(at, worker)

    def reap(self, worker: WorkerProcess) -> int | None:
        """Unwatches a dead worker, reaps it and collects the rest of its output."""
        self._wait_set.remove(worker.sock.fileno())
        self._wait_set.remove(worker.output_fd)
        returncode = worker.wait_exit(5.0)
        if returncode is None:
            worker.kill()
            returncode = worker.wait_exit(10.0)
        worker.close()
        with self._lock:
            counters, remote = worker.take_counters()
            self._retired_counters = self._retired_counters.add(counters)
            self._retired_remote = self._retired_remote.add(remote)
        return returncode

    def stop(self, stopping: list[WorkerProcess], grace: float) -> None:
        """Stops and reaps the workers the pool's end stops (see stop_all); DEAD after.

        A worker a caller still holds (it never gave it back) is killed and
        reaped, but its socket stays open: that caller may still use it.
        """
        for worker in stopping:
            self._wait_set.remove(worker.sock.fileno())
            self._wait_set.remove(worker.output_fd)
        stop_all([w for w in stopping if w.holder is None], grace)
        for worker in stopping:
            if worker.holder is not None:
                worker.wait_exit(1.0)
        with self._lock:
            for worker in stopping:
                worker.move(State.DEAD)
