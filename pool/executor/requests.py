"""Building the one message that gives a task to the worker claimed for it.

The requests a worker takes (worker.wire.protocol):

    Compile     compile or load a program, for its ProgramSpec
    HotRun      a few bytes: run the program in a hot slot the worker gave it, on
                inputs written into the arena where that slot reads them
    PlacedRun   run a program the worker has loaded, each input and output where the
                frame says: the arena, a shared-memory segment (mapped once per
                worker: a segment's descriptor goes with the first frame that
                names it), or a value the worker keeps
    Run         the full form, for a program's first run in a worker (it loads the
                program, and says the slots of later runs), with the program when the
                worker does not have it
    Put, Fetch  a value: an input to keep on the device, or a kept one to copy out

Every request but a HotRun also brings the worker what the parent let go of
since its last one (pool.executor.worker_memory): values to drop, segments to
forget. The mirror of what the worker holds changes only once the request has
gone (Deliveries, applied by the dispatcher after the send).

Requests owns what building them learns: each program's output types, known
from its first reply, which lay out later runs' outputs (each layout computed
once per program, outputs kept and input size: OutputLayout); and the ids of
kept values. The caller holds the worker claimed for the task (and so its arena)
while a request is built, and sends it; nothing here sends.
"""

from __future__ import annotations

import itertools

from pool.executor.futures import RunOutcome
from pool.executor.inputs import OutputLayout, OutputPlan, TaskMemory
from pool.executor.segments import Segment, SegmentCache
from pool.executor.tasks import Kind, Task, ValueOpKind
from pool.executor.worker_memory import NOTHING, Deliveries
from pool.executor.worker_process import (
    ARENA_OUTPUT_LIMIT,
    ARENA_SIZE,
    HotProgram,
    WorkerProcess,
)
from worker.records import ArrayType, ProgramSpec
from worker.wire import places, protocol, shm

MAX_OUTPUT_LAYOUTS = 4096
"""The most output layouts Requests remembers (one per program, kept outputs and input size
in use); past it they are computed again."""

Message = protocol.Compile | protocol.Run | protocol.HotRun | places.PlacedRun | protocol.Put
"""What a request is on the wire (protocol.Fetch too)."""


class Requests:
    """Builds tasks' requests; knows each program's output types once a worker said them."""

    def __init__(self, segments: SegmentCache) -> None:
        self._segments = segments  # recycled segments the outputs go to
        self._output_types: dict[str, tuple[ArrayType, ...]] = {}  # by program id
        # (program id, kept outputs, where the placed ones start) -> how they lie
        self._layouts: dict[tuple[str, tuple[int, ...], int], OutputLayout] = {}
        self._value_ids = itertools.count(1)  # the ids of kept values, never reused

    def output_types(self, program_id: str) -> tuple[ArrayType, ...]:
        """A program's output types, which an earlier reply gave (KeyError if none did)."""
        return self._output_types[program_id]

    def note_output_types(self, program_id: str, types: tuple[ArrayType, ...]) -> None:
        """Records a program's output types from a reply that gave them."""
        self._output_types[program_id] = types

    def check_keep(
        self, program_id: str, keep: tuple[int, ...], spec: ProgramSpec | None = None
    ) -> tuple[int, ...]:
        """keep= (sorted indices) as given, once checked against the program's outputs where
        they are known (a ProgramSpec's, or an earlier reply's): ValueError, before anything
        is sent, for an index past them. A program's first run is checked by its worker."""
        if not keep:
            return keep
        types = spec.output_types if spec is not None else self._output_types.get(program_id)
        if types is not None and keep[-1] >= len(types):
            raise ValueError(
                f"keep={list(keep)} names outputs the program does not have: it returns "
                f"{len(types)} output(s), indices 0 to {len(types) - 1}"
            )
        return keep

    def build(
        self, task: Task, worker: WorkerProcess
    ) -> tuple[Message | protocol.Fetch, tuple[int, ...], Deliveries]:
        """The message and descriptors that give a task to the worker claimed for it, and
        what the worker holds once it went.

        Small inputs are written into the worker's arena here; large inputs
        staged in private memory (pool.executor.inputs) go into their segment.
        What fails here (no shared memory) fails before anything is sent.
        """
        request = task.request
        if request.kind is Kind.COMPILE:
            assert request.program is not None
            message = protocol.Compile(
                request.id,
                request.program_id,
                request.program,
                request.name,
                request.compile_options,
                request.jax,
            )
            return message, (), NOTHING
        memory = task.memory
        assert memory is not None, "a run is staged before it is claimed"
        pending = worker.memory.pending(self._segments)
        hot = _hot_program(worker, task)
        if hot is not None and pending is NOTHING:
            memory.plan_outputs(None, None)
            memory.write_to_arena(worker.arena, hot.inputs)
            return protocol.HotRun(request.id, hot.slot, memory.zero_copy), (), NOTHING
        if memory.in_arena:
            memory.write_to_arena(worker.arena)
        elif memory.packed is not None:
            memory.to_segment()
        if request.kind is Kind.VALUE:
            return self._value(task, memory, worker, pending)
        destinations = self._plan_outputs(task, memory)
        segments, fds, deliveries = _deliveries(worker, memory, pending)
        include = _brings_program(task, worker)
        sources = memory.sources()
        if destinations is not None:
            slot = _placed_slot(task, worker)
            if slot is not None:
                message: Message = places.PlacedRun(
                    request.id,
                    slot,
                    memory.zero_copy,
                    sources,
                    destinations,
                    segments,
                    deliveries.drops,
                    deliveries.forgets,
                )
                return message, fds, deliveries
        assert memory.plan is not None
        run = protocol.Run(
            request.id,
            request.program_id,
            request.program if include else None,
            request.name,
            None if memory.declared_types else memory.all_types,
            sources,
            destinations,
            memory.zero_copy,
            cache_key=request.cache_key,
            want_output_types=request.program_id not in self._output_types,
            compile_options=request.compile_options if include else None,
            bundle=request.bundle,
            keep=tuple(memory.plan.kept.items()) if destinations is None else (),
            segments=segments,
            drops=deliveries.drops,
            forgets=deliveries.forgets,
            spare=None if (spare := memory.plan.spare) is None else (spare.id, spare.capacity),
        )
        return run, fds, deliveries

    def goes_ahead(self, task: Task, worker: WorkerProcess) -> bool:
        """Whether a claimed run may go ahead of its reply (dispatch_ahead): Pool.run's own
        (whose caller looks at nothing but the handles), keeping every output of a
        program whose outputs are known, as a PlacedRun, with no input in memory the caller
        may change once the call returns (Pool.empty's, Pool.asarray's: shared)."""
        request = task.request
        memory = task.memory
        if (
            request.kind is not Kind.RUN
            or not request.keep
            or memory is None
            or memory.shared
            or type(task.future) is not RunOutcome
        ):
            return False
        types = self._output_types.get(request.program_id)
        return (
            types is not None
            and len(request.keep) == len(types)
            and _placed_slot(task, worker) is not None
        )

    def _plan_outputs(self, task: Task, memory: TaskMemory) -> tuple[places.Where, ...] | None:
        """Where a run's outputs go (see OutputPlan), recorded in its memory; the
        destinations, or None to leave them to the worker (a first run, whose outputs the
        parent does not know yet, or outputs too large for the bounds of kept segments)."""
        request = task.request
        self.check_keep(request.program_id, request.keep)  # the types may be known since
        kept = {index: next(self._value_ids) for index in request.keep}
        start = shm.aligned(memory.size) if memory.in_arena else 0
        layout = self._output_layout(request.program_id, request.keep, start)
        output: Segment | None = None
        segment_id = 0
        if layout is not None and not layout.in_arena:
            output = memory.output_segment(self._segments, layout.size)
            segment_id = 0 if output is None else output.id
        if layout is None or (output is None and not layout.in_arena):
            memory.plan_outputs(OutputPlan(None, kept, None, memory.spare()), None)
            return None
        found = iter(layout.offsets)
        destinations = tuple(
            (places.VALUE, kept[index], 0)
            if index in kept
            else (places.PLACE, segment_id, next(found))
            for index in range(len(layout.types))
        )
        memory.plan_outputs(OutputPlan(destinations, kept, layout), output)
        return destinations

    def _output_layout(
        self, program_id: str, keep: tuple[int, ...], start: int
    ) -> OutputLayout | None:
        """How a program's outputs lie when a run keeps `keep` and its placed outputs go after
        inputs that end at `start` in the arena, or in a segment of their own if they do not
        fit there (None while the outputs are not known): computed once, as every such run's
        outputs lie alike."""
        key = (program_id, keep, start)
        layout = self._layouts.get(key)
        if layout is not None:
            return layout
        types = self._output_types.get(program_id)
        if types is None:
            return None
        nbytes = tuple(t.nbytes for t in types)
        placed = tuple(t for index, t in enumerate(types) if index not in keep)
        offsets, end = shm.layout(placed, start)
        placed_bytes = sum(n for index, n in enumerate(nbytes) if index not in keep)
        in_arena = end <= ARENA_SIZE and placed_bytes <= ARENA_OUTPUT_LIMIT
        if not in_arena:
            offsets, end = shm.layout(placed)
        layout = OutputLayout(types, nbytes, placed, offsets, in_arena, end)
        if len(self._layouts) >= MAX_OUTPUT_LAYOUTS:
            self._layouts.clear()  # programs come and go: the ones in use come back at once
        self._layouts[key] = layout
        return layout

    def _value(
        self, task: Task, memory: TaskMemory, worker: WorkerProcess, pending: Deliveries
    ) -> tuple[protocol.Put | protocol.Fetch, tuple[int, ...], Deliveries]:
        """A VALUE task's request: Put of its staged input, or Fetch of a kept value into the
        arena (small) or a segment the result views."""
        request = task.request
        operation = request.value
        assert operation is not None
        if operation.op is ValueOpKind.PUT:
            value_id = next(self._value_ids)
            memory.plan_outputs(OutputPlan(None, {0: value_id}, None), None)
            segments, fds, deliveries = _deliveries(worker, memory, pending)
            put = protocol.Put(
                request.id,
                value_id,
                memory.sources()[0],
                operation.array_type,
                segments,
                deliveries.drops,
                deliveries.forgets,
            )
            return put, fds, deliveries
        if operation.op is ValueOpKind.RELEASE:
            memory.plan_outputs(OutputPlan(None, {}, None), None)
            segments, fds, deliveries = _deliveries(worker, memory, pending)
            release = protocol.Fetch(
                request.id, -1, (places.PLACE, 0, 0), segments, deliveries.drops,
                deliveries.forgets,
            )  # fmt: skip
            return release, fds, deliveries
        size = operation.array_type.nbytes
        output: Segment | None = None
        where: places.Where = (places.PLACE, 0, 0)
        if size > ARENA_OUTPUT_LIMIT:
            output = memory.output_segment(self._segments, size, past_the_bounds=True)
            assert output is not None
            where = (places.PLACE, output.id, 0)
        array_type = operation.array_type
        layout = OutputLayout((array_type,), (size,), (array_type,), (0,), output is None, size)
        memory.plan_outputs(OutputPlan((where,), {}, layout), output)
        segments, fds, deliveries = _deliveries(worker, memory, pending)
        fetch = protocol.Fetch(
            request.id, operation.value.id, where, segments, deliveries.drops, deliveries.forgets
        )
        return fetch, fds, deliveries


def _deliveries(
    worker: WorkerProcess, memory: TaskMemory, pending: Deliveries
) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...], Deliveries]:
    """The segments a request names that its worker has not mapped ((id, size) and their
    descriptors, sent with it), and everything the request delivers."""
    mapped = worker.memory.mapped
    new: dict[int, Segment] = {}
    for segment in memory.used_segments():
        if segment.id not in mapped:
            new[segment.id] = segment
    if not new and not pending.segments:
        return (), (), pending  # the usual case: every segment named is mapped already
    sizes = tuple((segment.id, segment.capacity) for segment in new.values())
    fds = tuple(segment.fd for segment in new.values())
    return sizes, fds, pending._replace(segments=tuple(new))


def _brings_program(task: Task, worker: WorkerProcess) -> bool:
    """Whether a run's request carries its program: the worker has not loaded it (or had
    unloaded it), and no cache key lets the worker load it itself."""
    request = task.request
    return request.cache_key is None and (
        task.resend_program or request.program_id not in worker.loaded
    )


def _placed_slot(task: Task, worker: WorkerProcess) -> int | None:
    """The slot a run goes to as a PlacedRun (worker.wire.places), or None when it goes as a
    Run: the program's first run in the worker (or one that sends it again), or inputs of
    other types than the slot takes."""
    request = task.request
    memory = task.memory
    assert memory is not None
    placed = worker.memory.placed.get(request.program_id)
    if placed is None or _brings_program(task, worker):
        return None
    slot, types = placed
    return slot if types == memory.all_types else None


def _hot_program(worker: WorkerProcess, task: Task) -> HotProgram | None:
    """The worker's hot slot for a task, if the task can go as a HotRun: a run of a program
    the worker runs by slot, on inputs laid out as that slot's, in the arena, none shared
    or a value, keeping no output (a program has a hot slot only if its outputs are small
    enough to copy out: WorkerProcess.note_hot)."""
    memory = task.memory
    if memory is None or not memory.in_arena or task.resend_program:
        return None
    request = task.request
    if request.keep or memory.shared or memory.values or request.kind is not Kind.RUN:
        return None
    hot = worker.hot.get(request.program_id)
    if hot is None or not hot.fits(memory.types, memory.offsets):
        return None
    return hot
