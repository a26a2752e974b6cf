"""What one process's remote tier reports: its counters, what each lookup found and what
each publish did (RemoteCache, tier.py, says them; the compile tiers and transfer.py
act on them).
"""

from __future__ import annotations

import enum
from typing import Literal, NamedTuple

from worker.cache import entry as entry_format


class RemoteCounters(NamedTuple):
    """What one process's remote tier did (RemoteCache.counters)."""

    hits: int = 0
    """Entries fetched, verified and handed to the local cache."""
    misses: int = 0
    """Lookups that found no record for the key (or one naming a blob that is gone, or of an
    older format)."""
    refused: int = 0
    """Objects that failed a check (size, digest, key parts, signature; an unreadable lease):
    not used."""
    errors: int = 0
    """Requests that failed (refused, reset, timed out, throttled, denied)."""
    published: int = 0
    """Entries this process wrote (blob and record)."""
    already_there: int = 0
    """Publishes that found the record written already (by another host): nothing written."""
    leases: int = 0
    """Leases this process took (or took over): keys it compiled while other hosts waited."""
    waited: int = 0
    """Compiles saved: entries fetched after waiting for another host's lease."""
    repaired: int = 0
    """Publishes that mended a record that did not serve (its blob gone or damaged, itself
    damaged or planted, of an older format): replaced it, or the blob it names."""

    def add(self, other: RemoteCounters) -> RemoteCounters:
        """Returns the sum of two counters."""
        return RemoteCounters(*(a + b for a, b in zip(self, other, strict=True)))


Counter = Literal[
    "hits",
    "misses",
    "refused",
    "errors",
    "published",
    "already_there",
    "leases",
    "waited",
    "repaired",
]
"""The names of RemoteCounters' fields."""

State = Literal["on", "read-only", "off"]


class Fetched(enum.Enum):
    """What one lookup found."""

    HIT = "hit"
    """The entry, verified."""
    MISS = "miss"
    """No record of the key (or one naming a blob that is gone, or of an older format)."""
    REFUSED = "refused"
    """An object failed a check, now or within REFUSAL_MEMORY: not used."""
    FAILED = "failed"
    """The remote failed, now or before (it is off for the process)."""


class Lookup(NamedTuple):
    """A lookup's outcome, with the entry file and entry of a hit."""

    outcome: Fetched
    data: bytes | None = None
    entry: entry_format.Entry | None = None

    @property
    def missed(self) -> bool:
        """Whether the remote has no entry of the key (not one refused, not a failure): what
        a host that compiles on a miss may take the key's lease after (RemoteCache.lead)."""
        return self.outcome is Fetched.MISS


class Published(enum.Enum):
    """What one publish did."""

    WRITTEN = "written"
    """Its blob and record written."""
    REPAIRED = "repaired"
    """A record that did not serve (its blob gone or damaged, itself damaged or planted, of an
    older format) mended: replaced by this one's, or the blob it names rewritten."""
    ALREADY_THERE = "already there"
    """The record was there (written by another host): nothing written."""
    READ_ONLY = "read-only"
    """Not written: this process may not write the remote (read-only, a 403, no private key)."""
    FAILED = "failed"
    """Not written: the remote failed (now, or before: it is off for the process)."""
