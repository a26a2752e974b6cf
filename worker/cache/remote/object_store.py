"""The object stores a remote names by URL (s3://, gs://, az://, http(s)://), through obstore.

One client library serves every scheme: obstore (the Rust object_store
crate), which imports in a fraction of fsspec and s3fs's time (docs/facts.md,
"Start-up costs") and refuses a create-only put of an existing object.
obstore is imported here only, when the first request is made, never
before: a process whose lookups all hit the local cache never loads it.
Where it is not installed, making a backend raises MissingExtraError, naming
the extra of the URL's scheme (worker.extras).

Within the deadline its caller (ObjectClient) gives a request, the store
retries throttling (429), 5xx and dropped connections with backoff. The
request timeout (Limits.timeout) bounds connecting and a read's stall (no
byte for that long), never a whole transfer: a large entry over a slow but
steady link arrives within the deadline its caller sized for it
(Limits.deadline_for), and a read stops at its first chunk after that
deadline. Writes have no stall bound of their own (the client's read
timeout would count the upload): a stalled write costs its deadline.

Only a failed precondition means "not written": a bucket (or container)
that does not exist is an error naming it (Failure.MISSING), on a write and
on a read alike, never "already there" or "none there".
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from worker.cache.remote.location import Limits, RemoteLocation, plain_http
from worker.cache.remote.objects import (
    Failure,
    ObjectInfo,
    ObjectVersion,
    RemoteError,
    Versioned,
    Written,
)

CHUNK = 1 << 20
"""Bytes a read takes from the stream between two looks at its deadline."""
BACKSTOP = datetime.timedelta(hours=6)
"""The store's own bound on a whole request: only for one this process gave up on (its
deadline passed) and left to a daemon thread, which ends with it."""

_NO_BUCKET = ("NoSuchBucket", "ContainerNotFound", "The specified bucket does not exist")
"""What S3 (and S3-compatible servers, and GCS's XML API), Azure and GCS's JSON API answer for
a bucket or container that does not exist: a 404 the client reports as it reports a missing
object."""


def _obstore() -> Any:
    """The obstore module, with its store and exceptions modules (a backend is made only where
    obstore is installed: ObstoreBackend)."""
    import obstore
    import obstore.exceptions
    import obstore.store

    return obstore


def _etag(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _version(path: str, meta: Any) -> ObjectVersion:
    """The size and tag of an object's metadata; raises RemoteError if the store gave no size."""
    size = meta.get("size")
    if not isinstance(size, int) or size < 0:
        raise RemoteError(Failure.UNAVAILABLE, f"{path}: the store gave no size")
    return ObjectVersion(size, _etag(meta.get("e_tag")))


def first_line(error: BaseException) -> str:
    """The first line of an exception's text (at most 300 characters), or its class's name."""
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def _names_no_bucket(error: BaseException) -> bool:
    text = str(error)
    return any(code in text for code in _NO_BUCKET)


def _missing(error: FileNotFoundError) -> None:
    """For a 404 to a read: None (no such object), unless it says there is no bucket."""
    if _names_no_bucket(error):
        raise error


class ObstoreBackend:
    """A bucket of S3, GCS or an S3-compatible server (http(s)://), through obstore."""

    bucket_kind = "bucket"
    """What the store calls the URL's first part, in the error saying it does not exist."""

    def __init__(self, location: RemoteLocation, limits: Limits) -> None:
        # A missing client is this machine's set-up, said as the tier or bundle opens: not a
        # failing remote that each process would switch off with a warning.
        location.require_client()
        self.location = location
        self.limits = limits
        self._stores: dict[bool, Any] = {}
        self._lock = threading.Lock()

    def _store(self, writing: bool = False) -> Any:
        """The store: one for reads, with a stall bound; one for writes, without (below)."""
        with self._lock:
            if writing not in self._stores:
                self._stores[writing] = self._make_store(writing)
            return self._stores[writing]

    def _make_store(self, writing: bool) -> Any:
        from_url = _obstore().store.from_url
        try:
            return from_url(self.location.url, **self._store_options(writing))
        except Exception as error:  # obstore raises its own for bad configuration
            message = f"cannot open the store: {first_line(error)}"
            raise RemoteError(Failure.UNAVAILABLE, message) from None

    def _store_options(self, writing: bool) -> dict[str, Any]:
        limits = self.limits
        client: dict[str, Any] = {
            "connect_timeout": datetime.timedelta(seconds=min(limits.timeout, 5.0)),
            # The client's timeout spans a whole request, body included: a bound on
            # a transfer, which the caller's deadline (sized to the entry) is instead.
            "timeout": BACKSTOP,
        }
        if not writing:
            # Reset by every read: a stall, never a slow transfer. It runs from the
            # request's start to its answer, so it would count an upload: reads only.
            client["read_timeout"] = datetime.timedelta(seconds=limits.timeout)
        if plain_http(self.location):  # what the user configured: the store refuses http
            client["allow_http"] = True
        retry = {
            "max_retries": limits.retries,
            "retry_timeout": datetime.timedelta(seconds=limits.deadline),
            "backoff": {
                "init_backoff": datetime.timedelta(milliseconds=100),
                "max_backoff": datetime.timedelta(seconds=2),
                "base": 2,
            },
        }
        return {"client_options": client, "retry_config": retry}

    def _no_bucket(self, what: str) -> RemoteError:
        """The error for an answer that the URL's bucket (or container) does not exist."""
        kind = self.bucket_kind
        name = urlsplit(self.location.shown).netloc
        return RemoteError(
            Failure.MISSING,
            f"{what}: the {kind} {name!r} does not exist (the store answered 404); create it, "
            f"or name an existing {kind} in the URL",
        )

    def failure(self, error: Exception, what: str) -> RemoteError:
        """The store's own error, named by what it did: denied (401/403), missing (no such
        bucket) or unavailable."""
        if _names_no_bucket(error):
            return self._no_bucket(what)
        # A file:// remote's own reads and writes (files.py) raise the OS's PermissionError;
        # an error of obstore's own can only come once obstore was imported.
        denied: tuple[type[BaseException], ...] = (PermissionError,)
        exceptions = sys.modules.get("obstore.exceptions")
        if exceptions is not None:
            denied += (exceptions.PermissionDeniedError, exceptions.UnauthenticatedError)
        failure = Failure.DENIED if isinstance(error, denied) else Failure.UNAVAILABLE
        return RemoteError(failure, f"{what}: {first_line(error)}")

    def get_versioned(self, path: str, max_size: int, deadline: float) -> Versioned | None:
        """See Backend.get_versioned."""
        store, obstore = self._store(), _obstore()
        try:
            result = obstore.get(store, path)
        except FileNotFoundError as error:
            return _missing(error)
        size, etag = _version(path, result.meta)
        if size > max_size:
            return Versioned(None, etag)
        chunks = []
        for chunk in result.stream(min_chunk_size=CHUNK):
            if time.monotonic() > deadline:  # the caller gave up: stop the transfer
                raise RemoteError(Failure.UNAVAILABLE, f"{path}: past the deadline")
            chunks.append(chunk)
        data = b"".join(chunks)
        if len(data) != size:
            raise RemoteError(Failure.UNAVAILABLE, f"{path}: {len(data)} of {size} bytes")
        return Versioned(data, etag)

    def put_new(self, path: str, data: bytes) -> Written:
        """See Backend.put_new."""
        return self._put(path, data, "create")

    def put_if_match(self, path: str, data: bytes, etag: str) -> Written:
        """See Backend.put_if_match."""
        return self._put(path, data, {"e_tag": etag})

    def _put(self, path: str, data: bytes, mode: Any) -> Written:
        store, obstore = self._store(writing=True), _obstore()
        not_written = (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError)
        # Only a failed precondition is "not written". A 404 to a create-only put
        # (FileNotFoundError) can only mean that there is no bucket; a 404 to an
        # If-Match put is a PreconditionError, and names the bucket if it is that.
        try:
            result = obstore.put(store, path, data, mode=mode)
        except FileNotFoundError:
            raise self._no_bucket(f"writing {path}") from None
        except not_written as error:
            if _names_no_bucket(error):
                raise
            return Written(False)
        return Written(True, _etag(result.get("e_tag")))

    def delete(self, path: str) -> None:
        """See Backend.delete."""
        store, obstore = self._store(writing=True), _obstore()
        try:
            obstore.delete(store, path)
        except FileNotFoundError as error:
            _missing(error)

    def list_objects(self, folder: str) -> list[ObjectInfo]:
        """See Backend.list_objects."""
        store, obstore = self._store(), _obstore()
        found = []
        for batch in obstore.list(store, prefix=folder):
            for meta in batch:
                modified = meta.get("last_modified")
                stamp = modified.timestamp() if modified is not None else 0.0
                found.append(ObjectInfo(str(meta["path"]), int(meta["size"]), stamp))
        return found

    def head(self, path: str) -> ObjectVersion | None:
        """See Backend.head."""
        store, obstore = self._store(), _obstore()
        try:
            return _version(path, obstore.head(store, path))
        except FileNotFoundError as error:
            return _missing(error)

    def get_range(self, path: str, start: int, length: int, etag: str | None) -> bytes:
        """See Backend.get_range: a store that holds another version than etag by now
        answers with a failed precondition, raised as RemoteError(UNAVAILABLE)."""
        store, obstore = self._store(), _obstore()
        options: dict[str, Any] = {"range": (start, start + length)}
        if etag is not None:
            options["if_match"] = etag
        try:
            return bytes(obstore.get(store, path, options=options).bytes())
        except obstore.exceptions.PreconditionError:
            raise RemoteError(
                Failure.UNAVAILABLE, f"{path} changed while it was read (another version)"
            ) from None

    def get_tail(self, path: str, length: int) -> tuple[ObjectVersion, bytes] | None:
        """See Backend.get_tail: one request, for a suffix range."""
        store, obstore = self._store(), _obstore()
        try:
            result = obstore.get(store, path, options={"range": {"suffix": length}})
        except FileNotFoundError as error:
            return _missing(error)
        version = _version(path, result.meta)
        data = bytes(result.bytes())
        if result.range[1] != version.size or len(data) != result.range[1] - result.range[0]:
            raise RemoteError(Failure.UNAVAILABLE, f"{path}: the store sent another range")
        return version, data

    def get_ranges(self, path: str, starts: list[int], length: int, gap: int) -> list[bytes]:
        """See Backend.get_ranges: fetched concurrently."""
        store, obstore = self._store(), _obstore()
        lengths = [length] * len(starts)
        found = obstore.get_ranges(store, path, starts=starts, lengths=lengths, coalesce=gap)
        return [bytes(part) for part in found]


class AzureBackend(ObstoreBackend):
    """An Azure Blob Storage container (az://): it takes no suffix ranges."""

    bucket_kind = "container"

    def get_tail(self, path: str, length: int) -> tuple[ObjectVersion, bytes] | None:
        """See Backend.get_tail: a HEAD, then a ranged read of that version."""
        info = self.head(path)
        if info is None:
            return None
        start = max(0, info.size - length)
        return info, self.get_range(path, start, info.size - start, info.etag)
