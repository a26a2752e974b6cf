"""A pool worker's runs of executables the native hot loop cannot run, and their kept values.

The native hot loop (native/hot_loop.cc) runs a PJRT plugin's executables:
hot slots, placed runs, and the values a worker keeps on its device. A
worker on jaxlib's own CPU client (worker.plugin.jaxlib_cpu) serves the same
wire protocol from Python instead (worker.serve.server calls this):

    HotRun      the hot loop maps nothing for it and hands back a HotRun of a slot it
                does not hold: the server runs the slot's arena views (Executable.run_into)
    Run         each input read where its Where says (a view of a mapped segment, or a
                value kept here), each output copied to its place or kept here
                (PythonRuns.run)
    PlacedRun   the same with the places the frame names (PythonRuns.run_at): the
                slot is this side's (Server.placed_here), which the hot loop does not
                hold and so hands back, its segments unmapped
    Put, Fetch  a value copied from shared memory onto the device and kept, or back

The hot loop still maps each request's shared-memory segments (the server's
_apply), and this reads them through its views (placed.view). A run that
keeps every output and reads nothing from shared memory is not awaited, as
jax.jit dispatches a step (the parent sends such PlacedRuns ahead of their
replies): the next run that takes its values waits for them on the device. A run returns
once it no longer reads its inputs: every output is awaited before any is
copied out (an output may go over the inputs' own copy: OutputLayout's
"spare"), and a run whose outputs all stay here is awaited when an input
came from shared memory, which the parent reuses once it has the reply. XLA
never hands back an input's buffer as an output (it copies a parameter that
is returned, unless donated, which nothing here asks for), so a kept output
never views shared memory.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from worker.records import ArrayType
from worker.serve.placed import OutputLayout, view
from worker.wire import places

if TYPE_CHECKING:
    from worker import _pjrt
    from worker.compile.executable import Executable
    from worker.plugin.jaxlib_cpu.client import JaxlibClient
    from worker.wire.protocol import Run


class PythonRuns:
    """The runs and kept values of a worker whose executables run from Python (see the
    module); segments are the hot loop's."""

    def __init__(self, loop: _pjrt.HotLoop) -> None:
        self._loop = loop
        self._values: dict[int, tuple[Any, ArrayType]] = {}  # each value and its type

    @property
    def value_count(self) -> int:
        """How many values are kept here."""
        return len(self._values)

    def holds(self, value_id: int) -> bool:
        """Whether the value is kept here (not in the hot loop)."""
        return value_id in self._values

    def drop(self, value_ids: tuple[int, ...]) -> None:
        """Lets go of values the parent no longer holds (ids not kept here are the hot loop's,
        or gone already)."""
        for value_id in value_ids:
            self._values.pop(value_id, None)

    def _value(self, value_id: int) -> tuple[Any, ArrayType]:
        found = self._values.get(value_id)
        if found is None:
            raise LookupError(f"value {value_id} is not kept in this worker")
        return found

    def put(
        self, value_id: int, client: JaxlibClient, where: places.Where, array_type: ArrayType
    ) -> None:
        """Copies the array at a place onto the client's device and keeps it as value_id."""
        self._values[value_id] = (client.put(view(self._loop, where, array_type)), array_type)

    def fetch(self, value_id: int, client: JaxlibClient, where: places.Where) -> None:
        """Copies a kept value (row-major) to a place in a mapped segment."""
        value, array_type = self._value(value_id)
        view(self._loop, where, array_type)[...] = client.host(value, *array_type)

    def run(
        self,
        request: Run,
        executable: Executable,
        types: tuple[ArrayType, ...],
        layout: OutputLayout,
    ) -> None:
        """Runs a Run of a program of one device: its inputs where request.sources say (in
        their types, the executable's own), its outputs where layout puts them; a "new"
        segment of the layout is mapped meanwhile under an id no parent segment has, and
        its descriptor closed if this fails."""
        temporary = -1 - request.task_id
        try:
            if layout.fd is not None:
                self._loop.map_segments([(temporary, layout.fd, layout.size)])
            self.run_at(request.sources, layout.destinations(temporary), executable, types,
                        request.zero_copy)  # fmt: skip
        except BaseException:
            if layout.fd is not None:
                os.close(layout.fd)
            raise
        finally:
            self._loop.forget_segments([temporary])

    def run_at(
        self,
        sources: tuple[places.Where, ...],
        destinations: list[places.Where],
        executable: Executable,
        types: tuple[ArrayType, ...],
        zero_copy: bool,
    ) -> None:
        """Runs a program of one device on inputs where `sources` say (of `types`, the
        executable's own), each output copied to its place or kept (`destinations`): a Run's,
        or a PlacedRun's, whose segments are mapped already."""
        if len(destinations) != executable.num_outputs:
            raise ValueError(
                f"a run gives {len(destinations)} outputs to a program of {executable.num_outputs}"
            )
        arguments = [
            self._value(where[1])[0] if where[0] == places.VALUE else view(self._loop, where, t)
            for where, t in zip(sources, types, strict=True)
        ]
        native = executable.native
        outputs = native.run_arrays(arguments, zero_copy)
        placed = [i for i, where in enumerate(destinations) if where[0] == places.PLACE]
        if placed or any(where[0] == places.PLACE for where in sources):
            native.client.wait(outputs)  # every output, before any is copied out (the module)
        if placed:
            hosts = native.host(outputs)
            for i in placed:
                place = view(self._loop, destinations[i], executable.output_types[i])
                place[...] = hosts[i]
        for where, value, array_type in zip(destinations, outputs, executable.output_types,
                                            strict=True):  # fmt: skip
            if where[0] == places.VALUE:
                self._values[where[1]] = (value, array_type)
