"""One worker process's record: its state table, its socket and arena, its output, and the
programs it holds.

A WorkerProcess knows its subprocess, its socket, the tail of its output,
which programs it has loaded and where it is in its life (below); it knows
nothing of futures or queues (that is pool.executor.tasks). The Pool moves workers
between states, always under its lock, through Workers' methods
(pool.executor.workers), which change a WorkerProcess only through its own;
a move the table does not allow raises, so a bookkeeping bug surfaces at
once instead of hanging. pool.executor.processes spawns and stops its process.

Worker states and why each move happens::

    STARTING --Ready----------------> IDLE      plugin loaded, initializer ran, what
                                                Pool(preload=) names loaded (and primed)
    STARTING --end of file----------> DEAD      it died starting (a start-up failure)
    IDLE     --claim(task)----------> BUSY      a thread took it for one task
    IDLE     --readable socket------> DYING     an idle worker only ever shows end of
                                                file (or breaks the protocol): retire it
                                                (Workers.mark_dying_locked)
    BUSY     --reply handled--------> IDLE      its task is settled or queued again,
                                                and no run sent ahead awaits its reply
    BUSY     --claimed again--------> BUSY      (no move) a caller takes a worker whose
                                                runs sent ahead await their replies
                                                (`ahead`) and has no task, to send more
    BUSY     --nothing was sent-----> IDLE      its claimer failed or was interrupted
                                                before sending the request
    BUSY     --end of file----------> DEAD      it died: its task is failed or requeued
    STARTING, IDLE, BUSY --kill-----> DYING     deadline passed, its caller gave up, the
                                                stream broke, a device error, terminate()
    DYING    --end of file----------> DEAD      reaped; the pool spawns a replacement
    STARTING, IDLE --stopped--------> DEAD      close(): an exit request, then signals

Who holds its socket (`holder`, `parked`) is the other fact of its record:
pool.executor.workers says how that moves.

Runs sent ahead of their replies (dispatch_ahead: a run that keeps every
output returns its handles once sent) wait in `ahead`, oldest first; the
worker answers in the order it was sent requests, so their replies come
before that of `task`, and the worker stays BUSY until the last is read.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import re
import select
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pool.executor.options import MAX_DISPATCH_AHEAD
from pool.executor.roles import Role
from pool.executor.tasks import LifeState, Task
from pool.executor.worker_memory import WorkerMemory
from worker.cache import CacheCounters
from worker.cache.remote import RemoteCounters
from worker.records import ArrayType
from worker.wire import protocol, shm

output_log = logging.getLogger("pjrt_pool.worker")
"""Where what workers print goes (at debug level)."""

STDERR_TAIL_BYTES = 8192
"""How much of a worker's output is kept for crash reports."""

_FRAME_LINE = re.compile(r"^\s*@\s+0x[0-9a-f]+")

ARENA_SIZE = 1 << 20
"""Bytes of each worker's arena: small tasks' inputs and outputs pass through it."""

ARENA_OUTPUT_LIMIT = ARENA_SIZE // shm.ARENA_OUTPUT_SHARE
"""Outputs up to this many bytes in all come back through the worker's arena (see
worker.wire.shm.ARENA_OUTPUT_SHARE)."""

ARENA_INPUT_LIMIT = ARENA_SIZE // 4
"""Inputs up to this many bytes go through the worker's arena; outputs use the rest.

Smaller tasks then cost no system calls for memory, and their outputs are
copied out of the arena (cheaper than mapping a segment for a few KB). Larger
outputs get a segment of their own that the returned arrays view, with no copy
(pool.executor.worker_process.ARENA_OUTPUT_LIMIT). An array larger than this that
lies in one of the pool's segments already (a result, Pool.empty, Pool.asarray)
is passed as it is, never copied.
"""

# Each run sent ahead of its reply (dispatch_ahead) stages its small inputs in an arena
# region of its own, so that the next request never overwrites inputs the worker may
# still read: the regions of the runs in flight and the next one's must all fit.
assert MAX_DISPATCH_AHEAD * ARENA_INPUT_LIMIT <= ARENA_SIZE


class State(LifeState):
    """Where a worker is in its life (see the module docstring)."""

    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    DYING = "dying"
    DEAD = "dead"


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


class WorkerProcess:
    """One worker: a `python -m worker` subprocess (pool.executor.processes spawns it), its
    socket and its arena."""

    def __init__(
        self,
        index: int,
        role: Role,
        process: subprocess.Popen[bytes],
        sock: socket.socket,
        arena: mmap.mmap,
        started_at: float,
    ) -> None:
        self.index = index
        self.role = role  # what it is for (pool.executor.roles): never changes
        self.process = process
        self.sock = sock
        self.arena = arena  # small tasks' inputs and outputs, then the id of the task begun
        self.state = State.STARTING
        self.holder: int | None = None  # the thread that holds the socket; None: the manager
        self.parked = False  # idle, its socket left out of the manager's wait set by a caller
        # The manager is sending to the socket or reading from it (set under the lock):
        # no caller takes it over meanwhile (Workers.take_over_locked).
        self.manager_using = False
        self.task: Task | None = None
        # Runs sent ahead of their replies, oldest first (their replies come in this order,
        # before the reply to `task`); the worker is BUSY while there is one.
        self.ahead: collections.deque[Task] = collections.deque()
        self.sent_ahead_count = 0  # runs sent ahead so far: the next one's arena region
        # A reply is being read (one to a run sent ahead: until it is handled): a read or
        # handling cut short breaks the stream or the order of `ahead`.
        self.reading = False
        self.killed_by_pool = False  # the pool killed it for a reason not its task's fault
        self.startup_failure: BaseException | None = None  # why it was killed while starting
        self.loaded: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.hot: dict[str, HotProgram] = {}  # the loaded programs it runs by hot slot
        self.hot_runs = 0  # the HotRuns it answered (Pool.worker_info)
        self.plugin: dict[str, Any] = {}
        self.counters: dict[str, int] = {}
        self.remote_counters: dict[str, int] = {}
        self.started_at = started_at  # when its spawning began (time.monotonic())
        self.startup_seconds = 0.0
        self._output = bytearray()
        self.poller = select.poll()  # the socket, for Pool.run's spin (spin_until_readable)
        self.poller.register(sock, select.POLLIN)
        self.output_fd = process.stdout.fileno() if process.stdout else -1
        os.set_blocking(self.output_fd, False)
        # The segments, values and placed slots it holds (what its requests bring it).
        self.memory = WorkerMemory(process.pid)

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
        if not self.ahead:  # else BUSY already: runs sent ahead await their replies
            self.move(State.BUSY)

    def went_ahead(self, task: Task) -> None:
        """Its task's request went ahead of the reply: the task waits in `ahead`, and the
        worker has no task of its own."""
        self.ahead.append(task)
        self.sent_ahead_count += 1
        if self.task is task:
            self.task = None

    def answered(self, task: Task) -> None:
        """The reply to the oldest run sent ahead, `task`, was read."""
        if not self.ahead or self.ahead[0] is not task:
            raise RuntimeError(f"pjrt-pool bug: worker {self.pid} answered a run out of order")
        self.ahead.popleft()

    def take_ahead(self) -> list[Task]:
        """Takes every run sent ahead from it (it ended, or the pool is ending)."""
        ahead = list(self.ahead)
        self.ahead.clear()
        return ahead

    def answering(self) -> Task | None:
        """The task the next reply answers: the oldest run sent ahead, else its task."""
        return self.ahead[0] if self.ahead else self.task

    def arena_region(self) -> int:
        """The arena offset where the next run sent ahead stages its small inputs: a region
        no run in flight reads (at most MAX_DISPATCH_AHEAD - 1 are when one is built)."""
        return (self.sent_ahead_count % MAX_DISPATCH_AHEAD) * ARENA_INPUT_LIMIT

    def reading_reply(self, reading: bool) -> None:
        """Whether a reply is being read from its socket (see CallerPath.recover)."""
        self.reading = reading

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
        if sum(t.nbytes for t in output_types) > ARENA_OUTPUT_LIMIT:
            return  # a HotReply's outputs are copied out: these go to a segment instead
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
