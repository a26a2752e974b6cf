"""Shared-memory segments in the parent: recycling them, and a bound on their descriptors.

A new memfd's pages are allocated and zeroed one 4 KiB fault at a time
(shared memory gets no transparent huge pages), which for a 64 MiB output
costs several times the copy itself. So the parent keeps the segments of
large inputs and outputs once nothing uses them any more (an input segment
when its task is done, an output segment when the numpy arrays viewing it
are garbage) and hands them to later tasks, up to a bound in bytes. The
pages of a kept segment stay allocated: that bound is memory the pool holds.

Every kept descriptor counts against a second bound, `max_fds`: segments
waiting for reuse, segments of queued tasks' inputs and segments that live
results view. Only segments of tasks in flight (at most two per worker) are
outside it, so a pool's descriptors are bounded by its workers and this
number, never by how many tasks are queued or results kept. A result past
the bound still views its memory, through a mapping that holds no
descriptor; it is just not recycled.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from worker import shm

DEFAULT_CACHE_BYTES = 512 << 20
"""How many bytes of unused segments a pool keeps for reuse."""

DEFAULT_MAX_FDS = 64
"""How many segment descriptors a pool keeps beyond those of tasks in flight."""

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
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class Mapping:
    """A shared mapping of a segment that, unlike mmap.mmap, holds no descriptor.

    (mmap.mmap keeps a duplicate of the descriptor for its whole life, which
    made every live result cost two.) numpy arrays view it through
    ``as_array``; it is unmapped when the last of them is garbage.
    """

    def __init__(self, fd: int, size: int, populate: bool = False) -> None:
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if address in (None, _MAP_FAILED):
            code = ctypes.get_errno()
            raise OSError(code, f"mapping a shared-memory segment failed: {os.strerror(code)}")
        self.size = size
        self.__array_interface__ = {
            "data": (address, False),
            "shape": (size,),
            "typestr": "|u1",
            "version": 3,
        }
        # Not at exit: arrays still referenced then (by an atexit handler, a
        # daemon thread) must stay readable; the process's end unmaps anyway.
        weakref.finalize(self, _libc.munmap, address, size).atexit = False

    def as_array(self) -> np.ndarray:
        """The mapping as a uint8 array (which keeps the mapping alive)."""
        return np.asarray(self)


class SegmentCache:
    """Unused memfd segments (descriptor, capacity), best fit first, within two bounds.

    `lent` counts kept descriptors in use (queued inputs, live results,
    segments taken from here); `free` holds the ones waiting for reuse.
    Their sum never exceeds max_fds.

    A result's segment comes back from a finalizer, which can run in any
    thread at any allocation (the cyclic garbage collector), even inside
    this cache's own lock: so finalizers only append to `_returned`, a
    deque (append is atomic), and the next locked call takes them in.
    """

    def __init__(
        self, max_bytes: int = DEFAULT_CACHE_BYTES, max_fds: int = DEFAULT_MAX_FDS
    ) -> None:
        self.max_bytes = max_bytes
        self.max_fds = max_fds
        self._free: list[tuple[int, int]] = []  # (capacity, fd), sorted
        self._bytes = 0
        self._lent = 0
        self._closed = False
        self._returned: collections.deque[tuple[int, int, bool]] = collections.deque()
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Descriptors counted against max_fds now."""
        with self._lock:
            self._take_returned_locked()
            return self._lent + len(self._free)

    def try_lend(self) -> bool:
        """Reserves room for one more kept descriptor; False when the bound is reached."""
        with self._lock:
            self._take_returned_locked()
            if self._closed or self._lent + len(self._free) >= self.max_fds:
                if self._free and not self._closed:
                    # Make room by closing the largest unused segment.
                    capacity, fd = self._free.pop()
                    self._bytes -= capacity
                    _close(fd)
                else:
                    return False
            self._lent += 1
            return True

    def unlend(self) -> None:
        """Returns a reservation of try_lend that was not used."""
        with self._lock:
            self._lent -= 1

    def take(self, size: int) -> tuple[int, int] | None:
        """Returns (fd, capacity) of a kept segment of at least `size` bytes, or None.

        The segment counts as lent until it is given back. Segments more than
        twice the size stay for tasks they fit better.
        """
        with self._lock:
            self._take_returned_locked()
            index = bisect.bisect_left(self._free, (size, -1))
            if index == len(self._free) or self._free[index][0] > 2 * size:
                return None
            capacity, fd = self._free.pop(index)
            self._bytes -= capacity
            self._lent += 1
            return fd, capacity

    def give(self, fd: int, capacity: int, lent: bool = True) -> None:
        """Takes back a segment nothing uses any more: kept for reuse, or closed.

        lent says whether the descriptor was counted (by take or try_lend).
        """
        with self._lock:
            self._take_returned_locked()
            self._give_locked(fd, capacity, lent)

    def _give_locked(self, fd: int, capacity: int, lent: bool) -> None:
        if lent:
            self._lent -= 1
        room = self._lent + len(self._free) < self.max_fds
        if not self._closed and room and capacity <= self.max_bytes:
            bisect.insort(self._free, (capacity, fd))
            self._bytes += capacity
            while self._bytes > self.max_bytes:
                # Drop the largest: a cache of small segments serves more tasks.
                dropped, dropped_fd = self._free.pop()
                self._bytes -= dropped
                _close(dropped_fd)
            return
        _close(fd)

    def _take_returned_locked(self) -> None:
        """Takes in the segments finalizers returned (see the class docstring)."""
        while self._returned:
            self._give_locked(*self._returned.popleft())

    def segment_for(
        self, size: int, write: Callable[[Any], None], reserved: bool
    ) -> tuple[int, int, bool]:
        """Returns (fd, capacity, lent) of a segment of at least `size` bytes that `write` filled.

        A kept segment is reused when one fits; otherwise a new one is made.
        reserved says the caller holds a try_lend reservation, which the
        segment then uses.
        """
        recycled = self.take(size)
        if recycled is not None:
            if reserved:
                self.unlend()  # take() counted the recycled one already
            fd, capacity = recycled
            lent = True
        else:
            try:
                fd, capacity, lent = shm.new_segment(size, "pjrt-pool-segment"), size, reserved
            except BaseException:
                if reserved:
                    self.unlend()
                raise
        try:
            mapping = Mapping(fd, capacity, populate=True)
            write(mapping.as_array())
        except BaseException:
            self.give(fd, capacity, lent)
            raise
        return fd, capacity, lent

    def adopt(self, fd: int, capacity: int, mapping: Mapping) -> None:
        """Gives a lent segment back once `mapping` (what the arrays view) is garbage."""
        weakref.finalize(mapping, self._return_later, fd, capacity).atexit = False

    def _return_later(self, fd: int, capacity: int) -> None:
        """A finalizer's give: no lock here (see the class docstring)."""
        self._returned.append((fd, capacity, True))
        if self._closed:  # close() took in what had come back already: close the rest
            while True:
                try:
                    returned_fd, _, _ = self._returned.popleft()
                except IndexError:
                    return
                _close(returned_fd)

    def close(self) -> None:
        """Closes every kept segment; later gives close theirs at once."""
        with self._lock:
            self._closed = True
            self._take_returned_locked()  # closes them: the cache is closed
            free, self._free, self._bytes = self._free, [], 0
        for _, fd in free:
            _close(fd)


def writer(arrays: list[np.ndarray], offsets: tuple[int, ...]) -> Callable[[Any], None]:
    """Returns a function that copies arrays into a segment at their offsets."""
    return lambda memory: shm.write(memory, arrays, offsets)


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
