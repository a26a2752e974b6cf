"""Task bookkeeping: what was asked, its future, and what to send for it.

Kept apart from process bookkeeping (pool.workers): a Task knows its program,
its arguments in shared memory and its future, never a process's state. The
Pool moves tasks between its pending queue and the workers.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import mmap
import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pool.segments import SegmentCache
from worker import protocol, shm
from worker.arguments import types_of
from worker.records import ArrayType, LoweredProgram

_recent_ids: collections.OrderedDict[int, tuple[str, str | None, str]] = collections.OrderedDict()
_RECENT_IDS = 4096


def program_id(program: LoweredProgram) -> str:
    """Identifies a program within a pool: its platform and text (not its source locations).

    Memoized by the identity of the text object, since the same program is
    usually submitted many times and hashing a large module costs more than
    a small program's whole round trip.
    """
    memo = _recent_ids.get(id(program.text))
    if memo is not None and memo[0] is program.text and memo[1] == program.platform:
        return memo[2]
    digest = hashlib.sha256(f"{program.platform or ''}\0{program.text}".encode()).hexdigest()
    _recent_ids[id(program.text)] = (program.text, program.platform, digest)
    while len(_recent_ids) > _RECENT_IDS:
        _recent_ids.popitem(last=False)
    return digest


@dataclass(eq=False)
class Task:
    """One compile or run request and the future that receives its result."""

    id: int
    kind: str  # "compile" or "run"
    program: LoweredProgram | None
    program_id: str
    name: str
    future: Future[Any]
    timeout: float | None
    input_types: tuple[ArrayType, ...] = ()
    input_offsets: tuple[int, ...] = ()
    input_size: int = 0
    input_fd: int = -1
    input_capacity: int = 0
    output_fd: int = -1  # a recycled segment offered for large outputs
    output_capacity: int = 0
    arrays: list[np.ndarray] | None = None  # small inputs, copied into the arena at dispatch
    segments: SegmentCache | None = None  # where released segments go
    zero_copy: bool = True
    resend_program: bool = field(default=False)
    deadline: float | None = None
    cache_key: str | None = None  # a run by ProgramSpec: load this key, no program
    spec_types: tuple[ArrayType, ...] | None = None  # that ProgramSpec's input types
    compile_options: bytes | None = None
    declared_types: bool = True  # the inputs have the program's declared types

    def request(
        self, worker_has_program: bool, arena: mmap.mmap, want_output_types: bool
    ) -> tuple[Any, tuple[int, ...]]:
        """Returns the message for a worker and the descriptors to send with it.

        Small inputs are copied into the worker's arena here, which the caller
        has claimed along with the worker.
        """
        if self.kind == "compile":
            message = protocol.Compile(
                self.id, self.program_id, self.program, self.name, self.compile_options
            )
            return message, ()
        if self.arrays is not None:
            shm.write(arena, self.arrays, self.input_offsets)
        include = self.cache_key is None and (self.resend_program or not worker_has_program)
        message = protocol.Run(
            self.id,
            self.program_id,
            self.program if include else None,
            self.name,
            None if self.declared_types else self.input_types,
            self.input_offsets,
            self.input_size,
            self.zero_copy,
            in_arena=self.arrays is not None,
            cache_key=self.cache_key,
            want_output_types=want_output_types,
            output_capacity=self.output_capacity if self.output_fd >= 0 else 0,
        )
        fds = () if self.arrays is not None else (self.input_fd,)
        if self.output_fd >= 0:
            fds += (self.output_fd,)
        return message, fds

    def release(self, output_used: bool = False) -> None:
        """Returns the task's segments for reuse once the worker is done with them.

        With output_used, the offered output segment holds the results and
        belongs to their arrays now (see SegmentCache.adopt) instead.
        """
        for fd, capacity, kept in (
            (self.input_fd, self.input_capacity, False),
            (self.output_fd, self.output_capacity, output_used),
        ):
            if fd < 0 or kept:
                continue
            if self.segments is not None:
                self.segments.give(fd, capacity)
            else:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.input_fd = self.output_fd = -1


def stage_inputs(
    task: Task,
    arrays: list[np.ndarray],
    arena_limit: int,
    segments: SegmentCache,
    layout: tuple[tuple[ArrayType, ...], tuple[int, ...], int] | None = None,
) -> None:
    """Prepares a task's inputs: kept for the worker's arena if small, else copied to a segment.

    Inputs of at most arena_limit bytes go through the worker's arena (copied
    at dispatch); larger ones get a segment of their own, made here in the
    submitting thread so that the manager thread never copies much. `layout`
    gives the types, offsets and size when they are known (declared types).
    """
    if layout is not None:  # the program's declared types: computed once per program
        task.input_types, task.input_offsets, task.input_size = layout
    else:
        task.input_types = types_of(arrays)
        task.input_offsets, task.input_size = shm.layout(task.input_types)
    if task.input_size <= arena_limit:
        task.arrays = arrays
        return
    task.segments = segments
    recycled = segments.take(task.input_size)
    if recycled is None:
        fd, segment = shm.create(task.input_size, "pjrt-pool-inputs", populate=True)
        capacity = task.input_size
    else:
        fd, capacity = recycled
        segment = shm.attach(fd, capacity, populate=True, keep_fd=True)
    try:
        shm.write(segment, arrays, task.input_offsets)
    except BaseException:
        segments.give(fd, capacity)
        raise
    task.input_fd, task.input_capacity = fd, capacity
