"""Shared-memory segments in the parent: mapping, recycling, and bounds on what is kept.

A new memfd's pages are allocated and zeroed one 4 KiB fault at a time
(shared memory gets no transparent huge pages), which for a 64 MiB output
costs several times the copy itself, and even a mapping of pages that exist
faults each one in again. So the parent keeps the segments of large inputs
and outputs once nothing uses them any more (an input segment when its task
is done, an output segment when the numpy arrays viewing it are garbage) and
hands them to later tasks, each with its mapping (Segment.mapping): a
segment is mapped once in this process, as in each worker that uses it
(native/segments.cc; it is named to them by its id), so a loop of calls
faults no page in. What it keeps unused is bounded in bytes (`max_bytes`),
the longest unused closed first (a loop of calls gives back last the
segments it reuses); segments in use, by tasks or live results, are the
caller's memory and count only against the descriptor bound.

The arrays of a result (or of Pool.empty) view the segment through a
SegmentLease: numpy keeps the lease as their base, so the lease dies with
the last of them, and its weak reference brings the segment back. While the
lease lives the segment keeps its descriptor, so that the arrays can be
passed to a worker as they are (pin, for the task that does, unpin after).

Every kept descriptor counts against a second bound, `max_fds`: segments
waiting for reuse, segments of queued tasks' inputs and segments that live
results view. Only segments of tasks in flight (at most two per worker) are
outside it, so a pool's descriptors are bounded by its workers and this
number, never by how many tasks are queued or results kept. A result past
the bound still views its memory, through a mapping that holds no
descriptor; it is just not recycled.

A Ctrl-C can land between any two steps. CPython handles a signal (raising
KeyboardInterrupt) at a function's entry, right after a call into C (or
into Python through C) returns, and at a loop's backward jump; not where a
Python function returns, nor between plain loads and stores. So:

- A mapping belongs to an mmap object from the moment it exists
  (map_segment): the object holds an address range first and the segment
  is mapped over it, so dropping the object at any point unmaps it, in C.
- A descriptor outside the cache lives in a Segment, and moves between a
  Segment and the cache by plain stores with no call between taking it and
  recording it (take, give, adopt). It is closed with os.closerange(fd,
  fd + 1), which never raises, so that no try (and so no call) comes
  between letting go of it and closing it. It is always in exactly one
  place; a task's Segments go back when the task is released, whatever cut
  it short.
- A result's segment comes back through a weak reference to its lease whose
  callback is a deque's append, so freeing the arrays runs no Python code:
  nothing an interrupt could cut short, nothing that could run inside this
  cache's lock (the cyclic garbage collector frees at any allocation). The
  next locked call takes the returned segments in.

What remains: a signal handled right as recvmsg returns loses the
descriptors of that reply (worker.wire.protocol.recv_frame). A new segment's
descriptor is found again by its name (worker.wire.shm.new_segment). A
signal between closing a descriptor and forgetting its id (_forget_locked)
leaves a worker a mapping it is never told to drop (freed when the worker
ends); one
pin records what it pins as it pins it.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pool.executor.copier import STREAM_BYTES, Copier
from worker.records import ArrayType
from worker.wire import shm

_MAP_FIXED = 0x10  # Linux; the mmap module does not export it

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]

_never_unmapped: list[mmap.mmap] = []
"""Address ranges a failed mapping may have given up (see map_segment): kept, never unmapped."""


def map_segment(fd: int, size: int, populate: bool = False) -> mmap.mmap:
    """Maps `size` bytes of a segment, shared; the mapping holds no descriptor.

    (mmap.mmap(fd) keeps a duplicate of the descriptor for its whole life,
    which made every live result cost two.) An anonymous mmap of the right
    size is made first and the segment is mapped over it (MAP_FIXED), so
    the returned object owns the mapping from its first moment and unmaps
    it when it is garbage: numpy arrays view it and keep it alive.
    populate faults every page in at once, for a segment about to be
    written whole.
    """
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    flags = mmap.MAP_SHARED | _MAP_FIXED | (mmap.MAP_POPULATE if populate else 0)
    if _libc.mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0) != address:
        code = ctypes.get_errno()
        # A MAP_FIXED that fails may have unmapped the range already, and
        # another thread may have been given it since: unmapping it now
        # could take that thread's memory. The range is kept instead.
        _never_unmapped.append(mapping)
        raise OSError(code, f"mapping a shared-memory segment failed: {os.strerror(code)}")
    return mapping


PAGE = mmap.PAGESIZE

_SEGMENT_IDS = itertools.count(1)
"""Segment ids, one count for the whole process (next() on it is atomic under the GIL): two
pools' segments never share an id, so a worker can never be named one pool's segment by an id
that is another's."""


def page_rounded(size: int) -> int:
    """A segment's capacity for `size` bytes: whole pages (a worker registers whole segments
    with the plugin for direct transfers, PJRT_Client_DmaMap, which takes pages)."""
    return max(PAGE, -(-size // PAGE) * PAGE)


class Segment:
    """A segment's descriptor outside the cache (a task's input or output), if any.

    fd is -1 when there is none. capacity stays 0 until the segment has its
    size, so one given back before then is closed, never kept. lent says
    whether the cache counts it against max_fds. The cache moves
    descriptors in and out with plain stores (see the module docstring).
    id names the segment to the workers (0 until it has one), which map it
    once and keep it mapped, as this process keeps `mapping`: a segment
    reused for call after call faults its pages in once on both sides.
    """

    __slots__ = ("capacity", "fd", "freed", "id", "lent", "mapping", "pins")

    def __init__(self) -> None:
        self.fd = -1
        self.capacity = 0
        self.lent = False
        self.id = 0
        self.mapping: mmap.mmap | None = None
        self.pins = 0  # tasks passing a result's segment to a worker: it stays open meanwhile
        self.freed = 0  # when it was last given back (the cache's clock): the oldest goes first

    def mapped(self, populate: bool = False) -> mmap.mmap:
        """The segment's mapping in this process, made on first use (populate: every page
        mapped at once, for a segment about to be written whole)."""
        mapping = self.mapping
        if mapping is None:
            mapping = self.mapping = map_segment(self.fd, self.capacity, populate)
        return mapping


class SegmentLease:
    """What the arrays of one result (or one Pool.empty array) view: a segment's mapping.

    numpy reads __array_interface__, and an array made from it keeps the
    lease as its base, as every view of that array does: when the last one
    is garbage, the lease is, and the cache takes the segment back (see
    SegmentCache.adopt). The lease holds the mapping, which is never closed,
    only dropped, so the memory lives as long as any array views it.
    """

    __slots__ = (
        "__array_interface__",
        "__weakref__",
        "_mapping",
        "address",
        "cache",
        "segment",
        "size",
    )

    def __init__(self, segment: Segment, mapping: mmap.mmap, cache: SegmentCache) -> None:
        self.segment = segment
        self.cache = cache  # the pool's cache that made it: only that pool passes it as it is
        self._mapping = mapping
        self.size = segment.capacity
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        self.__array_interface__ = {
            "shape": (self.size,),
            "typestr": "|u1",
            "data": (self.address, False),
            "version": 3,
        }

    def views(self, types: Sequence[ArrayType], offsets: Sequence[int]) -> list[np.ndarray]:
        """Numpy arrays of these types at these offsets, viewing the lease."""
        memory = np.asarray(self)
        return [
            memory[offset : offset + t.nbytes].view(t.dtype).reshape(t.shape)
            if t.size
            else np.empty(t.shape, t.dtype)
            for t, offset in zip(types, offsets, strict=True)
        ]


def lease_of(array: np.ndarray) -> SegmentLease | None:
    """The lease an array views, if it views one (its base, or its base's base, ...)."""
    base: Any = array
    for _ in range(8):  # numpy collapses views' bases; a few steps reach the owner
        base = getattr(base, "base", None)
        if base is None or type(base) is SegmentLease:
            return base
    return None


class SegmentCache:
    """Unused memfd segments, best fit first, within two bounds; the segments results view.

    `_lent` counts kept descriptors in use (reserved or taken by Segments,
    viewed by live results); `_free` holds the ones waiting for reuse, as
    (capacity, id, Segment); their sum never exceeds max_fds. `_bytes` (free)
    never exceeds max_bytes: segments in use (by tasks, or viewed by live
    results) are the caller's memory, not the cache's. `_open` holds the ids
    of every segment whose descriptor is still open: a worker that maps one no
    longer open is told to forget it.
    """

    def __init__(self, max_bytes: int, max_fds: int, stream_bytes: int = STREAM_BYTES) -> None:
        self.max_bytes = max_bytes
        self.max_fds = max_fds
        self._free: list[tuple[int, int, Segment]] = []  # sorted
        self._bytes = 0
        self._lent = 0
        # Segments live leases view: each comes back when its lease is gone.
        self._adopted: dict[weakref.ref[SegmentLease], Segment] = {}
        self._returned: collections.deque[weakref.ref[SegmentLease]] = collections.deque()
        self._clock = itertools.count(1)  # stamps segments as they come back (Segment.freed)
        self._open: set[int] = set()
        self.closings = 0  # segments closed so far: workers look for ones to forget when it grows
        self._closed = False
        self._lock = threading.Lock()
        # Fills segments with callers' arrays; ends with the cache.
        self.copier = Copier(stream_bytes=stream_bytes)

    @property
    def held(self) -> int:
        """Descriptors counted against max_fds now."""
        with self._lock:
            self._take_returned_locked()
            return self._lent + len(self._free)

    @property
    def lent(self) -> int:
        """Descriptors in use now (reserved or taken by tasks, viewed by live results)."""
        with self._lock:
            self._take_returned_locked()
            return self._lent

    def collect(self) -> None:
        """Takes in the segments of results that are gone (the manager thread calls this each
        turn, so that one not kept for reuse is closed, and its memory freed, soon after its
        arrays are gone, not only at the next call that takes the lock)."""
        if self._returned:
            with self._lock:
                self._take_returned_locked()

    def is_open(self, segment_id: int) -> bool:
        """Whether the segment of that id still has its descriptor (a worker may keep it
        mapped); a plain read of a set, safe without the lock."""
        return segment_id in self._open

    def reserve(self, segment: Segment) -> bool:
        """Counts one more kept descriptor, for `segment`; False when the bound is reached."""
        with self._lock:
            self._take_returned_locked()
            if self._closed or not self._make_room_locked(0, descriptor=True):
                return False
            self._lent += 1
            segment.lent = True
            return True

    def take(self, segment: Segment, size: int) -> None:
        """Puts a kept segment of at least `size` bytes into `segment` (empty), if one fits.

        It counts as lent until it is given back. Segments more than twice
        the size stay for tasks they fit better.
        """
        with self._lock:
            self._take_returned_locked()
            index = bisect.bisect_left(self._free, (size, -1))
            if index == len(self._free) or self._free[index][0] > 2 * size:
                return
            capacity, _, kept = self._free[index]
            # No call from here to the last store: the descriptor moves at once.
            del self._free[index]
            self._bytes -= capacity
            if not segment.lent:
                self._lent += 1
            segment.fd, segment.capacity, segment.lent = kept.fd, capacity, True
            segment.id, segment.mapping = kept.id, kept.mapping

    def make(self, segment: Segment, size: int) -> bool:
        """Puts a kept segment of at least `size` bytes into `segment` (empty), or a new one;
        False (and `segment` empty) when one that size could never be kept for reuse (past
        max_bytes) or the descriptor bound leaves no room: a worker makes the outputs'
        segment then, which goes with its results."""
        self.take(segment, size)
        if segment.fd >= 0:
            return True
        with self._lock:
            self._take_returned_locked()
            if page_rounded(size) > self.max_bytes:
                return False
            room = not self._closed and self._make_room_locked(0, descriptor=not segment.lent)
            if not room:
                return False
            if not segment.lent:
                self._lent += 1
                segment.lent = True
        self._new(segment, size)
        return True

    def fill(self, segment: Segment, size: int, write: Callable[[Any], None]) -> None:
        """Puts a segment of at least `size` bytes that `write` filled into `segment`.

        A kept segment is reused when one fits; otherwise a new one is made.
        Whatever cuts this short, the descriptor is in `segment`, for its
        owner to give back (a partly written one is written again if the
        caller tries again).
        """
        if segment.fd < 0:
            self.take(segment, size)
        if segment.fd < 0:
            self._new(segment, size)
        write(segment.mapped(populate=True))

    def _new(self, segment: Segment, size: int) -> None:
        """Makes a new segment of at least `size` bytes into `segment` (empty)."""
        segment.capacity = 0  # not sized yet (see Segment)
        segment.mapping = None
        segment.fd = shm.new_segment(page_rounded(size), "pjrt-pool-segment")
        segment.id = next(_SEGMENT_IDS)
        self._open.add(segment.id)
        segment.capacity = page_rounded(size)

    def identify(self, segment: Segment) -> None:
        """Gives a segment a worker made (a reply's outputs), whose descriptor `segment`
        holds, the id workers will know it by."""
        segment.id = next(_SEGMENT_IDS)
        self._open.add(segment.id)

    def adopt_received(self, fds: list[int], size: int) -> SegmentLease:
        """Takes over the segment of `size` bytes a worker made and sent, the first of `fds`
        (removed from them: the segment holds it from then on), as adopt does."""
        segment = Segment()
        segment.capacity = size
        segment.fd = fds[0]
        del fds[0]  # the segment holds it now (no call since the line above)
        self.identify(segment)
        try:
            return self.adopt(segment)
        except BaseException:
            self.give(segment)
            raise

    def give(self, *segments: Segment | None) -> None:
        """Takes back segments nothing uses any more: each is kept for reuse, or closed."""
        with self._lock:
            self._take_returned_locked()
            for segment in segments:
                if segment is not None:
                    self._give_locked(segment)

    def _give_locked(self, segment: Segment) -> None:
        kept = Segment()  # made, and stamped, before the descriptor moves (see below)
        kept.freed = next(self._clock)
        fd, capacity, lent = segment.fd, segment.capacity, segment.lent
        keep = (
            fd >= 0
            and capacity > 0
            and not self._closed
            and self._lent - lent + len(self._free) < self.max_fds
            and capacity <= self.max_bytes
        )
        # No call from here to the insort or the close: the descriptor moves at once.
        segment.fd, segment.lent = -1, False
        if lent:
            self._lent -= 1
        if fd < 0:
            return
        if not keep:
            os.closerange(fd, fd + 1)
            self._forget_locked(segment)
            return
        kept.fd, kept.capacity, kept.id, kept.mapping = fd, capacity, segment.id, segment.mapping
        self._bytes += capacity
        bisect.insort(self._free, (capacity, segment.id, kept))
        self._make_room_locked(0, descriptor=False)

    def adopt(self, segment: Segment) -> SegmentLease:
        """Takes over a segment whose outputs the caller's arrays are to view; returns the
        lease they view it through.

        While the lease lives the segment keeps its descriptor (so that the
        arrays can be passed to a worker as they are), if the descriptor bound
        leaves room; once it is garbage the segment comes back for reuse (see
        the module docstring), the longest unused segments closed to keep
        within max_bytes (one larger than that is closed at once, its memory
        going with the arrays). One with no descriptor room is closed now: the
        lease alone keeps its memory.
        """
        lease = SegmentLease(segment, segment.mapped(), self)
        ref = weakref.ref(lease, self._returned.append)
        hash(ref)  # now, while the lease lives: a dead weak reference has no hash to look up
        kept = Segment()  # before the descriptor moves
        with self._lock:
            self._take_returned_locked()
            fd, capacity, lent = segment.fd, segment.capacity, segment.lent
            usable = fd >= 0 and capacity > 0 and not self._closed
            opened = usable and self._make_room_locked(0, descriptor=not lent)
            # No call from here to the last store or the close.
            segment.fd, segment.lent = -1, False
            if opened:
                kept.fd, kept.capacity, kept.id = fd, capacity, segment.id
                # One too large to keep goes when its lease does: only the lease maps it.
                kept.mapping = segment.mapping if capacity <= self.max_bytes else None
                lease.segment = kept
                self._adopted[ref] = kept
                if not lent:
                    self._lent += 1
                return lease
            if lent:
                self._lent -= 1
            if fd >= 0:
                os.closerange(fd, fd + 1)
                self._forget_locked(segment)
        return lease

    def pin(
        self,
        lease: SegmentLease,
        into: dict[int, tuple[Segment, int]],
        index: int,
        offset: int,
    ) -> bool:
        """Pins the segment of a live lease of this cache open for a task that passes it to
        a worker (unpin gives it back), recording it as into[index] = (segment, offset) in
        the same breath (plain stores: no signal between pinning and recording); False
        when it cannot be passed: another pool's (its segment id names nothing, or another
        segment, in this pool's workers), or one whose descriptor was closed."""
        if lease.cache is not self:
            return False
        with self._lock:
            segment = lease.segment
            if segment.fd < 0 or segment.id not in self._open:
                return False
            segment.pins += 1
            into[index] = (segment, offset)
            return True

    def unpin(self, pinned: dict[int, tuple[Segment, int]]) -> None:
        """A task is done with the segments it pinned (the records pin made); one the cache
        closed meanwhile goes now.

        Each pin is undone and its record removed in the same breath (plain
        stores: no signal between), so that a Ctrl-C anywhere in here leaves
        the records not yet undone for the task's next release, and none twice.
        """
        with self._lock:
            for index in list(pinned):
                segment = pinned[index][0]
                segment.pins -= 1
                del pinned[index]
                fd = segment.fd
                if self._closed and segment.pins == 0 and fd >= 0:
                    segment.fd = -1
                    os.closerange(fd, fd + 1)
                    self._forget_locked(segment)

    def _forget_locked(self, segment: Segment) -> None:
        """A segment's descriptor was closed (os.closerange, right where it was let go of:
        see the module docstring): it is no longer open, and its mapping goes with the
        last array viewing it."""
        segment.fd = -1
        self._open.discard(segment.id)
        self.closings += 1
        segment.mapping = None

    def _make_room_locked(self, size: int, descriptor: bool) -> bool:
        """Whether `size` more bytes (and, with `descriptor`, one more descriptor) fit the
        bounds, closing unused segments, the longest unused first (the one a loop of calls
        reuses was given back last), to make room; none is closed when closing them all
        would not be enough."""
        if size > self.max_bytes:
            return False
        if descriptor and self._lent >= self.max_fds:
            return False
        while self._bytes + size > self.max_bytes or (
            descriptor and self._lent + len(self._free) >= self.max_fds
        ):
            oldest = min(range(len(self._free)), key=lambda i: self._free[i][2].freed)
            capacity, _, kept = self._free[oldest]
            # No call from here to the close.
            del self._free[oldest]
            self._bytes -= capacity
            os.closerange(kept.fd, kept.fd + 1)
            self._forget_locked(kept)
        return True

    def _take_returned_locked(self) -> None:
        """Takes in the segments of results that are gone (see adopt): kept for reuse, or
        closed."""
        while self._returned:
            ref = self._returned[0]
            kept = self._adopted.get(ref)
            if kept is not None:
                kept.freed = next(self._clock)
                # No call from here to the insort or the close: the descriptor moves at once.
                del self._adopted[ref]
                self._lent -= 1
                if kept.capacity <= self.max_bytes:
                    self._bytes += kept.capacity
                    bisect.insort(self._free, (kept.capacity, kept.id, kept))
                    self._make_room_locked(0, descriptor=False)  # the oldest go first
                else:
                    os.closerange(kept.fd, kept.fd + 1)
                    self._forget_locked(kept)
            self._returned.popleft()

    def close(self) -> None:
        """Closes every segment the cache holds; those given back later are closed at once.

        Results still alive keep their memory through their mappings.
        """
        self.copier.close()
        with self._lock:
            self._closed = True
            held = [kept for _, _, kept in self._free] + list(self._adopted.values())
            self._free, self._bytes = [], 0
            self._adopted = {}
            self._returned.clear()
            for kept in held:
                if not kept.pins:  # else its task's unpin closes it
                    os.closerange(kept.fd, kept.fd + 1)
                    self._forget_locked(kept)
