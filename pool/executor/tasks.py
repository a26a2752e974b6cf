"""Task bookkeeping: what was asked, its future and what to send for it; the queue.

Kept apart from process bookkeeping (pool.executor.workers): a Task knows its
program, its inputs and its future, never a process's state. Tasks holds the
tasks no worker has: the queue, and the orphans the manager is to fail. The
Pool moves tasks between the queue and the workers::

    QUEUED --claimed with a worker--> RUNNING --settle()--> DONE   (exactly once)
    RUNNING --worker died before starting it, or was killed for
              another reason--> QUEUED again (at most MAX_REQUEUES times)

A task is settled by exactly one thread: the one whose Task.settle() flips
``done`` under the pool's lock; that thread alone completes it (resolves its
future and gives back its shared memory: Task.complete).
"""

from __future__ import annotations

import collections
import enum
import itertools
import mmap
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from pool.errors import PoolClosedError, PoolError
from pool.executor.futures import fail, resolve
from pool.executor.segments import Segment, SegmentCache
from pool.executor.wait_set import Watch
from worker.records import ArrayType, LoweredProgram
from worker.serve import protocol, shm

MAX_REQUEUES = 3
"""How often a task whose workers died before starting it is sent again before it fails."""


class Kind(enum.Enum):
    """What a task asks of a worker."""

    COMPILE = "compile"  # compile or load the program; the result is a CompileResult
    RUN = "run"  # run it; the result is its outputs


@dataclass(eq=False)
class Task:
    """One compile or run request and the future that receives its result."""

    id: int
    kind: Kind
    program: LoweredProgram | None
    program_id: str
    name: str
    future: Future[Any]
    timeout: float | None
    input_types: tuple[ArrayType, ...] = ()
    input_offsets: tuple[int, ...] = ()
    input_size: int = 0
    input: Segment | None = None  # the segment holding large inputs
    in_arena: bool = False  # the inputs go through the worker's arena
    output: Segment | None = None  # a recycled segment offered for large outputs
    arrays: list[np.ndarray] | None = None  # the caller's arrays, while the caller waits (run)
    packed: bytearray | None = None  # the inputs copied at submit, laid out as in shared memory
    segments: SegmentCache | None = None  # where released segments go (set before they come)
    zero_copy: bool = True
    resend_program: bool = False
    deadline: float | None = None
    cache_key: str | None = None  # a run by ProgramSpec: load this key, no program
    spec_types: tuple[ArrayType, ...] | None = None  # that ProgramSpec's input types
    compile_options: bytes | None = None
    declared_types: bool = True  # the inputs have the program's declared types
    done: bool = False  # settled: flipped once, under the pool's lock
    sending: bool = False  # its request went (or may have gone) to its current worker
    kill_error: BaseException | None = None  # what to fail with if the pool kills its worker
    requeues: int = 0

    def settle(self) -> bool:
        """The one transition to DONE, under the pool's lock: True for the single caller that
        makes it, which then completes the task."""
        if self.done:
            return False
        self.done = True
        return True

    def complete(self, outcome: Any) -> None:
        """Resolves a settled task's future with its outcome (an exception fails it) and gives
        back its shared memory; not under the lock (the future's callbacks run here)."""
        self.release()
        if isinstance(outcome, BaseException):
            fail(self.future, outcome)
        else:
            resolve(self.future, outcome)

    def request(
        self, worker_has_program: bool, arena: mmap.mmap, want_output_types: bool
    ) -> tuple[protocol.Compile | protocol.Run, tuple[int, ...]]:
        """Returns the message for a worker and the descriptors to send with it.

        Small inputs are copied into the worker's arena here, which the caller
        has claimed along with the worker; large inputs staged in private
        memory (see pool.executor.inputs) go into a segment now.
        """
        if self.kind is Kind.COMPILE:
            assert self.program is not None
            message = protocol.Compile(
                self.id, self.program_id, self.program, self.name, self.compile_options
            )
            return message, ()
        in_arena = self.in_arena
        if in_arena:
            self.write_to_arena(arena)
        elif self.packed is not None:
            self._packed_to_segment()
        include = self.cache_key is None and (self.resend_program or not worker_has_program)
        output = self.output
        run = protocol.Run(
            self.id,
            self.program_id,
            self.program if include else None,
            self.name,
            None if self.declared_types else self.input_types,
            self.input_offsets,
            self.input_size,
            self.zero_copy,
            in_arena=in_arena,
            cache_key=self.cache_key,
            want_output_types=want_output_types,
            output_capacity=output.capacity if output is not None and output.fd >= 0 else 0,
            compile_options=self.compile_options if include else None,
        )
        fds = () if in_arena else (self.input.fd,)  # type: ignore[union-attr]
        if output is not None and output.fd >= 0:
            fds += (output.fd,)
        return run, fds

    def write_to_arena(self, arena: mmap.mmap, views: list[np.ndarray] | None = None) -> None:
        """Copies inputs that go through the arena into it; views are the arena's views of
        them, where the caller has them (the hot path), which copy fastest."""
        if self.packed is not None:
            memoryview(arena)[: len(self.packed)] = self.packed
        elif self.arrays is not None:
            if views is None:
                shm.write(arena, self.arrays, self.input_offsets)
            else:
                for view, array in zip(views, self.arrays, strict=True):
                    view[...] = array  # same dtype and shape: a plain copy, 6x np.copyto's speed

    def _packed_to_segment(self) -> None:
        """Moves large inputs staged in private memory into a segment, for sending.

        packed goes only once the segment holds them all: if this is cut
        short, the next attempt writes them again.
        """
        assert self.segments is not None and self.input is not None and self.packed is not None
        packed = self.packed

        def write(memory: Any) -> None:
            memoryview(memory)[: len(packed)] = packed

        self.segments.fill(self.input, self.input_size, write)
        self.packed = None

    def release(self) -> None:
        """Gives the task's segments back for reuse once the worker is done with them."""
        if self.segments is not None:
            self.segments.give(self.input, self.output)
        self.arrays = self.packed = None


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

    def __init__(self, watch: Watch) -> None:
        self._watch = watch  # woken when there are orphans or queued tasks for the manager
        self._ids = itertools.count()
        self.pending: collections.deque[Task] = collections.deque()
        self._orphans: list[tuple[Task, BaseException]] = []
        self._relayed: list[Callable[[], object]] = []  # calls for the manager to make
        self._relaying = True  # the manager takes relayed calls (until it ends)
        self.closing = False  # close() or terminate() began: no task is taken any more
        self.broken: BaseException | None = None  # why no later task can run, once broken

    def next_id(self) -> int:
        """A new task's id: ids are never reused within a pool."""
        return next(self._ids)

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

    def requeue_locked(self, task: Task) -> None:
        """Puts a task back at the head of the queue, to be sent (again) to another worker."""
        task.sending = False
        self.pending.appendleft(task)

    def orphan_locked(self, task: Task, error: BaseException) -> None:
        """Leaves the failing of a task the calling thread does not own to the manager."""
        self._orphans.append((task, error))
        self._watch.wake()

    def fail_queued_locked(
        self, kind: type[PoolError], message: str, cause: BaseException | None = None
    ) -> None:
        """Empties the queue: each task is left to the manager, to fail with kind(message).

        The message says why they never ran.
        """
        for task in self.pending:
            error = kind(message)
            error.__cause__ = cause
            self._orphans.append((task, error))
        self.pending.clear()
        self._watch.wake()

    def relay_locked(self, call: Callable[[], object]) -> bool:
        """Leaves a call to the manager thread; False once that thread has ended."""
        if not self._relaying:
            return False
        self._relayed.append(call)
        self._watch.wake()
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
