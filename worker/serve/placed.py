"""A pool worker's runs by place: where a Run's inputs lie and its outputs go, and the runs
that read and write there.

Runs in a pool worker (worker.serve.server, which calls it). A Run names each
input by a Where (worker.wire.protocol: a place in a mapped segment, or a kept
value) and says where its outputs go (destinations), or the worker lays them
out (OutputLayout: after the arena's inputs, or in a new segment).
check_run_inputs checks the inputs against the executable's own layout
(InputLayout); run_placed runs through the program's placed slot in the
native hot loop (native/hot_loop.cc), and run_from_views through numpy views
(view) for the runs placed slots do not take: inputs of other types than the
executable's own, and programs over several devices.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, NamedTuple

import numpy as np

from worker import _pjrt
from worker.compile.executable import Executable
from worker.records import ArrayType
from worker.wire import places, shm
from worker.wire.protocol import OutputPlace, Run


class InputLayout(NamedTuple):
    """Where a program's inputs lie in shared memory when they have its own input types."""

    types: tuple[ArrayType, ...]
    offsets: tuple[int, ...]
    size: int

    @classmethod
    def of(cls, types: tuple[ArrayType, ...]) -> InputLayout:
        """The layout the parent uses for these types (shm.layout from offset 0)."""
        offsets, size = shm.layout(types)
        return cls(types, offsets, size)


def check_run_inputs(request: Run, own: InputLayout | None) -> tuple[ArrayType, ...]:
    """Returns the types of a Run request's inputs; raises if they cannot be its inputs.

    own is the executable's own input layout (None when its input types are
    unknown). A request without input_types says its inputs have those own
    types; one with input_types (a program of unknown types, or a ProgramSpec's
    run, whose types are the spec's) has them converted to the executable's own
    types by Executable.prepare_arguments, which refuses a wrong count or shape.
    Each input is one Where (a place, or a kept value); where a place lies is
    checked against its segment when it is read (native/segments.cc).
    """
    if request.input_types is None:
        if own is None:
            raise ValueError("the input types are unknown: the parent must send them")
        types = own.types
    else:
        types = tuple(request.input_types)
    if len(request.sources) != len(types):
        raise ValueError(
            f"the request places {len(request.sources)} inputs for {len(types)} input types "
            f"({', '.join(map(str, types))}): the parent and the worker disagree about the program"
        )
    if any(kind not in (places.PLACE, places.VALUE) for kind, _, _ in request.sources):
        raise ValueError("an input is neither in shared memory nor a kept value")
    return types


def in_arena_at(sources: tuple[places.Where, ...], offsets: tuple[int, ...]) -> bool:
    """Whether every input lies in the arena, at these offsets (a hot slot's layout)."""
    return len(sources) == len(offsets) and all(
        kind == places.PLACE and segment == 0 and offset == expected
        for (kind, segment, offset), expected in zip(sources, offsets, strict=True)
    )


class OutputLayout(NamedTuple):
    """Where a Run's outputs go: where its destinations say ("placed"), or laid out here:
    after the arena's inputs ("arena"), or in a segment made for them ("new"), with the
    outputs the request keeps left out."""

    place: OutputPlace
    offsets: tuple[int, ...]
    """Each output's offset in its place; -1 for a kept one."""
    size: int
    """The bytes the laid-out outputs span ("new": the segment's size)."""
    fd: int | None
    """The "new" segment's descriptor."""
    wheres: tuple[places.Where, ...] | None
    """The request's destinations ("placed"), or those over the inputs ("spare"); else None."""
    keep: dict[int, int]
    """Output index -> the value id it is kept as (laid out here)."""

    @classmethod
    def of(
        cls, request: Run, types: tuple[ArrayType, ...], outputs: tuple[ArrayType, ...],
        arena_size: int,
    ) -> OutputLayout:  # fmt: skip
        """The layout of a Run's outputs; `types` are its inputs'."""
        if request.destinations is not None:
            if len(request.destinations) != len(outputs):
                raise ValueError(
                    f"the request places {len(request.destinations)} outputs of a program of "
                    f"{len(outputs)}"
                )
            offsets = tuple(
                offset if kind == places.PLACE else -1 for kind, _, offset in request.destinations
            )
            return cls("placed", offsets, 0, None, tuple(request.destinations), {})
        keep = dict(request.keep)
        if any(not 0 <= index < len(outputs) for index in keep):
            raise ValueError(f"the request keeps outputs {sorted(keep)} of {len(outputs)}")
        start = max(
            (offset + t.nbytes for (kind, segment, offset), t in zip(request.sources, types,
             strict=True) if kind == places.PLACE and segment == 0),
            default=0,
        )  # fmt: skip
        return cls.arena_or_new(outputs, shm.aligned(start), arena_size, keep, request.spare)

    @classmethod
    def arena_or_new(
        cls, outputs: tuple[ArrayType, ...], start: int, arena_size: int,
        keep: dict[int, int] | None = None, spare: tuple[int, int] | None = None,
    ) -> OutputLayout:  # fmt: skip
        """Outputs (but those kept) after `start` in the arena if they fit, else in a new
        segment of their own; over the inputs in the `spare` segment (its id and bytes:
        Run.spare) instead when they fit there and are more than the arena's share for
        outputs (as the parent lays out later runs' outputs)."""
        keep = keep or {}
        placed = [t for i, t in enumerate(outputs) if i not in keep]
        offsets, end = shm.layout(placed, start)
        place: OutputPlace = "arena"
        fd: int | None = None
        own_offsets, own_end = shm.layout(placed)  # in a segment of their own
        large = sum(t.nbytes for t in placed) > arena_size // shm.ARENA_OUTPUT_SHARE
        if spare is not None and large and own_end <= spare[1]:
            place, offsets, end = "spare", own_offsets, own_end
        elif end > arena_size:
            offsets, end = own_offsets, own_end
            place, fd = "new", shm.new_segment(end, "pjrt-pool-outputs")
        found = iter(offsets)
        every = tuple(-1 if i in keep else next(found) for i in range(len(outputs)))
        layout = cls(place, every, end, fd, None, keep)
        if spare is not None and place == "spare":  # its places, as a request's would be
            return layout._replace(wheres=tuple(layout.destinations(spare[0])))
        return layout

    def destinations(self, new_segment: int) -> list[places.Where]:
        """Each output's Where; `new_segment` is the id the "new" (or "spare") segment is
        mapped under."""
        if self.wheres is not None:
            return list(self.wheres)
        segment = 0 if self.place == "arena" else new_segment
        return [
            (places.VALUE, self.keep[i], 0) if i in self.keep else (places.PLACE, segment, o)
            for i, o in enumerate(self.offsets)
        ]


def run_placed(loop: _pjrt.HotLoop, request: Run, slot: int, layout: OutputLayout) -> None:
    """Runs a Run through its placed slot, its "new" segment (if any) mapped meanwhile
    under an id no parent segment has; the segment's descriptor is closed if this fails."""
    temporary = -1 - request.task_id
    try:
        if layout.fd is not None:
            loop.map_segments([(temporary, layout.fd, layout.size)])
        loop.run_placed(
            request.task_id,
            slot,
            list(request.sources),
            layout.destinations(temporary),
            request.zero_copy,
        )
    except BaseException:
        if layout.fd is not None:
            os.close(layout.fd)
        raise
    finally:
        loop.forget_segments([temporary])


def run_from_views(
    loop: _pjrt.HotLoop,
    arena: mmap.mmap,
    arena_size: int,
    request: Run,
    executable: Executable,
    types: tuple[ArrayType, ...],
) -> OutputLayout:
    """Runs through numpy views of the inputs' places, converted by prepare_arguments,
    outputs where the request says or laid out here: a run on inputs of other types
    than the executable's own (a ProgramSpec's, or a program of unknown types), and a
    program over several devices (Executable.run_into cuts its arguments into their
    devices' blocks), which placed runs do not take. Kept values have no such path."""
    destinations = request.destinations or ()
    kept = any(kind != places.PLACE for kind, _, _ in (*request.sources, *destinations))
    if request.keep or kept:
        raise ValueError(
            "kept values are inputs and outputs of programs of one device, taking them "
            "as their own types"
        )
    arrays = [
        view(loop, where, array_type)
        for where, array_type in zip(request.sources, types, strict=True)
    ]
    arguments = executable.prepare_arguments(arrays)
    layout = OutputLayout.of(request, types, executable.output_types, arena_size)
    try:
        if layout.wheres is not None:
            outputs = [
                view(loop, where, array_type)
                for where, array_type in zip(layout.wheres, executable.output_types,
                                             strict=True)
            ]  # fmt: skip
        else:
            memory: Any = arena
            if layout.fd is not None:
                memory = shm.attach(layout.fd, layout.size, populate=True, keep_fd=True)
            outputs = shm.views(memory, executable.output_types, layout.offsets)
        executable.run_into(arguments, outputs, request.zero_copy)
    except BaseException:
        if layout.fd is not None:
            os.close(layout.fd)
        raise
    return layout


def view(loop: _pjrt.HotLoop, where: places.Where, array_type: ArrayType) -> np.ndarray:
    """A numpy view of an array at a place in a mapped segment (ValueError outside it)."""
    _, segment, offset = where
    memory = loop.segment(segment)
    count, shape = array_type.size, array_type.shape
    return np.frombuffer(memory, array_type.dtype, count, offset).reshape(shape)
