"""This process's disk caches: one DiskCache per directory, and what they counted.

compile_program, loading by key and a worker's replies go through
open_cache, so that one instance, and its counters, serve every use of a
directory in the process (process_counters sums them). existing_memos opens
only a cache that is there already, for the records about plugin builds that
loading a plugin reads and fills.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

from worker.cache import trust
from worker.cache.counters import CacheCounters, summed
from worker.cache.location import resolve_cache_dir
from worker.cache.memos import MemoStore
from worker.cache.store import DiskCache

_caches: dict[Path, DiskCache] = {}
_caches_lock = threading.Lock()


def open_cache(directory: str | os.PathLike[str] | None = None) -> DiskCache:
    """Returns this process's DiskCache for a directory: one instance, shared counters.

    compile_program goes through this, so ``open_cache(d).counters`` tells what
    this process's compiles did with directory d.
    """
    resolved = resolve_cache_dir(directory).absolute()
    with _caches_lock:
        cache = _caches.get(resolved)
        if cache is None:
            cache = _caches[resolved] = DiskCache(resolved)
        return cache


@functools.lru_cache(maxsize=16)
def existing_memos(directory: Path) -> MemoStore | None:
    """The records of a cache directory that exists and passes the trust check, else None.

    Never creates the directory, only its plugins/ folder if it lacks one, and
    never raises. Decided once per process and directory: callers ask on every
    executable they load or serialize.
    """
    try:
        cache = DiskCache(directory, create=False)
    except (OSError, ValueError, trust.UntrustedCacheError):
        return None
    return cache.records_made_if_missing()


def process_counters() -> CacheCounters:
    """Returns the counters of every cache this process opened with open_cache, summed."""
    with _caches_lock:
        caches = list(_caches.values())
    return summed((cache.counters for cache in caches), CacheCounters())
