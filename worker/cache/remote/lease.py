"""Leases: one compile of a key across the hosts that share a remote.

The first host to miss a key writes ``leases/<key>.json`` create-only,
saying who holds it and until when (the wall clock of the holder plus
LEASE_ENV seconds), and renews it (extends its expiry) while it compiles,
every third of that, so that a compile longer than a lease does not run
twice. Another host that misses the same key finds the lease and, instead of
compiling, waits for the key's record while the lease stands, polling with
backoff; when the record appears it fetches it (a compile saved).

Every change to a lease after its creation is conditional on the version
its writer read (If-Match on its ETag; files.py for file://), so that of
hosts racing for one lease exactly one wins, and nobody ever changes a lease
it did not read:

- a lease that expired (its holder died, or stopped renewing after
  MAX_HOLD), or one that cannot be read (garbage, oversized: counted and
  warned about), is taken over by the first waiter to replace that version;
  the others go on waiting, now for the new holder, afresh;
- the holder releases its lease after publishing (or when its compile
  fails) by replacing its own version with one that has expired: a holder
  whose lease was taken over meanwhile changes nothing;
- nothing deletes a lease but ``pjrt-pool cache gc --remote`` (eviction.py),
  and only one that expired long ago.

A waiter waits for each holder at most one lease length of its own
(LEASE_ENV), never longer whatever a lease says: leases are unsigned, and
anyone who can write the bucket can write one (a lease that names the
compile time its holder expects, which this version never writes, only
shortens that, to about twice it). A holder whose lease ends without a
record (it died, or its compile failed) is taken over at the latest at the
end of that wait; a waiter that loses the race waits on the winner afresh,
so of the hosts waiting one compiles and the others fetch. A waiter
compiles itself when a lease still stands at the end of its wait, or after
MAX_HOLDERS holders: a slow or stuck holder costs a second compile, never
a stall longer than MAX_HOLDERS lease lengths. Correctness never
depends on a lease: a remote entry is verified wherever it came from, and
two hosts that both compile (clocks apart, a store whose conditional writes
are not atomic) only do the work twice, and publish create-only.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

from worker.cache.remote.client import ObjectClient
from worker.cache.remote.location import Limits, seconds_from_environment
from worker.cache.remote.objects import RemoteError
from worker.identity.keys import check_key, is_key
from worker.log import get_logger
from worker.untrusted import parse_json

logger = get_logger("pjrt_pool.cache")

LEASE_ENV = "PJRT_POOL_CACHE_REMOTE_LEASE"
"""Seconds a lease stands unrenewed (default DEFAULT_LEASE): how long a dead holder blocks."""
DEFAULT_LEASE = 120.0
MAX_LEASE_SIZE = 4096
POLL_FIRST = 0.1
POLL_MAX = 2.0
MAX_HOLD = 3600.0
"""Seconds a holder renews its lease for at most: a compile longer than that is taken for
stuck, and the hosts waiting for it compile themselves once the lease expires."""
TAKE_TRIES = 3
"""Races for one lease a claim takes part in before it gives up (and compiles)."""
MAX_HOLDERS = 3
"""Holders of one key a waiter waits on in turn (a dead one, the waiter that took it over,
...), one lease length each, before it compiles itself."""

Claim = Literal["mine", "theirs", "none"]
"""mine: this process holds the key's lease and compiles; theirs: another does, wait;
none: no lease could be had or found (read-only, or the store failed): compile."""


def lease_name(key: str) -> str:
    """The object name of a key's lease."""
    return f"leases/{check_key(key)}.json"


def parse_lease_name(name: str) -> str | None:
    """The key a listed lease's name, ``leases/<key>.json``, is for, or None."""
    folder, _, file = name.partition("/")
    key = file.removesuffix(".json")
    return key if folder == "leases" and key != file and is_key(key) else None


def lease_seconds() -> float:
    """PJRT_POOL_CACHE_REMOTE_LEASE, else DEFAULT_LEASE; raises ValueError if malformed."""
    return seconds_from_environment(LEASE_ENV, DEFAULT_LEASE)


@dataclass(frozen=True)
class Lease:
    """Who holds a key's lease, and until when (seconds since the epoch, the holder's clock)."""

    key: str
    holder: str
    expires: float
    expected: float | None = None
    """Seconds the holder expects its compile to take, if its lease says (see patience). This
    version writes none (nothing here knows a compile's time before it ends); one it reads
    only shortens a wait."""

    def encode(self) -> bytes:
        """The lease's JSON bytes."""
        fields = {"format": 1, "key": self.key, "holder": self.holder, "expires": self.expires}
        if self.expected is not None:
            fields["expected"] = self.expected
        return json.dumps(fields, sort_keys=True).encode()

    def expired(self, now: float | None = None) -> bool:
        """Whether the lease no longer stands (it expired, or its holder released it)."""
        return (time.time() if now is None else now) >= self.expires

    def patience(self, longest: float) -> float:
        """Seconds a host waits for the record while this lease stands: `longest` (the
        waiter's own lease length: a compile is expected to take at most one lease), or
        about twice the compile time the holder expects where that is shorter; then it
        compiles itself. Never longer than `longest`, whatever the lease says."""
        if self.expected is None:
            return longest
        return min(longest, 2 * self.expected + POLL_MAX)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def decode_lease(data: bytes, key: str) -> Lease | None:
    """Parses a lease read for key; None for anything malformed (treated as expired)."""
    if len(data) > MAX_LEASE_SIZE:
        return None
    try:
        fields = parse_json(data)
    except ValueError:
        return None
    if not isinstance(fields, dict) or fields.get("key") != key:
        return None
    holder, expires, expected = fields.get("holder"), fields.get("expires"), fields.get("expected")
    if not isinstance(holder, str) or not _number(expires):
        return None
    if expected is not None and not (_number(expected) and expected > 0):
        return None
    return Lease(key, holder, float(expires), None if expected is None else float(expected))


def holder_name() -> str:
    """Names this process for the leases it takes: host, pid and a random tag."""
    return f"{os.uname().nodename}:{os.getpid()}:{os.urandom(4).hex()}"


class Seen(NamedTuple):
    """A key's lease object as read: whether there is one, what it says, and its version."""

    exists: bool
    lease: Lease | None = None
    """None when there is none, or it cannot be read (then it counts as expired)."""
    etag: str | None = None

    @property
    def standing(self) -> bool:
        """Whether a readable lease is there and has not expired."""
        return self.lease is not None and not self.lease.expired()


class _Held:
    """A lease this process holds: its last version, and the renewer's stop signal."""

    def __init__(self, lease: Lease, etag: str) -> None:
        self.lease = lease
        self.etag = etag
        self.lock = threading.Lock()
        """Held while the lease is rewritten (renewed or released): one writer at a time."""
        self.done = threading.Event()


class Leases:
    """One process's leases on one remote: reads others', takes, renews and releases its own.

    Raises RemoteError where the store fails (the caller counts it);
    unreadable is a bad lease, reported to `bad` (key) and taken over.
    """

    def __init__(
        self, client: ObjectClient, limits: Limits, seconds: float, bad: Callable[[str], None]
    ) -> None:
        self.client = client
        self.limits = limits
        self.seconds = seconds
        """How long a lease this process takes stands unrenewed (PJRT_POOL_CACHE_REMOTE_LEASE)."""
        self.holder = holder_name()
        self._bad = bad
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def _deadline(self) -> float:
        return time.monotonic() + self.limits.deadline

    def look(self, key: str) -> Seen:
        """Reads a key's lease."""
        found = self.client.get_versioned(lease_name(key), MAX_LEASE_SIZE, self._deadline())
        if found is None:
            return Seen(False)
        lease = None if found.data is None else decode_lease(found.data, key)
        if lease is None:
            self._bad(key)
        return Seen(True, lease, found.etag)

    def claim(
        self, key: str, *, writable: bool, seen: Seen | None = None
    ) -> tuple[Claim, Lease | None]:
        """Takes a key's lease (mine), or finds another's standing (theirs, with it).

        A new lease is written create-only; one that expired or cannot be
        read is taken over by replacing the version read (seen, when the
        caller read it already). A process that does not write only looks.
        """
        for _ in range(TAKE_TRIES):
            if seen is None or not seen.exists:
                if writable and self._write(key, None):
                    return "mine", None
                seen = self.look(key)
                if not seen.exists:
                    if not writable:
                        return "none", None
                    continue  # removed since (a collection): create it again
            if seen.standing:
                return "theirs", seen.lease
            if not writable or seen.etag is None:
                return "none", None
            if self._write(key, seen.etag):
                return "mine", None
            seen = None  # another host took it over first: see whose it is now
        return "none", None

    def _write(self, key: str, etag: str | None) -> bool:
        """Writes this process's lease: create-only (etag None) or over the version etag."""
        lease = Lease(key, self.holder, time.time() + self.seconds)
        name, deadline = lease_name(key), self._deadline()
        if etag is None:
            written = self.client.put_new(name, lease.encode(), deadline)
        else:
            written = self.client.put_if_match(name, lease.encode(), etag, deadline)
        if not written.written:
            return False
        if written.etag is not None:  # else it cannot be changed safely: it expires on its own
            held = _Held(lease, written.etag)
            with self._lock:
                self._held[key] = held
            renewer = threading.Thread(
                target=self._renew, args=(key, held), name="pjrt-pool-lease", daemon=True
            )
            renewer.start()
        return True

    def _rewrite(self, key: str, held: _Held, expires: float) -> bool:
        """Replaces the held version with one expiring at expires; False if it is not ours any
        more (taken over after it expired) or the store failed. Call with held.lock."""
        lease = replace(held.lease, expires=expires)
        try:
            written = self.client.put_if_match(
                lease_name(key), lease.encode(), held.etag, self._deadline()
            )
        except RemoteError as error:
            logger.debug("could not rewrite the lease of %s: %s", key, error)
            return False
        if not written.written or written.etag is None:
            return False
        held.lease, held.etag = lease, written.etag
        return True

    def _renew(self, key: str, held: _Held) -> None:
        """Extends a held lease every third of its time, for at most MAX_HOLD, until released."""
        stop = time.monotonic() + MAX_HOLD
        while not held.done.wait(self.seconds / 3) and time.monotonic() < stop:
            with held.lock:
                if held.done.is_set() or not self._rewrite(key, held, time.time() + self.seconds):
                    return

    def holds(self, key: str) -> bool:
        """Whether this process holds a key's lease (took it, and has not released it)."""
        with self._lock:
            return key in self._held

    def release(self, key: str) -> None:
        """Ends this process's lease of key, if it holds one: replaces its own version with an
        expired one, so that the next host takes it over; never raises."""
        with self._lock:
            held = self._held.pop(key, None)
        if held is None:
            return
        with held.lock:
            held.done.set()
            self._rewrite(key, held, time.time())
