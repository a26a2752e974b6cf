"""Staging a run's inputs in the caller's thread: later changes to its arrays never reach it.

Small inputs go through the worker's arena (copied at submit, or straight
from the caller's arrays when the caller waits, as Pool.run does); large ones
into a shared-memory segment of their own, made here so that the manager
thread never copies much, or into private memory while the pool's descriptor
budget is spent (pool.executor.segments).
"""

from __future__ import annotations

import numpy as np

from pool.executor.segments import Segment, SegmentCache, writer
from pool.executor.tasks import Task
from worker.arguments import types_of
from worker.records import ArrayType
from worker.serve import shm

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


def stage_inputs(
    task: Task,
    arrays: list[np.ndarray],
    arena_limit: int,
    segments: SegmentCache,
    layout: Layout | None,
    caller_waits: bool,
) -> None:
    """Prepares a task's inputs so that later changes to the caller's arrays do not reach it.

    With caller_waits (Pool.run: the caller gets control back only when the
    task is settled), small inputs stay by reference and are copied straight
    into the worker's arena; otherwise they are copied here. Inputs larger
    than arena_limit go into a segment of their own, made here in the
    submitting thread so that the manager thread never copies much; when
    the pool's descriptor budget is spent (many tasks queued), they are
    copied into private memory instead and into a segment at dispatch.
    `layout` gives the types, offsets and size when they are known.
    """
    if layout is not None:  # the program's declared types: computed once per program
        task.input_types, task.input_offsets, task.input_size = layout
    else:
        task.input_types = types_of(arrays)
        task.input_offsets, task.input_size = shm.layout(task.input_types)
    if task.input_size <= arena_limit:
        task.in_arena = True
        if caller_waits:
            task.arrays = arrays
        else:
            task.packed = pack(arrays, task.input_offsets, task.input_size)
        return
    task.segments = segments
    task.input = Segment()
    if segments.reserve(task.input):
        segments.fill(task.input, task.input_size, writer(arrays, task.input_offsets))
    else:
        task.packed = pack(arrays, task.input_offsets, task.input_size)
