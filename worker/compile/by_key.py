"""Loading an executable from the disk cache by its key, without the program.

A production job that runs what `pjrt-pool warm` put in the cache knows each
program by its ProgramSpec (from the manifest), not by its StableHLO: this
loads the executable the spec's key names, with the input types recorded in
the entry, and needs no JAX.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import TYPE_CHECKING, Literal, NamedTuple

from worker.cache.entry import CorruptEntryError, Entry, SignatureError, UnreadableEntryError
from worker.cache.location import DEFAULT_MAX_SIZE
from worker.cache.store import DiskCache, open_cache
from worker.compile.executable import Executable
from worker.errors import NotInCacheError, PjrtError
from worker.identity.keys import check_key
from worker.log import get_logger
from worker.plugin.runtime import loaded_runtime
from worker.records import ArrayType

if TYPE_CHECKING:
    from worker.cache.remote import RemoteCache
    from worker.compile.target import Target

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
    rejection: str | None = None
    """For an entry the plugin refused to load: the cause (refusal_cause), counted and
    recorded when the miss is settled."""


def _load_payload(entry: Entry, target: Target | None) -> Executable:
    """An entry's executable through its target (default: deserialized onto this process's
    device); raises PjrtError or ValueError for bytes that cannot be loaded."""
    if target is None:
        return Executable.deserialize(entry.payload)
    inputs = entry.metadata.get("output_types")
    types = None if not isinstance(inputs, list) else tuple(map(ArrayType.from_json, inputs))
    return target.load(entry.payload, types)


def load_entry(
    cache: DiskCache, key: str, target: Target | None = None
) -> tuple[Executable, Entry] | Miss:
    """Reads, verifies and loads a key's entry through target (default: this process's
    device); returns it loaded, or the Miss."""
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
            executable = _load_payload(entry, target)
    except (PjrtError, ValueError) as error:
        # ValueError: ForeignExecutableError (an older build's stamp) or empty bytes.
        return rejected(cache, key, error, stat)
    executable.key = key
    return executable, entry


def rejected(
    cache: DiskCache | None, key: str, error: Exception, stat: os.stat_result | None
) -> Miss:
    """The Miss of an entry the plugin refused to load (counted as corrupt, and as rejected).

    Nothing about it is silent (settle_miss): a warning the first time its
    cause is seen in this process and a debug line after that, and the cause
    recorded in the cache's plugin records, which ``pjrt-pool cache info``
    shows. An entry that every load refuses means this plugin cannot read
    what it (or another build) wrote, which is worth knowing before a fleet
    compiles everything again.
    """
    cause = refusal_cause(error)
    return Miss(f"the plugin rejected the entry ({error})", "corrupt", stat, rejection=cause)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _first_time(cause: str) -> bool:
    """Whether this process has not warned of a refusal's cause before."""
    with _warned_lock:
        first = cause not in _warned
        _warned.add(cause)
    return first


def refusal_cause(error: Exception) -> str:
    """An error's message without its numbers and hex: one cause for many entries."""
    return re.sub(r"0x[0-9a-fA-F]+|[0-9]+", "N", str(error))[:300]


def settle_miss(cache: DiskCache, key: str, miss: Miss, name: str | None = None) -> None:
    """Counts and logs a miss, and removes the entry it judged bad; call under the key's lock."""
    if miss.counter is not None:
        cache.count(miss.counter)
    what = f"cache miss for {name} ({key})" if name else f"cache entry {key}"
    message = f"{what}: {miss.reason}"
    if miss.rejection is not None:
        cache.count("rejected")
        runtime = loaded_runtime()
        cache.note_rejection(miss.rejection, None if runtime is None else runtime.location.path)
    if miss.warn or (miss.rejection is not None and _first_time(miss.rejection)):
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
    cache: DiskCache | None,
    remote: RemoteCache,
    key: str,
    target: Target | None = None,
    *,
    lead: bool = False,
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
        loaded = load_entry(cache, key, target)
        if isinstance(loaded, Miss):
            settle_miss(cache, key, loaded)
            remote.refuse(key, loaded.reason)
            return None
        return loaded
    try:
        executable = _load_payload(entry, target)
    except (PjrtError, ValueError) as error:
        miss = rejected(cache, key, error, None)
        if miss.rejection is not None and _first_time(miss.rejection):
            logger.warning("remote cache entry %s: %s", key, miss.reason)
        remote.refuse(key, miss.reason)
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
