"""Building the one message that gives a task to the worker claimed for it.

Three kinds of request go to a worker (worker.wire.protocol):

    Compile   compile or load a program, for its ProgramSpec
    Run       run a program (sent with it unless the worker has it loaded), its
              inputs in the worker's arena or in a segment sent along, and a
              recycled segment offered for outputs too large for the arena
    HotRun    a few bytes: run the program in a hot slot the worker gave it, on
              inputs written into the arena where that slot reads them

Requests owns what building them learns: each program's output types, known
from its first reply, which size the output segment offered to later runs.
The caller holds the worker claimed for the task (and so its arena) while a
request is built, and sends it; nothing here sends.
"""

from __future__ import annotations

from pool.executor.segments import SegmentCache
from pool.executor.tasks import Kind, Task
from pool.executor.worker_process import ARENA_SIZE, HotProgram, WorkerProcess
from worker.records import ArrayType
from worker.wire import protocol, shm

Message = protocol.Compile | protocol.Run | protocol.HotRun
"""What a request is on the wire."""


class Requests:
    """Builds tasks' requests; knows each program's output types once a worker said them."""

    def __init__(self, segments: SegmentCache) -> None:
        self._segments = segments  # recycled segments offered to runs for their outputs
        self._output_types: dict[str, tuple[ArrayType, ...]] = {}  # by program id

    def output_types(self, program_id: str) -> tuple[ArrayType, ...]:
        """A program's output types, which an earlier reply gave (KeyError if none did)."""
        return self._output_types[program_id]

    def note_output_types(self, program_id: str, types: tuple[ArrayType, ...]) -> None:
        """Records a program's output types from a reply that gave them."""
        self._output_types[program_id] = types

    def build(self, task: Task, worker: WorkerProcess) -> tuple[Message, tuple[int, ...]]:
        """The message and descriptors that give a task to the worker claimed for it.

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
            )
            return message, ()
        memory = task.memory
        assert memory is not None, "a run is staged before it is claimed"
        hot = _hot_program(worker, task)
        if hot is not None:
            memory.write_to_arena(worker.arena, hot.inputs)
            return protocol.HotRun(request.id, hot.slot, memory.zero_copy), ()
        if memory.output_fd < 0:
            self._offer_output_segment(task)
        in_arena = memory.in_arena
        if in_arena:
            memory.write_to_arena(worker.arena)
        elif memory.packed is not None:
            memory.to_segment()
        include = request.cache_key is None and (
            task.resend_program or request.program_id not in worker.loaded
        )
        output = memory.output
        output_fd = memory.output_fd
        run = protocol.Run(
            request.id,
            request.program_id,
            request.program if include else None,
            request.name,
            None if memory.declared_types else memory.types,
            memory.offsets,
            memory.size,
            memory.zero_copy,
            in_arena=in_arena,
            cache_key=request.cache_key,
            want_output_types=request.program_id not in self._output_types,
            output_capacity=output.capacity if output is not None and output_fd >= 0 else 0,
            compile_options=request.compile_options if include else None,
        )
        fds = () if in_arena else (memory.input.fd,)  # type: ignore[union-attr]
        if output_fd >= 0:
            fds += (output_fd,)
        return run, fds

    def _offer_output_segment(self, task: Task) -> None:
        """Gives a run whose outputs will not fit the arena a recycled segment, if one fits."""
        memory = task.memory
        assert memory is not None
        types = self._output_types.get(task.request.program_id)
        if types is None:
            return  # the first run of a program: its output size is not known yet
        start = shm.aligned(memory.size) if memory.in_arena else 0
        if shm.layout(types, start)[1] <= ARENA_SIZE:
            return
        memory.offer_output(self._segments, shm.layout(types)[1])


def _hot_program(worker: WorkerProcess, task: Task) -> HotProgram | None:
    """The worker's hot slot for a task, if the task can go as a HotRun: a run of a program
    the worker runs by slot, on inputs laid out as that slot's, in the arena."""
    memory = task.memory
    if memory is None or not memory.in_arena or task.resend_program:
        return None
    if memory.output is not None:  # offered a segment for outputs too large for the arena
        return None
    hot = worker.hot.get(task.request.program_id)
    if hot is None or not hot.fits(memory.types, memory.offsets):
        return None
    return hot
