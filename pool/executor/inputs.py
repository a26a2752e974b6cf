"""A run's inputs, staged in the caller's thread, and the shared memory its task holds.

Staging makes later changes to the caller's arrays never reach the task.
Small inputs go through the worker's arena (copied at submit, or straight
from the caller's arrays when the caller waits, as Pool.run does); large
ones into a shared-memory segment of their own, made here so that the
manager thread never copies much, or into private memory while the pool's
descriptor budget is spent (pool.executor.segments). A TaskMemory is changed
only by its own methods: staging (copy_in), copying into the arena or a
segment at dispatch, taking an output segment offered for large outputs,
and giving everything back when the task ends.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from pool.executor.segments import Segment, SegmentCache, writer
from worker.arguments import types_of
from worker.records import ArrayType
from worker.wire import shm

Layout = tuple[tuple[ArrayType, ...], tuple[int, ...], int]
"""Input types, their byte offsets in shared memory, and the size they take."""


class Layouts:
    """The shared-memory layout of each program's declared inputs, computed once per program."""

    def __init__(self) -> None:
        self._layouts: dict[str, Layout] = {}  # by program id

    def of(self, program_id: str, types: tuple[ArrayType, ...]) -> Layout:
        """The layout of a program's declared input types."""
        layout = self._layouts.get(program_id)
        if layout is None:
            offsets, size = shm.layout(types)
            layout = self._layouts[program_id] = (types, offsets, size)
        return layout


def pack(arrays: list[np.ndarray], offsets: tuple[int, ...], size: int) -> bytearray:
    """Copies arrays into private memory laid out as they will be in shared memory."""
    packed = bytearray(size)
    shm.write(packed, arrays, offsets)  # type: ignore[arg-type]
    return packed


class TaskMemory:
    """A run task's inputs as staged, and the segments it holds until it is released."""

    __slots__ = (
        "arrays",
        "declared_types",
        "in_arena",
        "input",
        "offsets",
        "output",
        "packed",
        "segments",
        "size",
        "types",
        "zero_copy",
    )

    def __init__(
        self,
        types: tuple[ArrayType, ...],
        offsets: tuple[int, ...],
        size: int,
        zero_copy: bool,
        declared_types: bool,
    ) -> None:
        self.types = types
        self.offsets = offsets  # byte offsets in the arena or the input segment
        self.size = size
        self.zero_copy = zero_copy
        self.declared_types = declared_types  # the inputs have the program's declared types
        self.in_arena = False  # the inputs go through the worker's arena
        self.arrays: list[np.ndarray] | None = None  # the caller's arrays, while it waits (run)
        self.packed: bytearray | None = None  # copied at submit, laid out as in shared memory
        self.input: Segment | None = None  # the segment holding large inputs
        self.output: Segment | None = None  # a recycled segment offered for large outputs
        self.segments: SegmentCache | None = None  # where released segments go

    @classmethod
    def of(
        cls,
        arrays: list[np.ndarray],
        layout: Layout | None,
        zero_copy: bool,
        declared_types: bool,
    ) -> TaskMemory:
        """The memory a run's inputs will take, holding nothing yet (see copy_in).

        `layout` gives the types, offsets and size when they are known (the
        program's declared types, computed once per program).
        """
        if layout is not None:
            types, offsets, size = layout
        else:
            types = types_of(arrays)
            offsets, size = shm.layout(types)
        return cls(types, offsets, size, zero_copy, declared_types)

    def copy_in(
        self,
        arrays: list[np.ndarray],
        arena_limit: int,
        segments: SegmentCache,
        caller_waits: bool,
    ) -> None:
        """Stages inputs so that later changes to the caller's arrays do not reach the task.

        The task holds this memory before anything is taken, so that
        whatever cuts this short (a Ctrl-C), the task's release gives back
        what was. With caller_waits (Pool.run: the caller gets control back
        only when the task is settled), small inputs stay by reference and
        are copied straight into the worker's arena; otherwise they are
        copied here. Inputs larger than arena_limit go into a segment of
        their own, made here in the submitting thread so that the manager
        thread never copies much; when the pool's descriptor budget is spent
        (many tasks queued), they are copied into private memory instead and
        into a segment at dispatch.
        """
        offsets, size = self.offsets, self.size
        if size <= arena_limit:
            self.in_arena = True
            if caller_waits:
                self.arrays = arrays
            else:
                self.packed = pack(arrays, offsets, size)
            return
        self.segments = segments
        self.input = Segment()
        if segments.reserve(self.input):
            segments.fill(self.input, size, writer(arrays, offsets))
        else:
            self.packed = pack(arrays, offsets, size)

    def write_to_arena(self, arena: mmap.mmap, views: list[np.ndarray] | None = None) -> None:
        """Copies inputs that go through the arena into it; views are the arena's views of
        them, where the caller has them (the hot path), which copy fastest."""
        if self.packed is not None:
            memoryview(arena)[: len(self.packed)] = self.packed
        elif self.arrays is not None:
            if views is None:
                shm.write(arena, self.arrays, self.offsets)
            else:
                for view, array in zip(views, self.arrays, strict=True):
                    view[...] = array  # same dtype and shape: a plain copy, 6x np.copyto's speed

    def to_segment(self) -> None:
        """Moves large inputs staged in private memory into their segment, for sending.

        packed goes only once the segment holds them all: if this is cut
        short, the next attempt writes them again.
        """
        assert self.segments is not None and self.input is not None and self.packed is not None
        packed = self.packed

        def write(memory: Any) -> None:
            memoryview(memory)[: len(packed)] = packed

        self.segments.fill(self.input, self.size, write)
        self.packed = None

    def offer_output(self, segments: SegmentCache, size: int) -> None:
        """Takes a recycled segment of at least `size` bytes for outputs too large for the
        arena, if the cache has one that fits (it goes back with the task)."""
        self.segments = segments
        if self.output is None:
            self.output = Segment()
        segments.take(self.output, size)

    @property
    def output_fd(self) -> int:
        """The descriptor of the output segment offered to the worker; -1 when none is."""
        output = self.output
        return -1 if output is None else output.fd

    def release(self) -> None:
        """Gives the segments back for reuse once the worker is done with them."""
        if self.segments is not None:
            self.segments.give(self.input, self.output)
        self.arrays = self.packed = None
