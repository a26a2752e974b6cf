"""RemoteCache: one process's use of a remote tier, with its counters and its failures.

A lookup reads the key's record, then the entry file it names, and checks
both (verify.py); a publish writes the entry file, then the record, both
create-only (layout.py). What can go wrong, and what follows:

- an object that fails a check: a miss, counted in ``refused``, remembered
  for the process (never fetched again) and warned about once per key;
- a record of an older format: a miss, warned about once;
- the store refuses, resets, hangs or throttles past the retries, or the
  lookup outlives its deadline (Limits.deadline_for: grown with the entry's
  size): the remote is switched off for the process with one warning naming
  the URL (never a credential), so a dead remote costs a process one
  deadline;
- a write answered 401/403: the process goes on read-only, with one warning.

A miss that will be compiled takes the key's lease (lease.py), or waits for
the host that holds it.

Nothing here raises for the remote's sake: the caller compiles instead.
"""

from __future__ import annotations

import hashlib
import threading
import time
import warnings
from typing import Any, Literal, NamedTuple

from worker.cache import entry as entry_format
from worker.cache.key import differing_parts, is_key
from worker.cache.remote.client import Failure, ObjectClient, RemoteError
from worker.cache.remote.keys import RecordKeys, keys_from_environment
from worker.cache.remote.layout import (
    MAX_RECORD_SIZE,
    UNSIGNED,
    Record,
    blob_name,
    encode_record,
    program_folder,
    program_index_name,
    record_name,
)
from worker.cache.remote.lease import (
    MAX_LEASE_SIZE,
    POLL_FIRST,
    POLL_MAX,
    Claim,
    Lease,
    decode_lease,
    holder_name,
    lease_name,
    lease_seconds,
)
from worker.cache.remote.location import Limits, RemoteLocation, resolve_remote
from worker.cache.remote.verify import (
    OlderRecordError,
    RefusedObjectError,
    checked_entry,
    checked_record,
    sign_record,
)
from worker.cache.signing import Signer, signer_from_environment
from worker.cache.store import CacheUnavailableWarning
from worker.log import get_logger

logger = get_logger("pjrt_pool.cache")

ELSEWHERE_READ = 8
"""At most this many records of a program's other builds are read for one refusal."""


class RemoteCacheWarning(CacheUnavailableWarning):
    """The remote tier refused an object, or was switched off or made read-only."""


class RemoteCounters(NamedTuple):
    """What one process's remote tier did (RemoteCache.counters)."""

    hits: int = 0
    """Entries fetched, verified and handed to the local cache."""
    misses: int = 0
    """Lookups that found no record for the key."""
    refused: int = 0
    """Objects that failed a check (size, digest, key parts, signature): not used."""
    errors: int = 0
    """Requests that failed (refused, reset, timed out, throttled, denied)."""
    published: int = 0
    """Entries this process wrote (blob and record)."""
    already_there: int = 0
    """Publishes that found the record written already (by another host): nothing written."""
    leases: int = 0
    """Leases this process took: keys it compiled while other hosts waited for it."""
    waited: int = 0
    """Compiles saved: entries fetched after waiting for another host's lease."""

    def add(self, other: RemoteCounters) -> RemoteCounters:
        """Returns the sum of two counters."""
        return RemoteCounters(*(a + b for a, b in zip(self, other, strict=True)))


State = Literal["on", "read-only", "off"]


class RemoteCache:
    """A remote tier of the cache at one location; see the module docstring."""

    def __init__(
        self,
        location: RemoteLocation,
        limits: Limits | None = None,
        *,
        hmac_signer: Signer | None = None,
        keys: RecordKeys | None = None,
    ) -> None:
        self.location = location
        self.limits = limits or Limits.from_environment()
        self.hmac_signer = hmac_signer
        self.keys = keys
        self.client = ObjectClient(location, self.limits)
        self._counts = dict.fromkeys(RemoteCounters._fields, 0)
        self._refused: set[str] = set()
        self._held: set[str] = set()
        self._holder = holder_name()
        self.lease_seconds = lease_seconds()
        """How long a lease this process takes stands (PJRT_POOL_CACHE_REMOTE_LEASE)."""
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.state: State = "on"
        """on; read-only (explicit, a public key without the private one, or a 403); off."""
        if location.read_only or (keys is not None and keys.private is None):
            self.state = "read-only"

    @property
    def signer(self) -> str:
        """The signer name of the records this process reads and writes."""
        if self.keys is not None:
            return self.keys.signer
        if self.hmac_signer is not None:
            return f"hmac-{self.hmac_signer.key_id}"
        return UNSIGNED

    @property
    def counters(self) -> RemoteCounters:
        """What this tier did so far."""
        with self._lock:
            return RemoteCounters(**self._counts)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _warn_once(self, topic: str, message: str) -> None:
        with self._lock:
            if topic in self._warned:
                return
            self._warned.add(topic)
        logger.warning(message)
        warnings.warn(message, RemoteCacheWarning, stacklevel=3)

    def _failed(self, error: RemoteError, writing: bool) -> None:
        self._count("errors")
        if writing and error.failure is Failure.DENIED:
            self.state = "read-only" if self.state == "on" else self.state
            self._warn_once(
                "read-only",
                f"pjrt-pool remote cache {self.location.shown} refused a write ({error}); "
                "reading it only, for this process",
            )
            return
        self.state = "off"
        self._warn_once(
            "off",
            f"pjrt-pool remote cache {self.location.shown} switched off for this process: {error}",
        )

    def _refuse(self, key: str, why: str) -> None:
        self._count("refused")
        with self._lock:
            self._refused.add(key)
        self._warn_once(
            f"refused {key}",
            f"pjrt-pool remote cache {self.location.shown}: refused the entry of {key}: {why}; "
            "compiling instead",
        )

    def fetch(
        self, key: str, max_size: int, *, count_miss: bool = True
    ) -> tuple[bytes, entry_format.Entry] | None:
        """Returns a key's verified entry file and entry, or None (a miss of any kind)."""
        if self.state == "off" or key in self._refused:
            return None
        started = time.monotonic()
        name = record_name(key, self.signer)
        try:
            data = self.client.get(name, MAX_RECORD_SIZE, started + self.limits.deadline)
            if data is None:
                if count_miss:
                    self._count("misses")
                return None
            record = checked_record(data, key, self.signer, self.keys, self.hmac_signer)
            if record.size > max_size:
                raise RefusedObjectError(
                    f"its record says {record.size} bytes, over this cache's bound {max_size}"
                )
            deadline = started + self.limits.deadline_for(record.size)
            blob = self.client.get(blob_name(record.sha256), record.size, deadline)
            if blob is None:
                raise RefusedObjectError(f"its record names a missing blob {record.sha256}")
            entry = checked_entry(blob, record, self.hmac_signer)
        except OlderRecordError as error:
            shown = self.location.shown
            self._warn_once("older record", f"pjrt-pool remote cache {shown}: {error}")
            if count_miss:
                self._count("misses")
            return None
        except RefusedObjectError as error:
            self._refuse(key, str(error))
            return None
        except RemoteError as error:
            if error.failure is Failure.TOO_LARGE:
                self._refuse(key, str(error))
            else:
                self._failed(error, writing=False)
            return None
        self._count("hits")
        return blob, entry

    def fetch_or_lead(self, key: str, max_size: int) -> tuple[bytes, entry_format.Entry] | None:
        """fetch; on a miss, takes the key's lease (None: compile) or waits for its holder."""
        fetched = self.fetch(key, max_size)
        if fetched is not None or self.state == "off" or key in self._refused:
            return fetched
        claim = self.claim(key)
        if claim == "mine":
            # The record may have been published between the miss and the lease,
            # by a holder that released its lease since.
            fetched = self.fetch(key, max_size, count_miss=False)
            if fetched is not None:
                self.release(key)
            return fetched
        return self._wait(key, max_size) if claim == "theirs" else None

    def _take(self, key: str, deadline: float) -> bool:
        lease = Lease(key, self._holder, time.time() + self.lease_seconds)
        if not self.client.put_new(lease_name(key), lease.encode(), deadline).written:
            return False
        with self._lock:
            self._held.add(key)
        self._count("leases")
        return True

    def _standing(self, key: str, deadline: float) -> Lease | None:
        """The key's lease if one stands (a malformed one does not)."""
        data = self.client.get(lease_name(key), MAX_LEASE_SIZE, deadline)
        found = None if data is None else decode_lease(data, key)
        return found if found is not None and not found.expired() else None

    def claim(self, key: str) -> Claim:
        """Takes a key's lease, or finds another's standing (see lease.py); never raises."""
        if self.state == "off":
            return "none"
        deadline = time.monotonic() + self.limits.deadline
        try:
            if self.state == "on" and self._take(key, deadline):
                return "mine"
            if self._standing(key, deadline) is not None:
                return "theirs"
            if self.state != "on":
                return "none"
            # Gone, expired (its holder died) or malformed: removed, then taken afresh.
            self.client.delete(lease_name(key), deadline)
            return "mine" if self._take(key, deadline) else "theirs"
        except RemoteError as error:
            if error.failure is not Failure.TOO_LARGE:
                self._failed(error, writing=True)
            return "none"

    def _wait(self, key: str, max_size: int) -> tuple[bytes, entry_format.Entry] | None:
        """Polls for the record while another host's lease stands; None: compile here."""
        pause = POLL_FIRST
        give_up = time.monotonic() + self.lease_seconds
        while time.monotonic() < give_up:
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX)
            fetched = self.fetch(key, max_size, count_miss=False)
            if fetched is not None:
                self._count("waited")
                return fetched
            if self.state == "off" or key in self._refused:
                return None
            try:
                if self._standing(key, time.monotonic() + self.limits.deadline) is None:
                    return None
            except RemoteError as error:
                self._failed(error, writing=False)
                return None
        return None

    def release(self, key: str) -> None:
        """Removes this process's lease of key, if it holds one (never raises)."""
        with self._lock:
            if key not in self._held:
                return
            self._held.discard(key)
        try:
            self.client.delete(lease_name(key), time.monotonic() + self.limits.deadline)
        except RemoteError as error:  # it expires on its own
            logger.debug("could not remove the lease of %s: %s", key, error)

    def was_refused(self, key: str) -> bool:
        """Whether this process refused the key's remote entry (it is not fetched again)."""
        with self._lock:
            return key in self._refused

    def refuse(self, key: str, why: str) -> None:
        """Marks a fetched entry as unusable (the plugin rejected it): never fetched again."""
        self._refuse(key, why)

    def publish(self, key: str, parts: dict[str, Any], data: bytes) -> bool:
        """Writes a key's entry file (verified by the caller) and then its record; True if written.

        False when this process does not write (read-only, off), when the
        record was there already, or when a write failed (then counted and
        warned about, see the module docstring).
        """
        if self.state != "on":
            self.release(key)
            return False
        deadline = time.monotonic() + self.limits.deadline_for(len(data))
        sha256 = hashlib.sha256(data).hexdigest()
        body = Record(key, parts, sha256, len(data), self.signer).body()
        record = encode_record(body, sign_record(body, self.keys, self.hmac_signer))
        try:
            self.client.put_new(blob_name(sha256), data, deadline)
            name = record_name(key, self.signer)
            written = self.client.put_new(name, record, deadline).written
        except RemoteError as error:
            self._failed(error, writing=True)
            self.release(key)
            return False
        self._count("published" if written else "already_there")
        self.release(key)
        try:  # after the record (layout.py): an index name then always has one to read
            self.client.put_new(program_index_name(parts, key), b"", deadline)
        except RemoteError as error:  # a hint for refusals only: the entry is published
            logger.debug("could not index %s under its program: %s", key, error)
        return written

    def built_elsewhere(self, key: str, parts: dict[str, Any]) -> list[tuple[str, list[str]]]:
        """The other keys the remote holds this program under, each with how its record's
        key parts differ from parts (worker.cache.key.differing_parts); for refusals.

        Reads the program's index (layout.py) and, for at most
        ELSEWHERE_READ of its keys, the record this process would trust,
        checked as a fetch checks it (a record that fails is left out).
        Never raises: a failing remote ends the search, within one deadline.
        """
        if self.state == "off":
            return []
        deadline = time.monotonic() + self.limits.deadline
        found: list[tuple[str, list[str]]] = []
        try:
            listed = self.client.list_objects(program_folder(parts), deadline)
            others = [item.path.rsplit("/", 1)[-1] for item in listed]
            for other in [name for name in others if name != key and is_key(name)][:ELSEWHERE_READ]:
                data = self.client.get(record_name(other, self.signer), MAX_RECORD_SIZE, deadline)
                if data is None:
                    continue
                try:
                    record = checked_record(data, other, self.signer, self.keys, self.hmac_signer)
                except RefusedObjectError:
                    continue
                found.append((other, differing_parts(record.parts, parts)))
        except RemoteError as error:
            logger.debug("could not list the builds of %s: %s", key, error)
        return found


_remotes: dict[tuple[str, bool], RemoteCache] = {}
_remotes_lock = threading.Lock()


def open_remote(remote: str | Literal[False] | None = None) -> RemoteCache | None:
    """This process's RemoteCache for a URL (None: PJRT_POOL_CACHE_REMOTE), or None if none.

    One instance per URL, so that its counters, what it refused and whether
    it was switched off hold for the whole process. Cheap, and imports no
    client library: nothing is contacted before the first lookup. Raises
    ValueError for a malformed URL, limit or key.
    """
    location = resolve_remote(remote)
    if location is None:
        return None
    index = (location.url, location.read_only)
    with _remotes_lock:
        found = _remotes.get(index)
        if found is None:
            found = _remotes[index] = RemoteCache(
                location, hmac_signer=signer_from_environment(), keys=keys_from_environment()
            )
        return found


def remote_counters() -> RemoteCounters:
    """The counters of every remote this process opened with open_remote, summed."""
    with _remotes_lock:
        remotes = list(_remotes.values())
    total = RemoteCounters()
    for remote in remotes:
        total = total.add(remote.counters)
    return total
