"""The object-store client: get with a size bound, conditional puts, each under a deadline.

ObjectClient is what the remote tier, its leases, its collection and remote
bundles call; behind it is one backend per kind of store, each the same
interface (objects.Backend): object_store.py for the stores obstore serves
(S3, GCS, S3-compatible servers over http(s); Azure, which takes no suffix
ranges), files.py for a file:// remote, which makes its conditional writes
itself, since the store's local file system has no conditional replace,
and reads and deletes its objects there too (no link followed).

Every call runs in a daemon thread and is waited for at most the time left
to the caller's deadline, so that a server that accepts a connection and
never answers costs the deadline, not the store's own (longer) retry
schedule. Whatever a backend raises comes out as a RemoteError whose
failure says how it failed (objects.Failure) and whose message holds no
credential.

Conditional writes: put_new (create-only) and put_if_match (replace the
version a read saw; leases, record repairs). Only a failed precondition
means "not written": a bucket (or container) that does not exist is an
error naming it (Failure.MISSING), on a write and on a read alike, never
"already there" or "none there".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from worker.cache.remote import objects
from worker.cache.remote.files import FileBackend
from worker.cache.remote.location import Limits, RemoteLocation
from worker.cache.remote.object_store import AzureBackend, ObstoreBackend
from worker.cache.remote.objects import Failure, RemoteError

T = TypeVar("T")

_BACKENDS: dict[str, Callable[[RemoteLocation, Limits], objects.Backend]] = {
    "file": FileBackend,
    "az": AzureBackend,
}
"""The backend of each scheme that is not obstore's plain one (ObstoreBackend)."""


def backend_for(location: RemoteLocation, limits: Limits) -> objects.Backend:
    """The backend for a remote location's kind of store."""
    return _BACKENDS.get(location.scheme, ObstoreBackend)(location, limits)


class ObjectClient:
    """Reads and writes objects under a remote location's prefix, each call within a deadline."""

    def __init__(self, location: RemoteLocation, limits: Limits) -> None:
        self.location = location
        self.limits = limits
        self._backend = backend_for(location, limits)

    def _within_deadline(self, call: Callable[[], T], deadline: float, what: str) -> T:
        """Runs call in a daemon thread; raises RemoteError if it fails (the backend's own
        errors named by what it did: objects.Backend.failure) or outlives deadline."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise RemoteError(Failure.UNAVAILABLE, f"{what}: the lookup's deadline passed")
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = call()
            except BaseException as error:
                box["error"] = error
            finally:
                done.set()

        threading.Thread(target=run, name="pjrt-pool-remote", daemon=True).start()
        if not done.wait(left):
            raise RemoteError(Failure.UNAVAILABLE, f"{what}: no answer within the deadline")
        error = box.get("error")
        if isinstance(error, Exception) and not isinstance(error, RemoteError):
            raise self._backend.failure(error, what) from None
        if error is not None:
            raise error
        return box["value"]

    def get(self, path: str, max_size: int, deadline: float) -> bytes | None:
        """Returns an object's bytes, None if there is none; raises RemoteError.

        An object larger than max_size raises RemoteError(TOO_LARGE) after
        its size was read and before its body is.
        """
        found = self.get_versioned(path, max_size, deadline)
        if found is None:
            return None
        if found.data is None:
            raise RemoteError(Failure.TOO_LARGE, f"{path} is over {max_size} bytes")
        return found.data

    def get_versioned(self, path: str, max_size: int, deadline: float) -> objects.Versioned | None:
        """Returns an object's bytes and version, None if there is none; raises RemoteError.

        An object larger than max_size is not read: its bytes are None.
        """
        call = partial(self._backend.get_versioned, path, max_size, deadline)
        return self._within_deadline(call, deadline, f"reading {path}")

    def put_new(self, path: str, data: bytes, deadline: float) -> objects.Written:
        """Writes an object only if none is there; written False if one was.

        Raises RemoteError; "already exists" is not an error, since every
        object's name says what it holds (a digest, or a key and a signer).
        """
        call = partial(self._backend.put_new, path, data)
        return self._within_deadline(call, deadline, f"writing {path}")

    def put_if_match(self, path: str, data: bytes, etag: str, deadline: float) -> objects.Written:
        """Replaces an object if it is still the version etag names (If-Match); written False
        if it is gone or another version by now. Raises RemoteError."""
        call = partial(self._backend.put_if_match, path, data, etag)
        return self._within_deadline(call, deadline, f"replacing {path}")

    def delete(self, path: str, deadline: float) -> None:
        """Removes an object (none there is no error); raises RemoteError."""
        self._within_deadline(partial(self._backend.delete, path), deadline, f"removing {path}")

    def list_objects(self, folder: str, deadline: float) -> list[objects.ObjectInfo]:
        """Every object whose name starts with folder, with sizes and write times; raises
        RemoteError. Reads only the listing, never an object (and writes nothing)."""
        call = partial(self._backend.list_objects, folder)
        return self._within_deadline(call, deadline, f"listing {folder}")

    def head(self, path: str, deadline: float) -> objects.ObjectVersion | None:
        """Returns an object's size and entity tag, None if there is none; raises RemoteError."""
        call = partial(self._backend.head, path)
        return self._within_deadline(call, deadline, f"asking for {path}")

    def get_range(
        self, path: str, start: int, length: int, deadline: float, etag: str | None = None
    ) -> bytes:
        """Returns length bytes of an object from start (fewer where it ends); raises RemoteError.

        With etag, a store that holds another version of the object by now
        answers with a failed precondition, raised as RemoteError(UNAVAILABLE)
        saying the object changed: the caller never mixes two versions.
        """
        if length <= 0:
            return b""
        call = partial(self._backend.get_range, path, start, length, etag)
        what = f"reading {length} bytes of {path} at {start}"
        return self._within_deadline(call, deadline, what)

    def get_tail(
        self, path: str, length: int, deadline: float
    ) -> tuple[objects.ObjectVersion, bytes] | None:
        """Returns an object's size and tag with its last length bytes (all of a shorter one),
        in one request where the store takes suffix ranges; None if there is none; raises
        RemoteError."""
        call = partial(self._backend.get_tail, path, length)
        what = f"reading the last {length} bytes of {path}"
        return self._within_deadline(call, deadline, what)

    def get_ranges(
        self, path: str, starts: list[int], length: int, deadline: float, gap: int
    ) -> list[bytes]:
        """Returns length bytes at each start, fetched concurrently, ranges nearer than gap
        bytes read as one; raises RemoteError."""
        if not starts:
            return []
        call = partial(self._backend.get_ranges, path, starts, length, gap)
        what = f"reading {len(starts)} ranges of {path}"
        return self._within_deadline(call, deadline, what)
