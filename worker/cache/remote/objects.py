"""What the object-store client and its backends share: objects as read, and why a request failed.

Plain records and errors, with no client library: every module of the
remote tier may import them (client.py, the backends in object_store.py and
files.py, and their callers), and a process whose lookups all hit the local
cache loads nothing more for them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from worker.cache.remote.location import redact_text
from worker.errors import PjrtPoolError


class Failure(enum.Enum):
    """Why a request gave no answer to use."""

    DENIED = "denied"
    """401/403: this process may not do that (no retry helps)."""
    MISSING = "missing"
    """The URL's bucket (or container) does not exist (no retry helps)."""
    UNAVAILABLE = "unavailable"
    """Refused, reset, timed out, throttled or failing past the retries."""
    TOO_LARGE = "too large"
    """The object is larger than the reader's bound (not read)."""


class RemoteError(PjrtPoolError):
    """A request to the remote failed; `failure` says how (the message holds no credential)."""

    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(redact_text(message))
        self.failure = failure


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its name under the prefix, its size, and when the store wrote it."""

    path: str
    size: int
    modified: float
    """Seconds since the epoch (the store's clock): objects are never rewritten, so their age."""


class ObjectVersion(NamedTuple):
    """What a HEAD request says of an object: its size and version tag."""

    size: int
    etag: str | None
    """The store's entity tag (None where the server gives none): ranged reads that name it
    are refused if the object was replaced meanwhile."""


class Versioned(NamedTuple):
    """An object read with the version it was: what a conditional replace names."""

    data: bytes | None
    """Its bytes; None when it is larger than the reader's bound (not read)."""
    etag: str | None
    """Its version tag (None where the store gives none: it cannot be replaced conditionally)."""


class Written(NamedTuple):
    """What a conditional write did."""

    written: bool
    """False: the condition failed (an object was there; another version is)."""
    etag: str | None = None
    """The version written, for the next conditional replace (None where the store gives none)."""


class Backend(Protocol):
    """One kind of store behind ObjectClient: plain calls that block and raise what they
    meet; the client runs each within its caller's deadline and turns what a call raised
    into a RemoteError through failure()."""

    def get_versioned(self, path: str, max_size: int, deadline: float) -> Versioned | None:
        """An object's bytes (None over max_size: not read) and version; None if none is
        there. Stops reading once the deadline has passed."""
        ...

    def put_new(self, path: str, data: bytes) -> Written:
        """Writes an object only if none is there."""
        ...

    def put_if_match(self, path: str, data: bytes, etag: str) -> Written:
        """Replaces an object if it is still the version etag names."""
        ...

    def delete(self, path: str) -> None:
        """Removes an object; none there is no error."""
        ...

    def list_objects(self, folder: str) -> list[ObjectInfo]:
        """Every object whose name starts with folder."""
        ...

    def head(self, path: str) -> ObjectVersion | None:
        """An object's size and tag; None if none is there."""
        ...

    def get_range(self, path: str, start: int, length: int, etag: str | None) -> bytes:
        """length bytes from start (fewer where the object ends), of the version etag names."""
        ...

    def get_tail(self, path: str, length: int) -> tuple[ObjectVersion, bytes] | None:
        """An object's size and tag with its last length bytes; None if none is there."""
        ...

    def get_ranges(self, path: str, starts: list[int], length: int, gap: int) -> list[bytes]:
        """length bytes at each start, ranges nearer than gap bytes read as one."""
        ...

    def failure(self, error: Exception, what: str) -> RemoteError:
        """The RemoteError for an exception a call raised, its message starting with what."""
        ...
