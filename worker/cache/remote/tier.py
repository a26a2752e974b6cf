"""RemoteCache: one process's use of a remote tier, with its counters and its failures.

A lookup reads the key's record, then the entry file it names, and checks
both (verify.py); a publish writes the entry file, then the record, both
create-only (layout.py). Each says what happened as one of a closed set
(Fetched, Published: outcomes.py, with the counters). What can go wrong,
and what follows:

- an object that fails a check: a miss, counted in ``refused``, remembered
  for REFUSAL_MEMORY seconds (not fetched again meanwhile) and warned about
  once per key; the next publish of the key mends it (below);
- a record whose blob is gone, or of an older format: a miss;
- a publish that finds the key's record there already checks it, and the
  blob it names, as a lookup would: one that does not serve (gone, damaged,
  planted without the signing key, of an older format) is replaced,
  conditionally on the version read (``repaired``), so damage costs one
  recompile, not one per host until gc; a record of a newer format is left;
- the store refuses, resets, hangs or throttles past the retries, the
  bucket does not exist, or the lookup outlives its deadline
  (Limits.deadline_for: grown with the entry's size): the remote is switched
  off for the process with one warning naming the URL (never a credential),
  so a dead remote costs a process one deadline;
- a write answered 401/403: the process goes on read-only, with one warning.

A miss that will be compiled takes the key's lease (lease.py), or waits for
the host that holds it (one lease length of this process's per holder, at
most MAX_HOLDERS holders).

Nothing here raises for the remote's sake: the caller compiles instead.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any, Literal

from worker.cache import entry as entry_format
from worker.cache.counters import summed
from worker.cache.remote.client import ObjectClient
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
    MAX_HOLDERS,
    POLL_FIRST,
    POLL_MAX,
    Claim,
    Lease,
    Leases,
    Seen,
    lease_seconds,
)
from worker.cache.remote.location import Limits, RemoteLocation, resolve_remote
from worker.cache.remote.objects import Failure, RemoteError, Versioned
from worker.cache.remote.outcomes import (
    Counter,
    Fetched,
    Lookup,
    Published,
    RemoteCounters,
    State,
)
from worker.cache.remote.signing_keys import (
    PRIVATE_KEY_FILE_ENV,
    PUBLIC_KEY_ENV,
    RecordKeys,
    keys_from_environment,
)
from worker.cache.remote.verify import (
    NewerRecordError,
    OlderRecordError,
    RefusedObjectError,
    checked_entry,
    checked_record,
    sign_record,
)
from worker.cache.signing import Signer, signer_from_environment
from worker.cache.warn_once import CacheUnavailableWarning, WarnOnce
from worker.identity.keys import differing_parts, is_key
from worker.log import get_logger

logger = get_logger("pjrt_pool.cache")

ELSEWHERE_READ = 8
"""At most this many records of a program's other builds are read for one refusal."""
REFUSAL_MEMORY = 600.0
"""Seconds a refused key is not fetched again (then it is: the remote may have been healed)."""


class RemoteCacheWarning(CacheUnavailableWarning):
    """The remote tier refused an object, or was switched off or made read-only."""


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
        self._refused: dict[str, float] = {}
        """Refused keys, each with when (time.monotonic) it may be fetched again."""
        self._warnings = WarnOnce(RemoteCacheWarning, stacklevel=3)
        self._lock = threading.Lock()
        self.leases = Leases(self.client, self.limits, lease_seconds(), self._bad_lease)
        """The leases this process takes and waits on (lease.py)."""
        self.state: State = "on"
        """on; read-only (explicit, a public key without the private one, or a 403); off.
        Written only under the lock (_set_state)."""
        if location.read_only or (keys is not None and keys.private is None):
            self.state = "read-only"

    @property
    def lease_seconds(self) -> float:
        """How long a lease this process takes stands unrenewed (PJRT_POOL_CACHE_REMOTE_LEASE)."""
        return self.leases.seconds

    @property
    def signer(self) -> str:
        """The signer name of the records this process reads and writes."""
        if self.keys is not None:
            return self.keys.signer
        if self.hmac_signer is not None:
            return f"hmac-{self.hmac_signer.key_id}"
        return UNSIGNED

    @property
    def signs(self) -> bool:
        """Whether the records this process publishes carry a signature (Ed25519 with a
        private key, else the HMAC secret)."""
        return (self.keys is not None and self.keys.private is not None) or (
            self.keys is None and self.hmac_signer is not None
        )

    def signing(self) -> str:
        """How this process signs and verifies records, for people (pjrt-pool cache info)."""
        if self.keys is not None:
            if self.keys.private is None:
                return (
                    f"verifies {self.signer} records; publishes none (a public key without "
                    f"{PRIVATE_KEY_FILE_ENV})"
                )
            return f"signs its records as {self.signer} (Ed25519) and reads only those"
        if self.hmac_signer is not None:
            return f"signs its records as {self.signer} (the cache's secret) and reads only those"
        return (
            "unsigned: it publishes and reads unsigned records, which hosts that require "
            f"signatures ({PUBLIC_KEY_ENV}, or a secret) never load"
        )

    def warn_if_unsigned(self) -> None:
        """Warns, once per process, that what it publishes is unsigned, if it publishes and
        signs nothing: hosts that require signatures would never load it, and say nothing."""
        if self.state == "on" and not self.signs:
            self._warnings.warn(
                "unsigned",
                f"pjrt-pool remote cache {self.location.shown}: this process publishes unsigned "
                f"records (neither {PRIVATE_KEY_FILE_ENV} nor a cache secret is set); hosts "
                f"that require signed records ({PUBLIC_KEY_ENV}, or a secret) never load them",
            )

    @property
    def counters(self) -> RemoteCounters:
        """What this tier did so far."""
        with self._lock:
            return RemoteCounters(**self._counts)

    def _count(self, name: Counter) -> None:
        with self._lock:
            self._counts[name] += 1

    def _set_state(self, state: State) -> bool:
        """Moves to state (never back from off); whether the state changed."""
        with self._lock:
            if self.state == state or self.state == "off":
                return False
            self.state = state
            return True

    def _failed(self, error: RemoteError, writing: bool) -> None:
        self._count("errors")
        if writing and error.failure is Failure.DENIED:
            self._set_state("read-only")
            self._warnings.warn(
                "read-only",
                f"pjrt-pool remote cache {self.location.shown} refused a write ({error}); "
                "reading it only, for this process",
            )
            return
        self._set_state("off")
        self._warnings.warn(
            "off",
            f"pjrt-pool remote cache {self.location.shown} switched off for this process: {error}",
        )

    def _refuse(self, key: str, why: str) -> None:
        self._count("refused")
        with self._lock:
            self._refused[key] = time.monotonic() + REFUSAL_MEMORY
        self._warnings.warn(
            f"refused {key}",
            f"pjrt-pool remote cache {self.location.shown}: refused the entry of {key}: {why}; "
            "compiling instead",
        )

    def _bad_lease(self, key: str) -> None:
        self._count("refused")
        self._warnings.warn(
            "bad lease",
            f"pjrt-pool remote cache {self.location.shown}: the lease of {key} cannot be read "
            "(malformed or oversized); taken for expired",
        )

    def lookup(self, key: str, max_size: int, *, count_miss: bool = True) -> Lookup:
        """Looks a key up: its verified entry file and entry, or why there is none."""
        if self.state == "off":
            return Lookup(Fetched.FAILED)
        if self.was_refused(key):
            return Lookup(Fetched.REFUSED)
        started = time.monotonic()
        name = record_name(key, self.signer)
        try:
            data = self.client.get(name, MAX_RECORD_SIZE, started + self.limits.deadline)
            if data is None:
                return self._missed(count_miss)
            record = checked_record(data, key, self.signer, self.keys, self.hmac_signer)
            if record.size > max_size:
                raise RefusedObjectError(
                    f"its record says {record.size} bytes, over this cache's bound {max_size}"
                )
            deadline = started + self.limits.deadline_for(record.size)
            blob = self.client.get(blob_name(record.sha256), record.size, deadline)
            if blob is None:  # a collection's race, or a lost blob: the next publish repairs it
                logger.debug("the record of %s names a missing blob %s", key, record.sha256)
                return self._missed(count_miss)
            entry = checked_entry(blob, record, self.hmac_signer)
        except OlderRecordError as error:
            shown = self.location.shown
            self._warnings.warn("older record", f"pjrt-pool remote cache {shown}: {error}")
            return self._missed(count_miss)
        except RefusedObjectError as error:
            self._refuse(key, str(error))
            return Lookup(Fetched.REFUSED)
        except RemoteError as error:
            if error.failure is Failure.TOO_LARGE:
                self._refuse(key, str(error))
                return Lookup(Fetched.REFUSED)
            self._failed(error, writing=False)
            return Lookup(Fetched.FAILED)
        self._count("hits")
        return Lookup(Fetched.HIT, blob, entry)

    def _missed(self, count: bool) -> Lookup:
        if count:
            self._count("misses")
        return Lookup(Fetched.MISS)

    def fetch(
        self, key: str, max_size: int, *, count_miss: bool = True
    ) -> tuple[bytes, entry_format.Entry] | None:
        """Returns a key's verified entry file and entry, or None (a miss of any kind: lookup
        says which)."""
        return _entry_of(self.lookup(key, max_size, count_miss=count_miss))

    def fetch_or_lead(self, key: str, max_size: int) -> tuple[bytes, entry_format.Entry] | None:
        """fetch; on a miss, takes the key's lease (None: compile) or waits for its holder."""
        found = self.lookup(key, max_size)
        if not found.missed:
            return _entry_of(found)
        return self.lead(key, max_size)

    def lead(self, key: str, max_size: int) -> tuple[bytes, entry_format.Entry] | None:
        """After a lookup that missed (Lookup.missed): takes the key's lease, and returns None
        (compile here, then publish, which ends the lease), unless the entry was published
        meanwhile; or waits for the host that holds the lease, and returns what it published
        (None: compile here after all)."""
        claim, standing = self._claim(key)
        if claim == "mine":
            return self._published_meanwhile(key, max_size)
        if claim == "theirs" and standing is not None:
            return self._wait(key, max_size, standing)
        return None

    def _published_meanwhile(
        self, key: str, max_size: int
    ) -> tuple[bytes, entry_format.Entry] | None:
        """After taking a lease: the record may have been published between the miss and the
        lease, by a holder that released its lease since: then the lease is released at once
        and not counted; else None (compile here: the lease counts)."""
        fetched = self.fetch(key, max_size, count_miss=False)
        if fetched is not None:
            self.release(key)
        else:
            self._count("leases")
        return fetched

    def _claim(self, key: str, seen: Seen | None = None) -> tuple[Claim, Lease | None]:
        """leases.claim; never raises (a failing store: none, and counted). A lease taken
        counts once its taker knows it compiles (_published_meanwhile, claim)."""
        if self.state == "off":
            return "none", None
        try:
            return self.leases.claim(key, writable=self.state == "on", seen=seen)
        except RemoteError as error:
            self._failed(error, writing=True)
            return "none", None

    def claim(self, key: str) -> Claim:
        """Takes a key's lease to compile it (counted), or finds another's standing (see
        lease.py); never raises."""
        claim = self._claim(key)[0]
        if claim == "mine":
            self._count("leases")
        return claim

    def _wait(
        self, key: str, max_size: int, lease: Lease
    ) -> tuple[bytes, entry_format.Entry] | None:
        """Waits on another host's lease of key (lease.py): for each holder in turn, at most
        MAX_HOLDERS, one patience (_wait_on). None: compile here."""
        for _ in range(MAX_HOLDERS):
            outcome = self._wait_on(key, max_size, lease)
            if not isinstance(outcome, Lease):
                return outcome
            lease = outcome  # a new holder: waited on afresh
        return None

    def _wait_on(
        self, key: str, max_size: int, lease: Lease
    ) -> tuple[bytes, entry_format.Entry] | Lease | None:
        """Polls for the record while lease's holder holds the key, for at most the lease's
        patience (this process's lease length at most: Lease.patience), looking once more at
        its end. Returns the entry; the lease of a new holder (another waiter took it over);
        or None: compile here (the lease still stands at the end, the remote failed).

        A lease that ended without a record is taken over (_claim): this
        process then compiles, unless another waiter took it first.
        """
        pause = POLL_FIRST
        give_up = time.monotonic() + lease.patience(self.leases.seconds)
        while True:
            left = give_up - time.monotonic()
            last = left <= pause
            time.sleep(max(0.0, min(pause, left)))
            pause = min(pause * 2, POLL_MAX)
            # The lease before the record: a holder writes its record before it releases, so
            # a lease read as ended, then no record, means it ended without one.
            try:
                seen = self.leases.look(key)
            except RemoteError as error:
                self._failed(error, writing=False)
                return None
            found = self.lookup(key, max_size, count_miss=False)
            if found.outcome is Fetched.HIT:
                self._count("waited")
                return _entry_of(found)
            if found.outcome is not Fetched.MISS:
                return None
            if seen.standing and seen.lease is not None:
                if seen.lease.holder != lease.holder:
                    return seen.lease
                if last:
                    return None  # its holder is slow or stuck: a second compile, not a stall
                continue
            # Its holder released it without a record (its compile failed), or died:
            # of the hosts waiting, the one that replaces that version compiles.
            claim, standing = self._claim(key, seen)
            if claim == "mine":
                fetched = self._published_meanwhile(key, max_size)
                # Published since it looked (by a holder that outlived its lease, or by a host
                # that compiled without one): a compile saved.
                if fetched is not None:
                    self._count("waited")
                return fetched
            return standing if claim == "theirs" else None

    def release(self, key: str) -> None:
        """Ends this process's lease of key, if it holds one (never raises; see lease.py)."""
        self.leases.release(key)

    def was_refused(self, key: str) -> bool:
        """Whether this process refused the key's remote entry within REFUSAL_MEMORY seconds
        (it is not fetched again meanwhile)."""
        with self._lock:
            until = self._refused.get(key)
            if until is not None and time.monotonic() >= until:
                del self._refused[key]
                until = None
            return until is not None

    def refuse(self, key: str, why: str) -> None:
        """Marks a fetched entry as unusable (the plugin rejected it): not fetched again for
        REFUSAL_MEMORY seconds."""
        self._refuse(key, why)

    def publish(self, key: str, parts: dict[str, Any], data: bytes) -> Published:
        """Writes a key's entry file (verified by the caller) and then its record; says what
        it did (a write that failed is counted and warned about, see the module docstring).

        A record there already that does not serve is mended, conditionally
        on the version read (_repair).
        """
        if self.state != "on":
            self.release(key)
            return Published.FAILED if self.state == "off" else Published.READ_ONLY
        deadline = time.monotonic() + self.limits.deadline_for(len(data))
        sha256 = hashlib.sha256(data).hexdigest()
        body = Record(key, parts, sha256, len(data), self.signer).body()
        record = encode_record(body, sign_record(body, self.keys, self.hmac_signer))
        name = record_name(key, self.signer)
        try:
            blob_written = self.client.put_new(blob_name(sha256), data, deadline).written
            if self.client.put_new(name, record, deadline).written:
                outcome = Published.WRITTEN
            else:
                outcome = self._repair(key, name, record, data, blob_written)
        except RemoteError as error:
            self._failed(error, writing=True)
            self.release(key)
            return Published.READ_ONLY if error.failure is Failure.DENIED else Published.FAILED
        self._count(_PUBLISHED_COUNTER[outcome])
        if outcome is not Published.ALREADY_THERE:
            self.warn_if_unsigned()
        if outcome is Published.REPAIRED:
            with self._lock:  # mended: what this process refused of it is served now
                self._refused.pop(key, None)
        self.release(key)
        try:  # after the record (layout.py): an index name then always has one to read
            self.client.put_new(program_index_name(parts, key), b"", deadline)
        except RemoteError as error:  # a hint for refusals only: the entry is published
            logger.debug("could not index %s under its program: %s", key, error)
        return outcome

    def _repair(
        self, key: str, name: str, record: bytes, data: bytes, blob_written: bool
    ) -> Published:
        """A record of key was there: leaves it if it serves, else mends it (REPAIRED), on the
        version read; raises RemoteError.

        It serves when a lookup would load it: the record passes every check
        a lookup makes (verify.py), and so does the blob it names, read in
        full to be checked (the price of finding a blob damaged in place; only
        on this path: a record there already). If it names this entry's own
        bytes, the blob is what is mended (written, or rewritten over the
        damaged version); else the record is replaced by this one's. A record
        of a newer format is left: this version cannot judge it.
        """
        deadline = time.monotonic() + self.limits.deadline
        found = self.client.get_versioned(name, MAX_RECORD_SIZE, deadline)
        if found is None or found.etag is None:  # gone since (a collection), or no version
            return Published.ALREADY_THERE
        existing = None
        if found.data is not None:  # else it is over the bound: no record is that large
            try:
                existing = checked_record(found.data, key, self.signer, self.keys, self.hmac_signer)
            except NewerRecordError:
                return Published.ALREADY_THERE
            except RefusedObjectError:  # an older format, damaged, or planted
                pass
        if existing is not None:
            sha256 = hashlib.sha256(data).hexdigest()
            if existing.sha256 == sha256 and blob_written:
                return Published.REPAIRED  # its blob was gone: written just now
            blob = self._blob_of(existing, len(data))
            if blob is not None and blob.data is not None:
                try:
                    checked_entry(blob.data, existing, self.hmac_signer)
                    return Published.ALREADY_THERE
                except RefusedObjectError:
                    pass
            if existing.sha256 == sha256:
                return self._rewrite_blob(sha256, data, blob)
        written = self.client.put_if_match(
            name, record, found.etag, time.monotonic() + self.limits.deadline
        )
        if not written.written:
            return Published.ALREADY_THERE  # another host mended it first
        logger.debug("replaced the record of %s, which did not serve", key)
        return Published.REPAIRED

    def _blob_of(self, record: Record, size: int) -> Versioned | None:
        """The blob a record names, read with its version (None: gone); its bytes are None
        when it is larger than the record says, or than about twice an entry of size bytes
        (the same program and build: a record that names far more is not read)."""
        bound = min(record.size, 2 * size + (1 << 20))
        deadline = time.monotonic() + self.limits.deadline_for(bound)
        return self.client.get_versioned(blob_name(record.sha256), bound, deadline)

    def _rewrite_blob(self, sha256: str, data: bytes, found: Versioned | None) -> Published:
        """Mends the blob of this entry's own bytes, which a record names and which is gone or
        damaged: conditionally on the version read."""
        name, deadline = blob_name(sha256), time.monotonic() + self.limits.deadline_for(len(data))
        if found is None:
            written = self.client.put_new(name, data, deadline)
        elif found.etag is None:
            return Published.ALREADY_THERE  # no version to replace conditionally
        else:
            written = self.client.put_if_match(name, data, found.etag, deadline)
        if not written.written:
            return Published.ALREADY_THERE  # another host mended it first
        logger.debug("rewrote the blob %s, which was gone or damaged", sha256)
        return Published.REPAIRED

    def built_elsewhere(self, key: str, parts: dict[str, Any]) -> list[tuple[str, list[str]]]:
        """The other keys the remote holds this program under, each with how its record's
        key parts differ from parts (worker.identity.keys.differing_parts); for refusals.

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


_PUBLISHED_COUNTER: dict[Published, Counter] = {
    Published.WRITTEN: "published",
    Published.REPAIRED: "repaired",
    Published.ALREADY_THERE: "already_there",
}


def _entry_of(found: Lookup) -> tuple[bytes, entry_format.Entry] | None:
    if found.data is None or found.entry is None:
        return None
    return found.data, found.entry


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
    return summed((remote.counters for remote in remotes), RemoteCounters())
