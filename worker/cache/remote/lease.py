"""Leases: one compile of a key across the hosts that share a remote.

The first host to miss a key writes ``leases/<key>.json`` create-only,
saying who holds it and until when (the wall clock of the holder plus
LEASE_ENV seconds). Another host that misses the same key finds the lease
and, instead of compiling, waits for the key's record while the lease
stands, polling with backoff; when the record appears it fetches it (a
compile saved), and when the lease is gone or expired without one it
compiles itself. The holder removes its lease once it published the record
(or failed to compile); a lease of a host that died expires, is removed by
the next host that finds it so, and is taken afresh, create-only.

Correctness never depends on a lease: a remote entry is verified wherever
it came from, and two hosts that both compile (a takeover race, clocks
apart, a store whose create-only check is not atomic) only do the work
twice, and publish create-only.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Literal

from worker.cache.key import check_key
from worker.cache.remote.location import seconds_from_environment
from worker.untrusted import parse_json

LEASE_ENV = "PJRT_POOL_CACHE_REMOTE_LEASE"
"""Seconds a lease stands (default DEFAULT_LEASE): how long others wait for one compile."""
DEFAULT_LEASE = 120.0
MAX_LEASE_SIZE = 4096
POLL_FIRST = 0.1
POLL_MAX = 2.0

Claim = Literal["mine", "theirs", "none"]
"""mine: this process holds the key's lease and compiles; theirs: another does, wait;
none: no lease could be had or found (read-only, or the store failed): compile."""


def lease_name(key: str) -> str:
    """The object name of a key's lease."""
    return f"leases/{check_key(key)}.json"


def lease_seconds() -> float:
    """PJRT_POOL_CACHE_REMOTE_LEASE, else DEFAULT_LEASE; raises ValueError if malformed."""
    return seconds_from_environment(LEASE_ENV, DEFAULT_LEASE)


@dataclass(frozen=True)
class Lease:
    """Who holds a key's lease, and until when (seconds since the epoch, the holder's clock)."""

    key: str
    holder: str
    expires: float

    def encode(self) -> bytes:
        """The lease's JSON bytes."""
        fields = {"format": 1, "key": self.key, "holder": self.holder, "expires": self.expires}
        return json.dumps(fields, sort_keys=True).encode()

    def expired(self, now: float | None = None) -> bool:
        """Whether the lease no longer stands."""
        return (time.time() if now is None else now) >= self.expires


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
    holder, expires = fields.get("holder"), fields.get("expires")
    if not isinstance(holder, str) or isinstance(expires, bool):
        return None
    if not isinstance(expires, (int, float)):
        return None
    return Lease(key, holder, float(expires))


def holder_name() -> str:
    """Names this process for the leases it takes: host, pid and a random tag."""
    return f"{os.uname().nodename}:{os.getpid()}:{os.urandom(4).hex()}"
