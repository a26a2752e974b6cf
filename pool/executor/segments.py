"""Shared-memory segments in the parent: mapping, recycling, and bounds on what is kept.

A new memfd's pages are allocated and zeroed one 4 KiB fault at a time
(shared memory gets no transparent huge pages), which for a 64 MiB output
costs several times the copy itself. So the parent keeps the segments of
large inputs and outputs once nothing uses them any more (an input segment
when its task is done, an output segment when the numpy arrays viewing it
are garbage) and hands them to later tasks. What it keeps, or will get
back from live results, is bounded in bytes (`max_bytes`): a result's
segment past that bound is not kept, and its memory goes with its arrays.

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
- A result's segment comes back through a weak reference whose callback is
  a deque's append, so freeing the arrays runs no Python code: nothing an
  interrupt could cut short, nothing that could run inside this cache's
  lock (the cyclic garbage collector frees at any allocation). The next
  locked call takes the returned segments in.

What remains: a signal handled right as recvmsg returns loses the
descriptors of that reply (worker.wire.protocol.recv_frame). A new segment's
descriptor is found again by its name (worker.wire.shm.new_segment).
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

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


class Segment:
    """A segment's descriptor outside the cache (a task's input or output), if any.

    fd is -1 when there is none. capacity stays 0 until the segment has its
    size, so one given back before then is closed, never kept. lent says
    whether the cache counts it against max_fds. The cache moves
    descriptors in and out with plain stores (see the module docstring).
    """

    __slots__ = ("capacity", "fd", "lent")

    def __init__(self) -> None:
        self.fd = -1
        self.capacity = 0
        self.lent = False


class SegmentCache:
    """Unused memfd segments (capacity, descriptor), best fit first, within two bounds.

    `_lent` counts kept descriptors in use (reserved or taken by Segments,
    viewed by live results); `_free` holds the ones waiting for reuse; their
    sum never exceeds max_fds. `_bytes` (free) plus `_adopted_bytes` (viewed
    by live results, to come back) never exceeds max_bytes.
    """

    def __init__(self, max_bytes: int, max_fds: int) -> None:
        self.max_bytes = max_bytes
        self.max_fds = max_fds
        self._free: list[tuple[int, int]] = []  # (capacity, fd), sorted
        self._bytes = 0
        self._lent = 0
        self._adopted: dict[weakref.ref[mmap.mmap], tuple[int, int]] = {}  # (capacity, fd)
        self._adopted_bytes = 0
        self._returned: collections.deque[weakref.ref[mmap.mmap]] = collections.deque()
        self._closed = False
        self._lock = threading.Lock()

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
            capacity, fd = self._free[index]
            # No call from here to the last store: the descriptor moves at once.
            del self._free[index]
            self._bytes -= capacity
            if not segment.lent:
                self._lent += 1
            segment.fd, segment.capacity, segment.lent = fd, capacity, True

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
            segment.capacity = 0  # not sized yet (see Segment)
            segment.fd = shm.new_segment(size, "pjrt-pool-segment")
            segment.capacity = size
        write(map_segment(segment.fd, segment.capacity, populate=True))

    def give(self, *segments: Segment | None) -> None:
        """Takes back segments nothing uses any more: each is kept for reuse, or closed."""
        with self._lock:
            self._take_returned_locked()
            for segment in segments:
                if segment is not None:
                    self._give_locked(segment)

    def _give_locked(self, segment: Segment) -> None:
        fd, capacity, lent = segment.fd, segment.capacity, segment.lent
        keep = (
            fd >= 0
            and capacity > 0
            and not self._closed
            and self._lent - lent + len(self._free) < self.max_fds
            and capacity + self._adopted_bytes <= self.max_bytes
        )
        # No call from here to the insort or the close: the descriptor moves at once.
        segment.fd, segment.lent = -1, False
        if lent:
            self._lent -= 1
        if fd < 0:
            return
        if not keep:
            os.closerange(fd, fd + 1)
            return
        self._bytes += capacity
        bisect.insort(self._free, (capacity, fd))
        self._make_room_locked(0, descriptor=False)

    def adopt(self, segment: Segment, mapping: mmap.mmap) -> None:
        """Takes over a segment that live result arrays view through `mapping`.

        The segment comes back for reuse when the mapping is garbage (see the
        module docstring). One the bounds leave no room for, even after
        closing unused segments, is closed now: the mapping alone keeps its
        memory, which goes with the arrays.
        """
        ref = weakref.ref(mapping, self._returned.append)
        with self._lock:
            self._take_returned_locked()
            fd, capacity, lent = segment.fd, segment.capacity, segment.lent
            room = (
                fd >= 0
                and capacity > 0
                and not self._closed
                and self._make_room_locked(capacity, descriptor=not lent)
            )
            # No call from here to the last store or the close.
            segment.fd, segment.lent = -1, False
            if room:
                self._adopted[ref] = (capacity, fd)
                self._adopted_bytes += capacity
                if not lent:
                    self._lent += 1
                return
            if lent:
                self._lent -= 1
            if fd >= 0:
                os.closerange(fd, fd + 1)

    def _make_room_locked(self, size: int, descriptor: bool) -> bool:
        """Whether `size` more bytes (and, with `descriptor`, one more descriptor) fit the
        bounds, closing unused segments, largest first, to make room; none is closed
        when closing them all would not be enough."""
        if size + self._adopted_bytes > self.max_bytes:
            return False
        if descriptor and self._lent >= self.max_fds:
            return False
        while self._bytes + self._adopted_bytes + size > self.max_bytes or (
            descriptor and self._lent + len(self._free) >= self.max_fds
        ):
            capacity, fd = self._free[-1]
            del self._free[-1]
            self._bytes -= capacity
            os.closerange(fd, fd + 1)
        return True

    def _take_returned_locked(self) -> None:
        """Takes in the segments of results that are gone (see adopt): kept for reuse."""
        while self._returned:
            ref = self._returned[0]
            entry = self._adopted.get(ref)
            if entry is not None:
                # No call from here to the insort: the descriptor moves at once.
                # adopt kept room for it, so it fits the byte bound.
                del self._adopted[ref]
                self._adopted_bytes -= entry[0]
                self._lent -= 1
                self._bytes += entry[0]
                bisect.insort(self._free, entry)
            self._returned.popleft()

    def close(self) -> None:
        """Closes every segment the cache holds; those given back later are closed at once.

        Results still alive keep their memory through their mappings.
        """
        with self._lock:
            self._closed = True
            held = self._free + list(self._adopted.values())
            self._free, self._bytes = [], 0
            self._adopted, self._adopted_bytes = {}, 0
            self._returned.clear()
        for _, fd in held:
            os.closerange(fd, fd + 1)


def writer(arrays: list[np.ndarray], offsets: tuple[int, ...]) -> Callable[[Any], None]:
    """Returns a function that copies arrays into a segment at their offsets."""
    return lambda memory: shm.write(memory, arrays, offsets)
