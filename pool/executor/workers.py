"""Process bookkeeping: spawning, watching and stopping worker processes.

A WorkerProcess knows its subprocess, its socket, the tail of its output,
which programs it has loaded and where it is in its life (below); it knows
nothing of futures or queues (that is pool.executor.tasks). The Pool moves workers
between states, always under its lock, through Workers' methods, which
change a WorkerProcess only through its own; a move the table does not
allow raises, so a bookkeeping bug surfaces at once instead of hanging.

Worker states and why each move happens::

    STARTING --Ready----------------> IDLE      plugin loaded, initializer ran, what
                                                Pool(preload=) names loaded (and primed)
    STARTING --end of file----------> DEAD      it died starting (a start-up failure)
    IDLE     --claim(task)----------> BUSY      a thread took it for one task
    IDLE     --readable socket------> DYING     an idle worker only ever shows end of
                                                file (or breaks the protocol): retire it
                                                (Workers.mark_dying_locked)
    BUSY     --reply handled--------> IDLE      its task is settled or queued again
    BUSY     --nothing was sent-----> IDLE      its claimer failed or was interrupted
                                                before sending the request
    BUSY     --end of file----------> DEAD      it died: its task is failed or requeued
    STARTING, IDLE, BUSY --kill-----> DYING     deadline passed, its caller gave up, the
                                                stream broke, a device error, terminate()
    DYING    --end of file----------> DEAD      reaped; the pool spawns a replacement
    STARTING, IDLE --stopped--------> DEAD      close(): an exit request, then signals

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

Workers (below) owns the list of a pool's workers and makes these moves;
only the manager thread spawns and reaps workers, since their
PR_SET_PDEATHSIG is tied to the thread that spawned them, which outlives
them all.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pool.errors import WorkerCrashedError, WorkerStartupError, rebuild_error
from pool.executor.roles import ROLE_ENV, Role, WorkerPlan, start_awaits
from pool.executor.settings import PoolSettings
from pool.executor.tasks import Kind, Task, Tasks
from pool.executor.wait_set import WaitSet
from pool.executor.worker_memory import WorkerMemory
from pool.spawn import child_environment, python_command, with_huge_pages
from worker.cache import CacheCounters
from worker.cache.remote import RemoteCounters
from worker.cache.remote.location import REMOTE_ENV
from worker.errors import DeviceUnavailableError
from worker.fds import close_quietly
from worker.records import ArrayType, CompileStatistics
from worker.wire import protocol, shm

output_log = logging.getLogger("pjrt_pool.worker")
"""Where what workers print goes (at debug level)."""

logger = logging.getLogger("pjrt_pool.pool")

RESPAWN_BACKOFF_SECONDS = 0.5
"""How long after a replacement worker failed to start the pool tries again; the wait
doubles with each failure in a row, up to MAX_RESPAWN_BACKOFF_SECONDS."""

MAX_RESPAWN_BACKOFF_SECONDS = 30.0

FAILED_STARTS_TO_FAIL_QUEUE = 3
"""Failed starts in a row after which, while no worker runs, queued tasks fail (the pool
keeps trying to start workers for later tasks)."""

STDERR_TAIL_BYTES = 8192
"""How much of a worker's output is kept for crash reports."""

_FRAME_LINE = re.compile(r"^\s*@\s+0x[0-9a-f]+")

PARKED_SECONDS = 0.1
"""The longest a parked worker's socket stays out of the manager's wait set (see the module
docstring): the manager's waits last at most this long."""

ARENA_SIZE = 1 << 20
"""Bytes of each worker's arena: small tasks' inputs and outputs pass through it."""


class State(enum.Enum):
    """Where a worker is in its life (see the module docstring)."""

    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    DYING = "dying"
    DEAD = "dead"

    # Members are singletons: hashing by identity is right, and C-fast (Enum's own
    # hash runs in Python), for the state table checked on every move.
    __hash__ = object.__hash__


_MOVES: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.IDLE, State.DYING, State.DEAD}),
    State.IDLE: frozenset({State.BUSY, State.DYING, State.DEAD}),
    State.BUSY: frozenset({State.IDLE, State.DYING, State.DEAD}),
    State.DYING: frozenset({State.DEAD}),
    State.DEAD: frozenset(),
}


@dataclass(frozen=True)
class HotProgram:
    """A program the worker runs by hot slot (worker.wire.protocol.HotRun), and the parent's
    views of the worker's arena where its inputs and outputs lie."""

    slot: int
    input_types: tuple[ArrayType, ...]
    input_offsets: tuple[int, ...]
    inputs: list[np.ndarray]
    outputs: list[np.ndarray]

    def fits(self, types: tuple[ArrayType, ...], offsets: tuple[int, ...]) -> bool:
        """Whether inputs of these types, at these offsets, are the ones the slot runs on."""
        return offsets == self.input_offsets and types == self.input_types

    @property
    def output_bytes(self) -> int:
        """The bytes of its outputs, which a HotReply's reader copies out of the arena."""
        return sum(view.nbytes for view in self.outputs)


def check_hot_slots(slots: tuple[protocol.HotSlot, ...]) -> None:
    """Refuses (ValueError) hot slots a worker's Ready gave that the parent could not view
    safely: inputs not where the parent writes them (shm.layout from the arena's start),
    or inputs or outputs outside the arena. Nothing a worker says is viewed unchecked:
    a view past the arena would fault (SIGBUS) in this process."""
    for slot in slots:
        if shm.layout(slot.input_types)[0] != tuple(slot.input_offsets):
            raise ValueError(f"inputs at {slot.input_offsets!r}, not where the parent lays them")
        shm.check_layout(slot.input_types, slot.input_offsets, ARENA_SIZE, "the worker's arena")
        shm.check_layout(slot.output_types, slot.output_offsets, ARENA_SIZE, "the worker's arena")


ANY_WORKER = WorkerPlan()
"""A worker that compiles and runs on its process's device (every worker but a TPU host's)."""


DEVICE_RETRY_SECONDS = 2.0
"""How soon a device worker whose chip was still held by a dead holder (one of the pool's
own, killed) is started again (Workers.device_unavailable): the chip frees within seconds."""

DEVICE_HELD_RETRY_SECONDS = 10.0
"""How soon a device worker whose chip another live process holds is started again: each
try costs a process that loads libtpu, so not as often."""


def _alive(pid: int) -> bool:
    """Whether a process of that id exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _worker_arguments(
    fd: int,
    max_loaded: int,
    platform: str | None,
    cache_dir: str | None,
    never_compile: bool,
    plan: WorkerPlan,
) -> list[str]:
    """A worker's command line after ``python -m worker`` (worker.serve.server.main reads it)."""
    arguments = ["--fd", str(fd), "--max-loaded", str(max_loaded)]
    arguments += ["--parent-pid", str(os.getpid())]
    if platform:
        arguments += ["--platform", platform]
    if cache_dir:
        arguments += ["--cache-dir", str(cache_dir)]
    if never_compile:
        arguments.append("--never-compile")
    if plan.topology is not None:
        arguments += ["--topology", json.dumps(plan.topology.to_json())]
    return arguments


def _worker_environment(remote: str | Literal[False] | None, plan: WorkerPlan) -> dict[str, str]:
    """A worker's environment: this process's, with the remote tier the pool was given, for
    this worker only (False: none at all), its plan's variables, and huge pages for the
    plugin's large buffers (see with_huge_pages)."""
    environment = child_environment({REMOTE_ENV: remote} if remote else None)
    if remote is False:
        environment.pop(REMOTE_ENV, None)
    environment.update(plan.environment)
    environment[ROLE_ENV] = plan.role.value
    return with_huge_pages(environment)


class WorkerProcess:
    """One worker: a `python -m worker` subprocess and its socket."""

    def __init__(
        self,
        index: int,
        platform: str | None,
        cache_dir: str | None,
        max_loaded: int,
        initializer: bytes,
        never_compile: bool = False,
        preload: tuple[tuple[str, str], ...] = (),
        prime: bool = False,
        remote: str | Literal[False] | None = None,
        plan: WorkerPlan = ANY_WORKER,
    ) -> None:
        self.index = index
        self.role = plan.role  # what it is for (pool.executor.roles): never changes
        self.max_loaded = max_loaded
        self.state = State.STARTING
        self.holder: int | None = None  # the thread that holds the socket; None: the manager
        self.parked = False  # idle, its socket left out of the manager's wait set by a caller
        # The manager is sending to the socket or reading from it (set under the lock):
        # no caller takes it over meanwhile (Workers.take_over_locked).
        self.manager_using = False
        self.task: Task | None = None
        self.killed_by_pool = False  # the pool killed it for a reason not its task's fault
        self.startup_failure: BaseException | None = None  # why it was killed while starting
        self.loaded: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.hot: dict[str, HotProgram] = {}  # the loaded programs it runs by hot slot
        self.hot_runs = 0  # the HotRuns it answered (Pool.worker_info)
        self.plugin: dict[str, Any] = {}
        self.counters: dict[str, int] = {}
        self.remote_counters: dict[str, int] = {}
        self.started_at = time.monotonic()
        self.startup_seconds = 0.0
        self._output = bytearray()

        # The arena and socket come first: a failure here leaves no process behind.
        arena_fd, self.arena = shm.create(ARENA_SIZE + protocol.CONTROL_BYTES, "pjrt-pool-arena")
        protocol.STARTED.pack_into(self.arena, ARENA_SIZE, -1)
        try:
            parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except BaseException:
            close_quietly(arena_fd)
            raise
        arguments = _worker_arguments(
            child_end.fileno(), max_loaded, platform, cache_dir, never_compile, plan
        )
        try:
            self.process = subprocess.Popen(
                python_command("worker", *arguments),
                pass_fds=(child_end.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=_worker_environment(remote, plan),
                # Its own session: a Ctrl-C meant for the parent must not kill
                # workers behind the pool's back; the pool stops them itself.
                start_new_session=True,
            )
        except BaseException:
            close_quietly(arena_fd)
            parent_end.close()
            raise
        finally:
            child_end.close()
        self.sock = parent_end
        # The segments, values and placed slots it holds (what its requests bring it).
        self.memory = WorkerMemory(self.process.pid)
        self.poller = select.poll()  # the socket, for Pool.run's spin (spin_until_readable)
        self.poller.register(parent_end, select.POLLIN)
        self.output_fd = self.process.stdout.fileno() if self.process.stdout else -1
        os.set_blocking(self.output_fd, False)
        try:
            init = protocol.Init(initializer, ARENA_SIZE, preload, prime)
            protocol.send_frame(self.sock, init, (arena_fd,))
        except OSError:
            pass  # the worker died at once; the pool sees the end of its socket
        finally:
            close_quietly(arena_fd)

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.process.pid

    def move(self, to: State) -> None:
        """Moves the worker to another state; the caller holds the pool's lock."""
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"pjrt-pool bug: worker {self.pid} cannot go {self.state} -> {to}")
        self.state = to

    # -- its record, changed by Workers under the pool's lock ------------------------

    def claimed(self, task: Task, holder: int | None) -> None:
        """IDLE -> BUSY with a task, its socket held by `holder` (None: the manager)."""
        # Plain stores first, then the move: an interrupt lands after a call,
        # and by then this thread holds the worker, so CallerPath.recover finds it.
        self.task = task
        self.holder = holder
        self.manager_using = holder is None  # until the manager has sent the request
        self.move(State.BUSY)

    def held_by(self, holder: int | None) -> None:
        """Who holds the socket now: a caller's thread id, or None for the manager."""
        self.holder = holder

    def park(self, parked: bool) -> None:
        """Whether its socket is out of the manager's wait set while the manager holds it."""
        self.parked = parked

    def manager_use(self, using: bool) -> None:
        """Whether the manager is sending to the socket or reading it (no take-over then)."""
        self.manager_using = using

    def take_task(self, task: Task | None = None) -> Task | None:
        """Drops the worker's task (only if it is `task`, when given) and returns what it had."""
        held = self.task
        if task is None or held is task:
            self.task = None
        return held

    def killed_for_the_pool(self) -> None:
        """The pool kills it for a reason that is not its task's fault (the task goes elsewhere)."""
        self.killed_by_pool = True

    def failed_to_start(self, error: BaseException) -> None:
        """Why its start failed, reported when its end is seen."""
        self.startup_failure = error

    def became_ready(
        self,
        plugin: dict[str, Any],
        loaded: tuple[str, ...] = (),
        hot: tuple[protocol.HotSlot, ...] = (),
    ) -> None:
        """STARTING -> IDLE, with what it said of its plugin, the programs it preloaded and
        the hot slots it gave them (their first runs go as HotRuns)."""
        self.move(State.IDLE)
        self.plugin = plugin
        for program_id in loaded:
            self.loaded[program_id] = None
        for slot in hot:
            if slot.key in self.loaded:
                self.note_hot(
                    slot.key,
                    slot.slot,
                    (slot.input_types, slot.input_offsets),
                    (slot.output_types, slot.output_offsets),
                )
        self.startup_seconds = time.monotonic() - self.started_at

    def note_counters(self, counters: dict[str, int], remote: dict[str, int] | None = None) -> None:
        """The disk cache (and remote tier) counters its last reply gave."""
        self.counters = counters
        if remote is not None:
            self.remote_counters = remote

    def take_counters(self) -> tuple[CacheCounters, RemoteCounters]:
        """Its disk cache and remote counters, which it no longer holds (it was reaped)."""
        counters, self.counters = CacheCounters(**self.counters), {}
        remote, self.remote_counters = RemoteCounters(**self.remote_counters), {}
        return counters, remote

    def started(self, task_id: int) -> bool:
        """Whether the worker took up the task: it writes a task's id before working on it."""
        return protocol.STARTED.unpack_from(self.arena, ARENA_SIZE)[0] == task_id

    # -- output ----------------------------------------------------------

    def read_output(self) -> bool:
        """Reads what the worker printed; returns False at end of file."""
        try:
            chunk = os.read(self.output_fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not chunk:
            return False
        self._output += chunk
        del self._output[:-STDERR_TAIL_BYTES]
        for line in chunk.decode(errors="replace").splitlines():
            output_log.debug("worker %d: %s", self.pid, line)
        return True

    def output_tail(self, lines: int = 20) -> str:
        """The last lines the worker wrote to stdout or stderr, without raw stack frames.

        A plugin's fatal error prints its reason and then dozens of frame
        addresses; dropping the addresses keeps the reason in the tail.
        """
        text = self._output.decode(errors="replace").strip()
        kept = [line for line in text.splitlines() if not _FRAME_LINE.match(line)]
        return "\n".join(kept[-lines:])

    # -- loaded programs (mirrors the worker's LRU) ------------------------

    def note_loaded(self, program_id: str, evicted: tuple[str, ...]) -> None:
        """Records that the worker holds a program now, and what it unloaded."""
        self.loaded[program_id] = None
        self.loaded.move_to_end(program_id)
        for gone in evicted:
            self.forget(gone)

    def ran_hot(self, program_id: str) -> None:
        """Records a HotRun of a program it answered: the mirror of its LRU sees the run."""
        self.hot_runs += 1
        self.note_loaded(program_id, ())

    def forget(self, program_id: str) -> None:
        """Records that the worker no longer holds a program (nor its hot and placed slots)."""
        self.loaded.pop(program_id, None)
        self.hot.pop(program_id, None)
        self.memory.forget_program(program_id)

    def note_hot(
        self,
        program_id: str,
        slot: int,
        inputs: tuple[tuple[ArrayType, ...], tuple[int, ...]],
        outputs: tuple[tuple[ArrayType, ...], tuple[int, ...]],
    ) -> None:
        """Records the hot slot the worker gave a program, with its inputs' and outputs'
        (types, offsets) in the arena."""
        (input_types, input_offsets), (output_types, output_offsets) = inputs, outputs
        self.hot[program_id] = HotProgram(
            slot,
            input_types,
            input_offsets,
            shm.views(self.arena, input_types, input_offsets),
            shm.views(self.arena, output_types, output_offsets),
        )

    # -- requests --------------------------------------------------------

    def send(self, message: Any, fds: tuple[int, ...] = ()) -> None:
        """Sends a request; raises OSError if the worker is gone."""
        protocol.send_frame(self.sock, message, fds)

    def receive(self) -> tuple[Any, list[int]]:
        """Receives the next message; raises ConnectionLostError if the worker is gone."""
        return protocol.recv_frame(self.sock)

    # -- ending ----------------------------------------------------------

    def wait_exit(self, timeout: float) -> int | None:
        """Waits for the process to end; returns its exit status or None."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """Kills the process at once (SIGKILL); it is reaped when its end of file is seen."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Closes the parent's ends of the socket and output pipe (after the process ended)."""
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.poller.unregister(self.sock)  # its number may be reused once closed
        self.sock.close()
        self.hot.clear()  # its views of the arena would keep the arena mapped
        with contextlib.suppress(BufferError):  # a view still alive keeps it mapped
            self.arena.close()
        if self.process.stdout is not None:
            with contextlib.suppress(OSError):
                self.read_output()
            self.process.stdout.close()
        self.output_fd = -1  # its number may be reused by now: never read or unwatch it again


def stop_all(workers: list[WorkerProcess], grace: float) -> None:
    """Stops workers together: Exit request, then SIGTERM, then SIGKILL; reaps each.

    All of them get each step at once, so stopping N hung workers takes about
    2 x grace seconds, not N times that.
    """
    running = [w for w in workers if w.process.poll() is None]
    for worker in running:
        with contextlib.suppress(OSError):
            worker.send(protocol.Exit())
    running = _still_running(running, grace)
    for worker in running:
        with contextlib.suppress(ProcessLookupError):
            worker.process.terminate()
    running = _still_running(running, grace)
    for worker in running:
        worker.kill()
    _still_running(running, 10.0)
    for worker in workers:
        worker.close()


def _still_running(workers: list[WorkerProcess], seconds: float) -> list[WorkerProcess]:
    """Waits up to `seconds` in all for workers to end; returns those that did not."""
    deadline = time.monotonic() + seconds
    for worker in workers:
        worker.wait_exit(max(0.0, deadline - time.monotonic()))
    return [w for w in workers if w.process.poll() is None]


class Source(enum.Enum):
    """What a worker's descriptor in the manager's wait set (pool.executor.wait_set) carries."""

    SOCKET = "socket"  # its messages, and its end of file when it dies
    OUTPUT = "output"  # what it prints on stdout and stderr


class Workers:
    """A pool's worker processes: starting and replacing them, who holds each, reaping them.

    The list and every worker's state and holder are changed under the
    pool's lock (methods named *_locked need it held). Claiming, giving back,
    killing and retiring happen on any thread; starting, replacing and
    reaping only on the manager thread (see the module docstring).
    """

    def __init__(
        self, settings: PoolSettings, lock: threading.Lock, wait_set: WaitSet, tasks: Tasks
    ) -> None:
        self._settings = settings  # how many workers to keep, and what each starts with
        self._lock = lock  # the pool's: every move of a worker between states is under it
        self._wait_set = wait_set  # the manager's: the sockets it holds, every output pipe
        # The pool's tasks: whether it is closing (a worker given back then wakes the
        # manager, which waits for every worker to be free), and the queue that fails
        # when no worker can be started.
        self._tasks = tasks
        self._all: list[WorkerProcess] = []  # by index; a replacement takes its slot
        self._retired_counters = CacheCounters()  # the disk cache counters of reaped workers
        self._retired_remote = RemoteCounters()
        self.started = threading.Event()  # every first worker started, or the start failed
        self.startup_error: BaseException | None = None  # why the pool could not start
        self._failed_starts = 0  # replacements that failed to start, in a row
        self._respawns: dict[int, float] = {}  # worker index -> when to try starting it again
        self.takeovers = 0  # sockets callers took over so far (take_over_locked), under the lock
        # What every worker's preloading (Init.preload) loaded, replacements' too, under the lock.
        self.preload_statistics = CompileStatistics()
        # The roles whose workers the pool's start waits for (see start_awaits).
        self._awaited = start_awaits(settings.plan, bool(settings.preload))
        roles = {plan.role for plan in settings.plan}
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
        worker = next((w for w in self._all if w.memory is memory), None)
        if worker is None or worker.state in (State.DYING, State.DEAD):
            return WorkerCrashedError(
                f"the worker (pid {memory.pid}) that holds the task's values is ending, and "
                "its values with it"
            )
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
        """IDLE -> BUSY with `task`, held by `holder` (a caller's thread id; None: the manager)."""
        worker.claimed(task, holder)
        task.claimed()
        if worker.parked:
            worker.park(False)
            if holder is None:  # the manager waits for the reply in its wait set
                self._wait_set.add(worker.sock.fileno(), (Source.SOCKET, worker))
        elif holder is not None:
            self._wait_set.remove(worker.sock.fileno())
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
        if worker.state is State.BUSY:
            worker.move(State.IDLE)
        if worker.holder is not None and worker.state is State.IDLE and not self._tasks.closing:
            worker.park(True)  # first, as in give_back_locked: the socket stays out of the set
            worker.held_by(None)
            return
        self.give_back_locked(worker)

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
        """Nothing was sent: BUSY -> IDLE, without its task, back to the manager."""
        worker.take_task()
        if worker.state is State.BUSY:
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

    def kill_task_locked(self, worker: WorkerProcess, error: BaseException) -> None:
        """Kills a worker for its task, which fails with `error` (the first reason given stays)."""
        task = worker.task
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

    def busy_locked(self) -> bool:
        """Whether a worker has a task or is dying (its end settles or requeues its task)."""
        return any(w.state in (State.BUSY, State.DYING) for w in self._all)

    def counters_locked(self) -> CacheCounters:
        """The disk cache counters of every worker, the reaped ones too."""
        total = self._retired_counters
        for worker in self._all:
            total = total.add(CacheCounters(**worker.counters))
        return total

    def remote_counters_locked(self) -> RemoteCounters:
        """The remote tier counters of every worker, the reaped ones too."""
        total = self._retired_remote
        for worker in self._all:
            total = total.add(RemoteCounters(**worker.remote_counters))
        return total

    def info_locked(self) -> list[dict[str, Any]]:
        """Each worker's pid, state, start-up seconds, plugin, loaded program count, task,
        and whether it has begun that task (see Pool.worker_info)."""
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
            }
            for w in self._all
        ]

    # -- starting, replacing, reaping (the manager thread) -------------------------------

    def start(self) -> None:
        """Spawns the pool's workers; raises what spawning one raised."""
        for index in range(self._settings.workers):
            self._spawn(index)

    def _spawn(self, index: int) -> None:
        settings = self._settings
        plan = settings.plan[index]
        # What a pool preloads is to run: a compile worker, which runs nothing (and on a
        # TPU host holds no chip to load onto), preloads none of it.
        runs = plan.role.takes(Kind.RUN)
        worker = WorkerProcess(
            index,
            settings.platform,
            settings.cache_dir,
            settings.max_loaded,
            settings.initializer,
            settings.never_compile,
            settings.preload if runs else (),
            settings.prime and runs,
            settings.remote,
            plan,
        )
        with self._lock:
            self._wait_set.add(worker.sock.fileno(), (Source.SOCKET, worker))
            self._wait_set.add(worker.output_fd, (Source.OUTPUT, worker))
            if index < len(self._all):
                self._all[index] = worker
            else:
                self._all.append(worker)

    def on_ready(self, worker: WorkerProcess, ready: protocol.Ready) -> None:
        """A worker's start-up message: it is IDLE now, or (an error in it) is killed."""
        if ready.error is not None and ready.failed_program is not None:
            # A preloaded program that did not load: raised as the worker raised it
            # (NotInCacheError, NeverCompileError, ...), naming the program.
            error = rebuild_error(ready.error)
            if len(error.args) == 1 and isinstance(error.args[0], str):
                error.args = (f"preloading program {ready.failed_program!r}: {error.args[0]}",)
            error.add_note(
                f"while worker {ready.pid} preloaded program {ready.failed_program!r} "
                "(Pool(preload=...)): the pool did not start"
            )
            with self._lock:
                worker.failed_to_start(error)
                self.kill_locked(worker)
            return
        if ready.error is not None:
            error: BaseException = WorkerStartupError(
                f"a worker failed to start: {ready.error.qualname}: {ready.error.message}"
            )
            cause = rebuild_error(ready.error)
            if worker.role is Role.DEVICE and isinstance(cause, DeviceUnavailableError):
                error = cause  # its chip is held or missing: see start_failed
            else:
                # What the worker raised, as its cause: a caller can tell a plugin that is
                # not one (PluginLoadError) from an initializer that raised.
                error.__cause__ = cause
                error.add_note(f"Raised in the worker:\n{ready.error.traceback}")
            with self._lock:
                worker.failed_to_start(error)
                self.kill_locked(worker)
            return
        try:
            check_hot_slots(ready.hot)
        except (ValueError, TypeError, AttributeError) as problem:
            with self._lock:
                worker.failed_to_start(
                    WorkerStartupError(
                        f"a worker (pid {worker.pid}) broke the protocol at start-up: the hot "
                        f"slots of its preloaded programs do not fit its arena ({problem})"
                    )
                )
                self.kill_locked(worker)
            return
        with self._lock:
            if worker.state is not State.STARTING:
                return  # killed while starting (terminate)
            worker.became_ready(ready.plugin, ready.loaded, ready.hot)
            if ready.counters is not None:
                worker.note_counters(ready.counters)
            if ready.statistics is not None:
                self.preload_statistics = self.preload_statistics.add(ready.statistics)
            self._failed_starts = 0
            everyone = self._all_started_locked()
        if everyone and not self.started.is_set():
            self.started.set()

    def _all_started_locked(self) -> bool:
        """Whether every worker the pool's start waits for (start_awaits) has started."""
        return all(w.state is not State.STARTING for w in self._all if w.role in self._awaited)

    def expire_starts_locked(self, timeout: float) -> None:
        """Kills the workers of a started pool still starting after `timeout` seconds (a
        device worker that opens its chip beside the pool's start, or a replacement): each
        is a failed start (start_failed), as one that exits is."""
        if not self.started.is_set():
            return  # the constructor's own wait bounds the first start
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

    def replace(self, index: int, failure: BaseException | None) -> None:
        """After a worker's end: start its replacement, or (it failed to start) see start_failed."""
        if failure is None:
            self._respawn(index)
        else:
            self.start_failed(index, failure)

    def _respawn(self, index: int) -> None:
        """Starts a replacement worker (if that fails, start_failed schedules another try).

        Not after the pool broke, nor while closing with nothing left to run
        (close() waits for queued tasks, which need workers).
        """
        with self._lock:
            tasks = self._tasks
            wanted = tasks.broken is None and (not tasks.closing or tasks.queued)
        if not wanted:
            self._respawns.pop(index, None)
            return
        try:
            self._spawn(index)
        except Exception as error:
            self.start_failed(index, WorkerStartupError(f"a worker could not start: {error}"))
        else:
            self._respawns.pop(index, None)

    def respawn_due(self) -> float | None:
        """Retries the replacements that are due; returns seconds to the next one."""
        now = time.monotonic()
        for index, due in list(self._respawns.items()):
            if due <= now:
                self._respawn(index)
        waits = [due - now for due in self._respawns.values()]
        return max(0.0, min(waits)) if waits else None

    def start_failed(self, index: int, error: BaseException) -> None:
        """A worker did not start: the pool's start fails, or the slot is tried again later.

        After the pool started, each failure in a row doubles the wait before
        the next try and is logged. While no worker runs, queued tasks
        fail once FAILED_STARTS_TO_FAIL_QUEUE starts in a row have failed,
        since nothing could run them; the pool itself goes on trying. A
        device worker whose chip is held or missing is device_unavailable's.
        """
        if isinstance(error, DeviceUnavailableError):
            self.device_unavailable(index, error)
            return
        if not self.started.is_set():
            self.startup_error = error
            self.started.set()
            return
        if self.startup_error is not None:
            return  # another worker of a pool that never started: the pool is being stopped
        self._failed_starts += 1
        failures = self._failed_starts
        delay = min(RESPAWN_BACKOFF_SECONDS * 2 ** (failures - 1), MAX_RESPAWN_BACKOFF_SECONDS)
        self._respawns[index] = time.monotonic() + delay
        logger.warning(
            "a replacement worker failed to start (%d in a row); trying again in %.1f s: %s",
            failures,
            delay,
            error,
        )
        if failures < FAILED_STARTS_TO_FAIL_QUEUE:
            return
        with self._lock:
            for kind in Kind:  # the tasks no running worker takes (a pool's runs, say)
                running = any(
                    w.state in (State.IDLE, State.BUSY) and w.role.takes(kind) for w in self._all
                )
                if not running:
                    failed = WorkerStartupError(
                        f"no worker that takes this task ({kind.value}) is running, and the "
                        f"last {failures} attempts to start one failed ({error}); the pool "
                        f"tries again in {delay:.1f} s"
                    )
                    failed.__cause__ = error
                    self._tasks.fail_queued_of_locked(kind, failed)

    def device_unavailable(self, index: int, error: DeviceUnavailableError) -> None:
        """A device worker found its chip held by another process, or gone: the pool goes on.

        The pool's compile workers keep working and its start does not fail.
        When a live process that is not one of this pool's holds the chip
        (libtpu names it), the queued runs fail with the error, which names
        that process, and the slot is tried again after DEVICE_HELD_RETRY_SECONDS;
        otherwise (the holder was a worker that just died, and the chip is
        being freed) they wait, and it is tried again after DEVICE_RETRY_SECONDS.
        So runs go on once the chip is free, and a run submitted while another
        process holds it fails by the next try.
        """
        holder = error.holder
        if holder == os.getpid():
            error = DeviceUnavailableError(
                f"this process (pid {holder}), the pool's parent, holds the chip its device "
                "worker needs: JAX in it opened the TPU (a JAX computation or jax.devices() "
                "before the pool started, or JAX_PLATFORMS naming tpu). Set JAX_PLATFORMS=cpu "
                "for this process, or lower with platform='tpu' before any other JAX call "
                f"({error})",
                holder,
            )
        with self._lock:
            ours = {w.pid for w in self._all}
            foreign = holder is not None and holder not in ours and _alive(holder)
            if foreign:
                self._tasks.fail_queued_of_locked(Kind.RUN, error)
            everyone = self._all_started_locked()
        delay = DEVICE_HELD_RETRY_SECONDS if foreign else DEVICE_RETRY_SECONDS
        self._respawns[index] = time.monotonic() + delay
        logger.info("the device worker could not take its chip; trying again: %s", error)
        if everyone and not self.started.is_set():
            self.started.set()

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
