"""Loading an executable from the disk cache by its key, without the program.

A production job that runs what `pjrt-pool warm` put in the cache knows each
program by its ProgramSpec (from the manifest), not by its StableHLO: this
loads the executable the spec's key names, with the input types recorded in
the entry, and needs no JAX.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Literal, NamedTuple

from worker.cache.entry import CorruptEntryError, Entry, SignatureError, UnreadableEntryError
from worker.cache.key import check_key
from worker.cache.location import DEFAULT_MAX_SIZE
from worker.cache.store import DiskCache, open_cache
from worker.compile.executable import Executable
from worker.errors import NotInCacheError, PjrtError
from worker.log import get_logger
from worker.records import ArrayType

if TYPE_CHECKING:
    from worker.cache.remote import RemoteCache

__all__ = [
    "Miss",
    "NotInCacheError",
    "load_cached_executable",
    "load_entry",
    "load_remote_entry",
    "settle_miss",
]

logger = get_logger("pjrt_pool.cache")


class Miss(NamedTuple):
    """Why a key's entry gave no executable, and what to do about it under the key's lock."""

    reason: str
    """For the log: what was found."""
    counter: str | None
    """The CacheCounters field this kind of miss adds to (besides misses), if any."""
    stat: os.stat_result | None
    """The file judged bad, removed under the lock (exactly that one); None: remove nothing."""
    publish: bool = True
    """False when the entry may be good but could not be read: compile, leave it be."""
    dead_loads: tuple[str, ...] = ()
    """Markers of processes that died loading the entry (cleared with it)."""
    warn: bool = False
    """Whether to log a warning rather than a debug line."""


def load_entry(cache: DiskCache, key: str) -> tuple[Executable, Entry] | Miss:
    """Reads, verifies and deserializes a key's entry; returns it loaded, or the Miss."""
    try:
        found = cache.read(key)
    except SignatureError as error:
        return Miss(f"refused entry: {error}", "bad_signatures", error.stat, warn=True)
    except CorruptEntryError as error:
        return Miss(f"corrupt entry ({error})", "corrupt", error.stat)
    except UnreadableEntryError as error:
        return Miss(f"{error}; compiling instead", "read_errors", None, publish=False, warn=True)
    if found is None:
        return Miss("no entry", None, None)
    entry, stat = found
    dead = cache.loads.dead(key) if cache.writable else []
    if dead:
        reason = f"{cache.loads.describe(dead)} died while loading it; quarantined"
        return Miss(reason, "crashed_loads", stat, dead_loads=tuple(dead), warn=True)
    try:
        with cache.loads.loading(key) if cache.writable else contextlib.nullcontext():
            executable = Executable.deserialize(entry.payload)
    except (PjrtError, ValueError) as error:
        # ValueError: ForeignExecutableError (another build's stamp) or empty bytes.
        return Miss(f"the plugin rejected the entry ({error})", "corrupt", stat)
    executable.key = key
    return executable, entry


def settle_miss(cache: DiskCache, key: str, miss: Miss, name: str | None = None) -> None:
    """Counts and logs a miss, and removes the entry it judged bad; call under the key's lock."""
    if miss.counter is not None:
        cache.count(miss.counter)
    what = f"cache miss for {name} ({key})" if name else f"cache entry {key}"
    message = f"{what}: {miss.reason}"
    if miss.warn:
        logger.warning(message)
    else:
        logger.debug(message)
    if cache.remove_if_unchanged(key, miss.stat):
        logger.debug("removed the bad entry %s", key)
    if miss.dead_loads:
        cache.loads.clear(list(miss.dead_loads))


def _open_remote(remote: str | Literal[False] | None) -> RemoteCache | None:
    from worker.cache.remote import open_remote

    return open_remote(remote)


def load_remote_entry(
    cache: DiskCache | None, remote: RemoteCache, key: str, *, lead: bool = False
) -> tuple[Executable, Entry] | None:
    """Fetches a key's entry from the remote tier and loads it; None for a miss of any kind.

    The verified entry file is published into the local cache first and
    loaded from there (so the next load on this host is local); without a
    writable local cache it is loaded from memory. An entry the plugin
    rejects is refused by the remote for the rest of the process (and
    removed locally). Call with the key's lock held when there is a cache.
    lead=True, for a caller that compiles on a miss: a miss takes the key's
    remote lease, or waits for the host that holds it (see remote/lease.py).
    """
    bound = cache.max_size if cache is not None else DEFAULT_MAX_SIZE
    fetched = remote.fetch_or_lead(key, bound) if lead else remote.fetch(key, bound)
    if fetched is None:
        return None
    data, entry = fetched
    if cache is not None and cache.writable and cache.publish_file(key, data):
        loaded = load_entry(cache, key)
        if isinstance(loaded, Miss):
            settle_miss(cache, key, loaded)
            remote.refuse(key, loaded.reason)
            return None
        return loaded
    try:
        executable = Executable.deserialize(entry.payload)
    except (PjrtError, ValueError) as error:
        remote.refuse(key, f"the plugin rejected the entry ({error})")
        return None
    executable.key = key
    return executable, entry


def load_cached_executable(
    key: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    remote: str | Literal[False] | None = None,
) -> Executable:
    """Returns the executable stored under `key`; raises NotInCacheError if there is none.

    A missing, corrupt, rejected, wrongly signed or unreadable entry, or one
    whose load killed an earlier process, raises NotInCacheError saying which
    (a bad entry is removed first, an unreadable one left alone), since
    without the program there is nothing to compile again: warm the cache
    again (or compile the program) to fill it. A key that is not a cache key
    (64 hex digits) raises InvalidKeyError, a ValueError, before any file is
    touched. remote (default PJRT_POOL_CACHE_REMOTE; False: none) is asked
    when the local cache has no usable entry (see load_remote_entry).
    """
    check_key(key)
    cache = open_cache(cache_dir)
    loaded = load_entry(cache, key)
    settled = False
    tier = _open_remote(remote) if isinstance(loaded, Miss) else None
    if isinstance(loaded, Miss) and tier is not None:
        with cache.lock(key):
            settle_miss(cache, key, loaded)
            settled = True
            loaded = load_remote_entry(cache if cache.usable else None, tier, key) or loaded
    if isinstance(loaded, Miss):
        if loaded.counter is None:
            where = f"{cache.directory} or {tier.location.shown}" if tier else cache.directory
            raise NotInCacheError(
                f"no executable with key {key} in {where}: warm the cache "
                "(pjrt-pool warm) with this plugin and cache directory first"
            )
        if not settled:
            with cache.lock(key):
                settle_miss(cache, key, loaded)
        raise NotInCacheError(
            f"the cache entry {key} in {cache.directory} cannot be used ({loaded.reason}); "
            "warm the cache again"
        )
    executable, entry = loaded
    inputs = entry.metadata.get("input_types")
    executable.input_types = None if inputs is None else tuple(map(ArrayType.from_json, inputs))
    cache.count("hits")
    return executable
