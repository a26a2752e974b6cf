"""Moving entries between the local disk cache and the remote, many at a time.

prefetch fetches many keys' entries concurrently (a Prefetcher's bounded
thread pool: PJRT_POOL_CACHE_REMOTE_CONCURRENCY, default 16, or the
``concurrency`` argument) through RemoteCache.fetch, so each entry is
checked exactly as a single lookup checks it (verify.py), and publishes each
into the local cache; keys already there are not asked for. push publishes
local entries (verified first) through RemoteCache.publish: create-only,
records signed as every publish signs them. Nothing here raises for the
remote's sake: each key gets an outcome, and a dead remote is switched off by
its first failure (RemoteCache), so it costs one deadline, not one per key.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from worker.cache import entry as entry_format
from worker.cache.location import number_from_environment
from worker.cache.remote.layout import parse_record_name
from worker.cache.remote.outcomes import Fetched, Published
from worker.cache.remote.tier import RemoteCache
from worker.cache.space import entry_name
from worker.cache.store import DiskCache
from worker.untrusted import read_file

CONCURRENCY_ENV = "PJRT_POOL_CACHE_REMOTE_CONCURRENCY"
"""Requests to the remote in flight at once when prefetching, pushing or collecting."""
DEFAULT_CONCURRENCY = 16

T = TypeVar("T")


class Moved(enum.Enum):
    """What became of one key in a prefetch or a push."""

    FETCHED = "fetched"
    """Fetched, verified and published into the local cache."""
    LOCAL = "already local"
    """The local cache had it: not asked for."""
    MISSING = "missing"
    """The remote has no record of it (for this signer)."""
    REFUSED = "refused"
    """The remote's object failed a check (size, digest, key parts, signature): not used."""
    FAILED = "failed"
    """The remote failed (or was switched off by an earlier failure)."""
    NOT_STORED = "not stored"
    """Fetched, but the local cache could not take it (read-only, full, over its bound)."""
    WRITTEN = "written"
    """Pushed: its blob and record written."""
    REPAIRED = "repaired"
    """Pushed over what was there and did not serve (a record or blob gone, damaged, planted,
    of an older format): mended (RemoteCache.publish)."""
    ALREADY_THERE = "already there"
    """Pushed, and its record was there already (written by another host) and serves: nothing
    written."""
    NOT_WRITTEN = "not written"
    """Not pushed: this process may not write the remote (read-only, a 403, no private key)."""
    BAD = "bad local entry"
    """Not pushed: the local entry is missing, unreadable or fails verification."""

    @property
    def ok(self) -> bool:
        """Whether the key is where the transfer was to put it."""
        return self in (
            Moved.FETCHED,
            Moved.LOCAL,
            Moved.WRITTEN,
            Moved.REPAIRED,
            Moved.ALREADY_THERE,
        )


@dataclass
class TransferReport:
    """Each key's outcome, and how long the whole transfer took."""

    outcomes: dict[str, Moved] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether every key ended where it was to go."""
        return all(outcome.ok for outcome in self.outcomes.values())

    def counts(self) -> dict[str, int]:
        """How many keys had each outcome (only outcomes that occurred)."""
        counts: dict[str, int] = {}
        for outcome in self.outcomes.values():
            counts[outcome.value] = counts.get(outcome.value, 0) + 1
        return counts

    def to_json(self) -> dict[str, object]:
        """The report as a JSON-ready dict."""
        return {
            "ok": self.ok,
            "seconds": round(self.seconds, 6),
            "counts": self.counts(),
            "keys": {key: outcome.value for key, outcome in self.outcomes.items()},
        }


_FETCH_OUTCOME = {
    Fetched.MISS: Moved.MISSING,
    Fetched.REFUSED: Moved.REFUSED,
    Fetched.FAILED: Moved.FAILED,
}
"""A lookup's outcome, other than a hit, as a key's."""
_PUSH_OUTCOME = {
    Published.WRITTEN: Moved.WRITTEN,
    Published.REPAIRED: Moved.REPAIRED,
    Published.ALREADY_THERE: Moved.ALREADY_THERE,
    Published.READ_ONLY: Moved.NOT_WRITTEN,
    Published.FAILED: Moved.FAILED,
}
"""A publish's outcome as a key's."""


def concurrency_from_environment(concurrency: int | None = None) -> int:
    """concurrency if given, else PJRT_POOL_CACHE_REMOTE_CONCURRENCY, else 16; raises ValueError."""
    wanted = "give a whole number above 0"
    if concurrency is None:
        return number_from_environment(CONCURRENCY_ENV, int, DEFAULT_CONCURRENCY, _positive, wanted)
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency {concurrency!r}: {wanted}")
    return concurrency


def _positive(number: int) -> bool:
    return number > 0


def run_concurrently(
    items: Iterable[str], work: Callable[[str], T], concurrency: int | None = None
) -> dict[str, T]:
    """Runs work(item) for every item, at most `concurrency` at once; returns the results."""
    items = list(dict.fromkeys(items))
    if not items:
        return {}
    workers = min(concurrency_from_environment(concurrency), len(items))
    with ThreadPoolExecutor(workers, thread_name_prefix="pjrt-pool-remote-batch") as pool:
        futures = {item: pool.submit(work, item) for item in items}
        return {item: future.result() for item, future in futures.items()}


def _writable(cache: DiskCache) -> DiskCache:
    if not cache.writable:
        raise ValueError(
            f"prefetching needs a writable local cache; {cache.directory} is not "
            f"({cache.problem or 'read-only'})"
        )
    return cache


def _fetch_one(remote: RemoteCache, cache: DiskCache, key: str) -> Moved:
    """Fetches one key's entry into the local cache, in this thread; returns its outcome."""
    if cache.path_of(key).is_file():
        return Moved.LOCAL
    found = remote.lookup(key, cache.max_size)
    if found.outcome is not Fetched.HIT or found.data is None:
        return _FETCH_OUTCOME[found.outcome]
    return Moved.FETCHED if cache.publish_file(key, found.data) else Moved.NOT_STORED


class Prefetcher:
    """Fetches keys' entries into a local cache, a bounded number at a time, as they are named.

    For callers that learn keys one by one (warming, as programs are
    lowered): submit(key) returns a future of the key's outcome; prefetch()
    is the batch form.
    """

    def __init__(
        self, remote: RemoteCache, cache: DiskCache, concurrency: int | None = None
    ) -> None:
        self.remote = remote
        self.cache = _writable(cache)
        self._pool = ThreadPoolExecutor(
            concurrency_from_environment(concurrency), thread_name_prefix="pjrt-pool-prefetch"
        )

    def submit(self, key: str) -> Future[Moved]:
        """Starts fetching a key's entry (unless it is local); the future never raises."""
        entry_name(key)  # InvalidKeyError (a ValueError) for anything but a key, here
        return self._pool.submit(_fetch_one, self.remote, self.cache, key)

    def close(self) -> None:
        """Waits for the fetches submitted, and ends the threads."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def prefetch(
    remote: RemoteCache,
    cache: DiskCache,
    keys: Iterable[str],
    *,
    concurrency: int | None = None,
) -> TransferReport:
    """Fetches the entries of keys the local cache lacks, concurrently; returns each outcome.

    Raises ValueError for a key that is not one, a bad concurrency, or a
    local cache that cannot be written; nothing for the remote's sake.
    """
    started = time.monotonic()
    _writable(cache)
    keys = list(dict.fromkeys(keys))
    for key in keys:
        entry_name(key)  # InvalidKeyError (a ValueError) for anything but a key, before any work
    outcomes = run_concurrently(keys, lambda key: _fetch_one(remote, cache, key), concurrency)
    return TransferReport(outcomes, time.monotonic() - started)


def _push_one(remote: RemoteCache, cache: DiskCache, key: str) -> Moved:
    entries = cache.folder("entries")
    if entries is None:
        return Moved.BAD
    try:
        data = read_file(
            entry_name(key),
            cache.max_size + entry_format.MAX_HEADER_SIZE,
            dir_fd=entries.fd,
            what="cache entry",
        )
        entry = entry_format.verify(data, key, cache.signer)
    except (OSError, entry_format.CorruptEntryError):
        return Moved.BAD
    return _PUSH_OUTCOME[remote.publish(key, entry.parts, data)]


def push(
    remote: RemoteCache,
    cache: DiskCache,
    keys: Iterable[str] | None = None,
    *,
    concurrency: int | None = None,
) -> TransferReport:
    """Publishes local entries (default: every one) to the remote, concurrently.

    Each entry is verified first (digests, and the local signature when
    signing is on), then written create-only, blob before record, with the
    record signed as RemoteCache.publish signs it.
    """
    started = time.monotonic()
    if keys is None:
        keys = [entry.key for entry in cache.list_entries() if entry.regular]
    outcomes = run_concurrently(keys, lambda key: _push_one(remote, cache, key), concurrency)
    return TransferReport(outcomes, time.monotonic() - started)


def remote_keys(remote: RemoteCache) -> list[str]:
    """The keys the remote has a record of for this process's signer, from its listing.

    Every environment's entries (a key does not say which host it was built
    for); raises RemoteError when the listing fails.
    """
    listed = remote.client.list_objects("records/", time.monotonic() + remote.limits.deadline)
    keys = []
    for info in listed:
        parsed = parse_record_name(info.path)
        if parsed is not None and parsed[1] == remote.signer:
            keys.append(parsed[0])
    return sorted(set(keys))
