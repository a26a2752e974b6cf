"""What one worker holds of the pool's memory, as the parent mirrors it.

A worker keeps the shared-memory segments it was sent mapped (by id, so that a
segment reused for call after call faults its pages in once), the values runs
kept there (pool.executor.values), and a slot per loaded program for its
placed runs (worker.wire.places.PlacedRun). The parent mirrors each, so that
a request sends a segment's descriptor only the first time, names a slot, and
brings the worker what the parent let go of since its last request:

    forgets   segments the parent closed (evicted from its cache, or past its bounds)
    drops     values whose last handle was garbage, and orphans: values a run or a put
              kept whose handles were never made (its reply failed, or reading it did)

Both go with the worker's next request of any kind, so a worker that gets none
keeps them until it does, or ends. The mirror changes only once a request has
gone (Deliveries, then WorkerMemory.delivered): a request built but never sent
(its caller interrupted) changes nothing, and a request that failed takes its new
segments back (WorkerMemory.failed: the worker may not have mapped them). Only the
thread that holds the worker builds and sends its requests and handles its replies,
so that thread alone changes this record, but for `_dropped`, which the garbage
collector appends to (a deque's append: no Python code runs in the collector, see
pool.executor.segments).
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Iterable
from typing import NamedTuple, Protocol

from pool.errors import WorkerCrashedError
from worker.records import ArrayType


class OpenSegments(Protocol):
    """What the record asks of the pool's segments (pool.executor.segments.SegmentCache)."""

    @property
    def closings(self) -> int:
        """How many segments were closed so far."""
        ...

    def is_open(self, segment_id: int) -> bool:
        """Whether a segment still has its descriptor."""
        ...


class Kept(Protocol):
    """What the record knows of a value's handle (pool.executor.values.DeviceValue)."""

    id: int
    nbytes: int
    """The bytes it holds of the device's memory."""

    @property
    def name(self) -> str:
        """What made it (for errors that name lost values)."""
        ...


LOST_NAMES_SHOWN = 8
"""How many lost values an error names before it says how many more."""

MAX_DELIVERED = 4096
"""The most value drops, and the most segment forgets, one request brings: a PlacedRun
counts them in 16 bits and its frame is at most 1 MiB (worker.wire.protocol); the rest go
with the next requests (the manager sends an idle worker releases until none is left)."""


class Deliveries(NamedTuple):
    """What a request brings its worker: new segments (ids), the number of dropped handles
    and of orphans taken, the value ids of both, and the segments to forget."""

    segments: tuple[int, ...]
    dropped: int
    drops: tuple[int, ...]
    forgets: tuple[int, ...]
    orphaned: int = 0


NOTHING = Deliveries((), 0, (), ())


class WorkerMemory:
    """One worker's segments, values and placed slots, as the parent knows them."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.mapped: set[int] = set()  # segment ids the worker keeps mapped
        # program id -> the slot its PlacedRuns name, and the input types that slot takes
        self.placed: dict[str, tuple[int, tuple[ArrayType, ...]]] = {}
        self._values: dict[weakref.ref[Kept], tuple[int, int]] = {}  # -> (id, nbytes)
        self._dropped: collections.deque[weakref.ref[Kept]] = collections.deque()
        self._orphans: list[int] = []  # ids of kept values no handle was made for
        self.reported_values = -1  # the values the worker said it holds, in its last Fetch reply
        self.value_bytes = 0  # what the worker's kept values take on its device
        self.lost: WorkerCrashedError | None = None  # set when the worker ended
        self._closings = -1  # the segments' closings when forgets were last looked for

    @property
    def value_count(self) -> int:
        """Values the worker holds (dropped ones it has not been told of included)."""
        return len(self._values)

    def keep(self, value: Kept) -> None:
        """Records a value the worker now holds (its handle was just made)."""
        ref = weakref.ref(value, self._dropped.append)
        nbytes = value.nbytes
        self._values[ref] = (value.id, nbytes)
        self.value_bytes += nbytes

    def orphan(self, value_ids: Iterable[int]) -> None:
        """Values the worker may keep that no handle names (the run or put that kept them
        failed after the worker kept them, or reading its reply did): dropped with its next
        request. An id the worker never kept, or one also dropped through its handle, is
        ignored there."""
        self._orphans.extend(value_ids)

    def pending(self, segments: OpenSegments) -> Deliveries:
        """What the worker's next request brings it, besides its new segments: values
        dropped, and the segments it maps that `segments` closed since."""
        dropped = min(len(self._dropped), MAX_DELIVERED)
        orphaned = min(len(self._orphans), MAX_DELIVERED - dropped)
        forgets: tuple[int, ...] = ()
        closings = segments.closings
        if closings != self._closings:  # looked for only when a segment was closed since
            forgets = tuple(i for i in self.mapped if not segments.is_open(i))[:MAX_DELIVERED]
            if not forgets:
                self._closings = closings
        if not dropped and not forgets and not orphaned:
            return NOTHING
        values = self._values
        drops = tuple(values[ref][0] for ref in itertools.islice(self._dropped, dropped))
        return Deliveries((), dropped, drops + tuple(self._orphans[:orphaned]), forgets, orphaned)

    def delivered(self, deliveries: Deliveries) -> None:
        """A request went with these: the worker maps, drops and forgets them now."""
        if deliveries is NOTHING:
            return
        if deliveries.segments:
            self.mapped.update(deliveries.segments)
        if deliveries.forgets:
            self.mapped.difference_update(deliveries.forgets)
        values, dropped = self._values, self._dropped
        freed = 0
        for _ in range(deliveries.dropped):
            freed += values.pop(dropped.popleft())[1]
        self.value_bytes -= freed
        if deliveries.orphaned:
            del self._orphans[: deliveries.orphaned]

    def failed(self, segments: tuple[int, ...]) -> None:
        """A request that brought these new segments failed (in the worker, or reading its
        reply did): the worker may not have mapped them (mmap failed, or their descriptors
        never came), so the next request that names them sends them again. A worker maps a
        segment sent twice again by id, replacing the first."""
        if segments:
            self.mapped.difference_update(segments)

    def note_placed(self, program_id: str, slot: int, types: tuple[ArrayType, ...]) -> None:
        """The worker gave a program a slot for PlacedRuns of inputs of these types."""
        self.placed[program_id] = (slot, types)

    def forget_program(self, program_id: str) -> None:
        """The worker unloaded a program: its slot is gone."""
        self.placed.pop(program_id, None)

    def lose(self, how: str) -> WorkerCrashedError | None:
        """The worker ended: every value it held is lost. Returns the error every call that
        needs one raises (naming them), or None when it held none."""
        alive = [ref() for ref in self._values]
        names = [value.name for value in alive if value is not None]
        self._values.clear()
        self._dropped.clear()
        self._orphans.clear()
        self.value_bytes = 0
        if not names:
            return None
        shown = ", ".join(names[:LOST_NAMES_SHOWN])
        more = len(names) - LOST_NAMES_SHOWN
        if more > 0:
            shown += f" and {more} more"
        self.lost = WorkerCrashedError(
            f"the worker (pid {self.pid}) that held {len(names)} value(s) {how}, and they are "
            f"lost: {shown}. A value lives in its worker's device memory; make it again "
            "(Pool.put, or the run that kept it) on the pool's new worker"
        )
        return self.lost
