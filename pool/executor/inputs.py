"""A run's inputs, staged in the caller's thread, and the shared memory its task holds.

Staging makes later changes to the caller's arrays never reach the task.
Small inputs go through the worker's arena (copied at submit, or straight
from the caller's arrays when the caller waits, as Pool.run does); large
ones into a shared-memory segment of their own, made here so that the
manager thread never copies much, or into private memory while the pool's
descriptor budget is spent (pool.executor.segments). Two kinds of input are
not copied: a large array that already lies in one of the pool's segments
(a result, or an array of Pool.empty / Pool.asarray: `shared`, its segment
pinned open until the task ends) goes as it is, and a value a worker keeps
(pool.executor.values: `values`) is named by its id. A TaskMemory is changed
only by its own methods: staging (copy_in), copying into the arena or a
segment at dispatch, planning where the outputs go (OutputPlan), and giving
everything back when the task ends.
"""

from __future__ import annotations

import mmap
from typing import Any, NamedTuple

import numpy as np

from pool.executor.segments import Segment, SegmentCache, lease_of
from pool.executor.values import DeviceValue, failure_of
from worker.compile.arguments import types_of
from worker.records import ArrayType
from worker.wire import places, shm

Layout = tuple[tuple[ArrayType, ...], tuple[int, ...], int]
"""Input types, their byte offsets in shared memory, and the size they take."""


class Layouts:
    """The shared-memory layout of each program's declared inputs, computed once per program
    and set of inputs that are not staged (shared arrays and values)."""

    def __init__(self) -> None:
        self._layouts: dict[tuple[str, tuple[int, ...]], Layout] = {}  # by program id, skipped

    def of(
        self, program_id: str, types: tuple[ArrayType, ...], skipped: tuple[int, ...] = ()
    ) -> Layout:
        """The layout of a program's declared input types but those at the `skipped` indices
        (ascending), which are not staged."""
        key = (program_id, skipped)
        layout = self._layouts.get(key)
        if layout is None:
            staged = tuple(t for i, t in enumerate(types) if i not in skipped)
            offsets, size = shm.layout(staged)
            layout = self._layouts[key] = (staged, offsets, size)
        return layout


class OutputLayout(NamedTuple):
    """How a program's outputs lie for the runs that keep the same outputs and stage inputs of
    the same size: computed once (pool.executor.requests), read back by the dispatcher."""

    types: tuple[ArrayType, ...]
    """Every output's type."""
    nbytes: tuple[int, ...]
    """Every output's bytes (what a kept one holds of its worker's device)."""
    placed: tuple[ArrayType, ...]
    """The types of the outputs placed in shared memory (those not kept), in order."""
    offsets: tuple[int, ...]
    """Their byte offsets: in the arena (in_arena) or in an output segment."""
    in_arena: bool
    """Whether they lie in the arena (copied out: they are small), after the inputs."""
    size: int
    """The bytes they take from offset 0 (an output segment's least size)."""


class OutputPlan(NamedTuple):
    """Where a run's outputs go, as its request says, and how the parent reads them back.

    `destinations` give each output's Where, or are None when the parent does
    not know the outputs yet (the worker lays them out: a first run). `kept`
    maps the outputs kept in the worker to their value ids. The others lie
    where `layout` says (None with no destinations): in the arena (copied
    out, they are small) or in the task's output segment
    (TaskMemory.output), which the results view without a copy.
    """

    destinations: tuple[places.Where, ...] | None
    kept: dict[int, int]
    layout: OutputLayout | None
    spare: Segment | None = None
    """With no destinations, the task's copy of its inputs, offered to the worker for the
    outputs (Run.spare): the results view it when the worker put them there."""


def pack(arrays: list[np.ndarray], offsets: tuple[int, ...], size: int) -> bytearray:
    """Copies arrays into private memory laid out as they will be in shared memory."""
    packed = bytearray(size)
    shm.write(packed, arrays, offsets)  # type: ignore[arg-type]
    return packed


class TaskMemory:
    """A run's inputs as staged, and the segments it holds until it is released."""

    __slots__ = (
        "all_types",
        "arrays",
        "base",
        "count",
        "declared_types",
        "held",
        "in_arena",
        "input",
        "made",
        "offsets",
        "output",
        "packed",
        "plan",
        "segments",
        "sent_segments",
        "shared",
        "size",
        "types",
        "values",
        "zero_copy",
    )

    def __init__(self, zero_copy: bool, declared_types: bool) -> None:
        self.types: tuple[ArrayType, ...] = ()  # of the staged inputs (see lay_out)
        self.offsets: tuple[int, ...] = ()  # byte offsets in the arena or the input segment
        self.size = 0
        self.zero_copy = zero_copy
        self.declared_types = declared_types  # the inputs have the program's declared types
        self.count = 0  # inputs in all
        self.all_types: tuple[ArrayType, ...] = ()  # of every input
        self.in_arena = False  # the inputs go through the worker's arena
        self.arrays: list[np.ndarray] | None = None  # the caller's arrays, while it waits (run)
        self.packed: bytearray | None = None  # copied at submit, laid out as in shared memory
        self.input: Segment | None = None  # the segment holding large inputs
        self.output: Segment | None = None  # the segment the outputs go to, if not the arena
        self.segments: SegmentCache | None = None  # where released segments go
        self.shared: dict[int, tuple[Segment, int]] = {}  # input index -> (pinned, offset)
        self.values: dict[int, DeviceValue] = {}  # input index -> the value it is
        self.held: list[object] = []  # the caller's shared arrays: their segments stay theirs
        self.plan: OutputPlan | None = None  # set when the request is built
        self.base = 0  # where its inputs start in the arena (a run sent ahead's own region)
        self.sent_segments: tuple[int, ...] = ()  # the new segments its request brought
        self.made: list[DeviceValue] = []  # the handles of a run sent ahead, until its reply

    @property
    def plain(self) -> bool:
        """Whether every input is staged (none shared, none a value): a hot slot's run."""
        return not self.shared and not self.values

    def share(
        self,
        arrays: list[Any],
        values: dict[int, DeviceValue],
        segments: SegmentCache,
        smallest: int,
    ) -> None:
        """Takes the inputs that are not copied: values, and arrays of more than `smallest`
        bytes that view one of this pool's segments, C-contiguous and 64-byte aligned
        (each segment pinned open, and recorded at once, for release to unpin)."""
        self.segments = segments
        self.values = values
        for index, array in enumerate(arrays):
            if index in values or array.nbytes <= smallest or not array.flags.c_contiguous:
                continue
            lease = lease_of(array)
            if lease is None:
                continue
            offset = array.ctypes.data - lease.address
            if offset % shm.ALIGNMENT or not 0 <= offset <= lease.size - array.nbytes:
                continue
            segments.pin(lease, self.shared, index, offset)

    def skipped(self) -> tuple[int, ...]:
        """The indices of the inputs that are not staged (shared, or values), ascending."""
        if self.plain:
            return ()
        return tuple(sorted(self.shared.keys() | self.values.keys()))

    def lay_out(
        self, arrays: list[Any], layout: Layout | None, declared: tuple[ArrayType, ...] = ()
    ) -> None:
        """Lays the staged inputs out: `layout` is the program's declared one for the inputs
        staged (Layouts.of, computed once), where every input has its `declared` type
        (converted, or a value checked against it); None: from the arrays themselves."""
        self.count = len(arrays)
        if layout is not None:
            self.types, self.offsets, self.size = layout
            self.all_types = declared
            return
        self.all_types = types_of(arrays)  # a value's handle has a dtype and a shape too
        skipped = self.shared.keys() | self.values.keys()
        self.types = tuple(t for i, t in enumerate(self.all_types) if i not in skipped)
        self.offsets, self.size = shm.layout(self.types)

    def place_in_arena(self, base: int) -> None:
        """Its inputs go into the arena from `base` (a run sent ahead of its reply: its own
        region, which no request in flight reads)."""
        self.base = base

    def went_ahead(self, handles: list[DeviceValue]) -> None:
        """Its run went ahead of its reply with these handles: held until the reply (or the
        worker's end) says whether the values were made (DeviceValue.fail)."""
        self.made = handles

    def fail_made(self, error: BaseException, name: str) -> BaseException:
        """Its run went ahead and failed with `error`: its values fail with that, or, when it
        failed for want of a value an earlier run sent ahead failed to make, with that
        run's error (the root, returned), raised wherever they are used."""
        root = failure_of(self.values.values())
        if root is None:
            root = error.with_traceback(None)  # its frames would hold this task
            root.add_note(
                f"Raised where the values {name!r} made are used: it was sent ahead of its "
                "reply (Pool's dispatch_ahead), so its call had returned."
            )
        for value in self.made:
            value.fail(root)
        return root

    def sent(self, segments: tuple[int, ...]) -> None:
        """Its request went, bringing these new segments (sent again if it fails)."""
        self.sent_segments = segments

    def _staged_offsets(self) -> tuple[int, ...]:
        """The staged inputs' byte offsets where they go: in the arena from the request's
        region (place_in_arena), or in the input segment."""
        base = self.base if self.in_arena else 0
        return tuple(offset + base for offset in self.offsets) if base else self.offsets

    def sources(self) -> tuple[places.Where, ...]:
        """Each input's Where: a value's id, a shared input's segment, or where it was
        staged (the arena, or the input segment)."""
        staged = 0 if self.in_arena else self.input.id  # type: ignore[union-attr]
        offsets = iter(self._staged_offsets())
        values, shared = self.values, self.shared
        found: list[places.Where] = []
        for index in range(self.count):
            if index in values:
                found.append((places.VALUE, values[index].id, 0))
            elif index in shared:
                segment, offset = shared[index]
                found.append((places.PLACE, segment.id, offset))
            else:
                found.append((places.PLACE, staged, next(offsets)))
        return tuple(found)

    def used_segments(self) -> list[Segment]:
        """The segments a request names (for the descriptors of those its worker lacks)."""
        used = [segment for segment, _ in self.shared.values()]
        if not self.in_arena and self.input is not None:
            used.append(self.input)
        if self.output is not None and self.output.fd >= 0 and self.output is not self.input:
            used.append(self.output)
        return used

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
        self.segments = segments
        if not self.plain:
            skipped = self.shared.keys() | self.values.keys()
            self.held = [arrays[i] for i in self.shared] + list(self.values.values())
            arrays = [a for i, a in enumerate(arrays) if i not in skipped]
        if size <= arena_limit:
            self.in_arena = True
            if caller_waits:
                self.arrays = arrays
            else:
                self.packed = pack(arrays, offsets, size)
            return
        self.input = Segment()
        if segments.reserve(self.input):
            segments.fill(self.input, size, segments.copier.writer(arrays, offsets))
        else:
            self.packed = pack(arrays, offsets, size)

    def write_to_arena(self, arena: mmap.mmap, views: list[np.ndarray] | None = None) -> None:
        """Copies inputs that go through the arena into it; views are the arena's views of
        them, where the caller has them (the hot path), which copy fastest."""
        base = self.base
        if self.packed is not None:
            memoryview(arena)[base : base + len(self.packed)] = self.packed
        elif self.arrays is not None:
            if views is None:
                shm.write(arena, self.arrays, self._staged_offsets())
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

    def output_segment(
        self, segments: SegmentCache, size: int, past_the_bounds: bool = False
    ) -> Segment | None:
        """A segment of at least `size` bytes for the outputs (SegmentCache.make), held by the
        task from before it holds anything, so that whatever cuts this short, the task's
        release gives it back; None when the bounds leave no room for one (past_the_bounds:
        one is made anyway, and closed once its results are gone)."""
        output = self.output
        if output is not None and output.fd >= 0 and output.capacity >= size:
            return output  # made (or taken from the inputs) for an earlier request of this task
        staged = self.spare()
        if staged is not None and staged.capacity >= size:
            # The outputs overwrite the task's own copy of its inputs: a worker copies
            # outputs out only once the run is over (every device's part: nothing reads
            # an input after), and a task goes to another worker only if this one never
            # began it. One segment a call, not two: a round trip of a numpy array holds
            # 3x its bytes at its peak, not 4x.
            self.output = staged
            return staged
        if output is not None and output is not self.input:
            segments.give(output)
        self.segments = segments
        self.output = output = Segment()
        if segments.make(output, size):
            return output
        if past_the_bounds:
            segments.fill(output, size, lambda _: None)
            return output
        return None

    def spare(self) -> Segment | None:
        """The task's own copy of its inputs (a segment), when the outputs may go over it:
        none went elsewhere yet (see output_segment)."""
        staged = self.input
        if (
            self.output is None
            and staged is not None
            and not self.in_arena
            and self.packed is None
            and staged.fd >= 0
        ):
            return staged
        return None

    def plan_outputs(self, plan: OutputPlan | None, output: Segment | None) -> None:
        """Records where the request being built sends the outputs (None: a HotRun, whose
        outputs are where its slot's are), and the segment it took for them (it goes back
        with the task, unless results adopt it)."""
        self.plan = plan
        if output is not None:
            self.output = output

    def release(self) -> None:
        """Gives the segments back for reuse once the worker is done with them."""
        if self.segments is not None:
            self.segments.give(self.input, self.output)
            if self.shared:  # emptied as unpinned: a second release unpins nothing twice
                self.segments.unpin(self.shared)
        self.arrays = self.packed = None
        self.held = []
        self.made = []
