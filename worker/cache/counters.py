"""What a process's use of a disk cache did: hits, misses and repairs."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from typing import NamedTuple, Protocol, Self, TypeVar


class Addable(Protocol):
    """Counters that add up (CacheCounters, worker.cache.remote.RemoteCounters)."""

    def add(self, other: Self) -> Self:
        """Returns the sum of two counters."""
        ...


_C = TypeVar("_C", bound=Addable)


def summed(counters: Iterable[_C], zero: _C) -> _C:
    """The sum of counters of one kind, starting from `zero` (a fresh one, or a total)."""
    return functools.reduce(lambda total, counter: total.add(counter), counters, zero)


class CacheCounters(NamedTuple):
    """Counts of what one process's disk cache did (see DiskCache.counters)."""

    hits: int = 0
    """Executables loaded from an entry."""
    misses: int = 0
    """Lookups that ended in a compile: no entry, or a corrupt, rejected, unreadable,
    wrongly signed or crashing one."""
    corrupt: int = 0
    """Entries that failed verification or that the plugin rejected; removed and rebuilt."""
    evicted: int = 0
    """Entries removed to keep the cache under its size bound."""
    lock_timeouts: int = 0
    """Lock waits that timed out: for a compile lock this process compiled anyway; for
    the space lock, its entry was not stored."""
    write_errors: int = 0
    """Entries that could not be written (read-only or full disk)."""
    read_errors: int = 0
    """Entries that exist but could not be read (EACCES, EMFILE, EIO): compiled instead,
    and the entry left alone."""
    bad_signatures: int = 0
    """Entries refused because signing is on and they were unsigned, signed with another
    secret, or changed after signing; compiled and published again, signed."""
    crashed_loads: int = 0
    """Entries removed because a process died while loading them (see loads.py)."""
    rejected: int = 0
    """Of the corrupt entries, those the plugin refused to load (the others failed
    verification); each cause is warned of once and recorded for ``cache info``."""

    def add(self, other: CacheCounters) -> CacheCounters:
        """Returns the sum of two counters."""
        return CacheCounters(*(a + b for a, b in zip(self, other, strict=True)))


class Tally:
    """Thread-safe running CacheCounters."""

    def __init__(self) -> None:
        self._counts = dict.fromkeys(CacheCounters._fields, 0)
        self._lock = threading.Lock()

    def count(self, name: str, amount: int = 1) -> None:
        """Adds to one of the CacheCounters fields."""
        with self._lock:
            self._counts[name] += amount

    def snapshot(self) -> CacheCounters:
        """Returns the counts so far."""
        with self._lock:
            return CacheCounters(**self._counts)
