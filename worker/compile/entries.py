"""One key's entry, read, checked and loaded through a target: from the disk cache or a remote.

load_entry reads a key's entry from the disk cache and loads it, or says
why not (a Miss); settle_miss, under the key's lock, counts and logs the
miss and removes an entry judged bad. load_fetched loads an entry a remote
handed over, through the disk cache when there is one. What each loaded
executable is known by (its key, the argument types it takes) is given to
the Executable as it is made (worker.compile.executable).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from worker.cache.entry import CorruptEntryError, Entry, SignatureError, UnreadableEntryError
from worker.cache.location import DEFAULT_MAX_SIZE
from worker.cache.store import DiskCache
from worker.compile.executable import Executable, deserialize_executable
from worker.compile.target import MadeFor
from worker.errors import PjrtError
from worker.identity.keys import LOADING_PARTS, differing_parts
from worker.log import get_logger
from worker.partitioning import partitioning_from_json
from worker.plugin.runtime import loaded_runtime
from worker.records import ArrayType

if TYPE_CHECKING:
    from worker.cache.remote import RemoteCache
    from worker.compile.target import Target

logger = get_logger("pjrt_pool.cache")

InputTypes = tuple[ArrayType, ...] | None | Literal["recorded"]
"""The argument types a loaded executable takes: given (a program's; None: unknown), or
"recorded": those its entry records (loading by key alone)."""


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


def _input_types(entry: Entry, wanted: InputTypes) -> tuple[ArrayType, ...] | None:
    """The argument types to load an entry with: wanted, or those the entry records."""
    if wanted != "recorded":
        return wanted
    inputs = entry.metadata.get("input_types")
    return None if inputs is None else tuple(map(ArrayType.from_json, inputs))


def _load_payload(
    entry: Entry, key: str, target: Target | None, input_types: tuple[ArrayType, ...] | None
) -> Executable:
    """An entry's executable through its target (default: deserialized onto this process's
    device), over the devices its recorded partitioning names (the key vouches for it: the
    same program text and device assignment); raises PjrtError or ValueError for bytes, or
    a record, that cannot be loaded."""
    partitioning = partitioning_from_json(entry.metadata.get("partitioning"))
    made_for = MadeFor(key, input_types, partitioning)
    if target is None:
        return deserialize_executable(entry.payload, **made_for._asdict())
    outputs = entry.metadata.get("output_types")
    types = None if not isinstance(outputs, list) else tuple(map(ArrayType.from_json, outputs))
    return target.load(entry.payload, types, made_for)


def load_entry(
    cache: DiskCache,
    key: str,
    target: Target | None = None,
    input_types: InputTypes = "recorded",
    here: dict[str, Any] | None = None,
) -> tuple[Executable, Entry] | Miss:
    """Reads, verifies and loads a key's entry through target (default: this process's
    device), taking input_types; returns it loaded, or the Miss.

    here, for a load by key alone (whose key says nothing of this process), is this
    process's identity (runtime_key_parts without a program): an entry built for
    another platform, plugin build, host or topology (LOADING_PARTS) is a miss that
    removes nothing, never handed to a plugin that would refuse it as damaged (and a
    cache shared by several hosts or platforms would lose it).
    """
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
    if here is not None:
        differing = differing_parts(
            entry.parts, here, entry.metadata.get("cpu_flags"), LOADING_PARTS
        )
        if differing:
            return Miss("it was built elsewhere: " + "; ".join(differing), None, None, False)
    dead = cache.loads.dead(key) if cache.writable else []
    if dead:
        reason = f"{cache.loads.describe(dead)} died while loading it; quarantined"
        return Miss(reason, "crashed_loads", stat, dead_loads=tuple(dead), warn=True)
    types = _input_types(entry, input_types)
    try:
        with cache.loads.loading(key) if cache.writable else contextlib.nullcontext():
            executable = _load_payload(entry, key, target, types)
    except (PjrtError, ValueError) as error:
        # ValueError: ForeignExecutableError (an older build's stamp) or empty bytes.
        return rejected(cache, key, error, stat)
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


def fetch_bound(cache: DiskCache | None) -> int:
    """The largest entry worth fetching from a remote: the local cache's bound, or the default."""
    return cache.max_size if cache is not None else DEFAULT_MAX_SIZE


def load_fetched(
    cache: DiskCache | None,
    remote: RemoteCache,
    key: str,
    fetched: tuple[bytes, Entry],
    target: Target | None = None,
    input_types: InputTypes = "recorded",
) -> tuple[Executable, Entry] | None:
    """Loads an entry a remote handed over (its verified file and entry); None when it
    cannot be loaded here.

    The entry file is published into the local cache first and loaded from
    there (so the next load on this host is local); without a writable local
    cache it is loaded from memory. An entry the plugin rejects is refused by
    the remote for the rest of the process (and removed locally). Call with
    the key's lock held when there is a cache.
    """
    data, entry = fetched
    if cache is not None and cache.writable and cache.publish_file(key, data):
        loaded = load_entry(cache, key, target, input_types)
        if isinstance(loaded, Miss):
            settle_miss(cache, key, loaded)
            remote.refuse(key, loaded.reason)
            return None
        return loaded
    types = _input_types(entry, input_types)
    try:
        executable = _load_payload(entry, key, target, types)
    except (PjrtError, ValueError) as error:
        miss = rejected(cache, key, error, None)
        if miss.rejection is not None and _first_time(miss.rejection):
            logger.warning("remote cache entry %s: %s", key, miss.reason)
        remote.refuse(key, miss.reason)
        return None
    return executable, entry


def load_remote_entry(
    cache: DiskCache | None, remote: RemoteCache, key: str
) -> tuple[Executable, Entry] | None:
    """Fetches a key's entry from the remote tier and loads it onto this process's device,
    with the argument types it records (load_fetched); None for a miss of any kind."""
    fetched = remote.fetch(key, fetch_bound(cache))
    return None if fetched is None else load_fetched(cache, remote, key, fetched)
