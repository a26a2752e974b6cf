"""Recycling shared-memory segments between tasks, in the parent.

A new memfd's pages are allocated and zeroed one 4 KiB fault at a time
(shared memory gets no transparent huge pages), which for a 64 MiB output
costs several times the copy itself. So the parent keeps the segments of
large inputs and outputs once nothing uses them any more (an input segment
when its task is done, an output segment when the numpy arrays viewing it
are garbage) and hands them to later tasks, up to a bound in bytes. The
pages of a kept segment stay allocated: that bound is memory the pool holds.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import threading
import weakref

DEFAULT_CACHE_BYTES = 512 << 20
"""How many bytes of unused segments a pool keeps for reuse."""


class SegmentCache:
    """Unused memfd segments (descriptor, capacity), best fit first, within a byte bound."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._free: list[tuple[int, int]] = []  # (capacity, fd), sorted
        self._bytes = 0
        self._closed = False
        self._lock = threading.Lock()

    def take(self, size: int) -> tuple[int, int] | None:
        """Returns (fd, capacity) of a kept segment of at least `size` bytes, or None.

        Segments more than twice the size stay for tasks they fit better.
        """
        with self._lock:
            index = bisect.bisect_left(self._free, (size, -1))
            if index == len(self._free) or self._free[index][0] > 2 * size:
                return None
            capacity, fd = self._free.pop(index)
            self._bytes -= capacity
            return fd, capacity

    def give(self, fd: int, capacity: int) -> None:
        """Keeps a segment for reuse, or closes it when the cache is full or closed."""
        with self._lock:
            if not self._closed and capacity <= self.max_bytes:
                bisect.insort(self._free, (capacity, fd))
                self._bytes += capacity
                while self._bytes > self.max_bytes:
                    # Drop the largest: a cache of small segments serves more tasks.
                    dropped, dropped_fd = self._free.pop()
                    self._bytes -= dropped
                    _close(dropped_fd)
                return
        _close(fd)

    def adopt(self, segment: mmap.mmap, fd: int, capacity: int) -> None:
        """Gives the segment back once `segment` (the arrays' mapping) is garbage."""
        weakref.finalize(segment, self.give, fd, capacity)

    def close(self) -> None:
        """Closes every kept segment; later gives close theirs at once."""
        with self._lock:
            self._closed = True
            free, self._free, self._bytes = self._free, [], 0
        for _, fd in free:
            _close(fd)


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
