"""The object-store client: get with a size bound, create-only put, under a deadline.

One client library serves every scheme: obstore (the Rust object_store
crate), picked by scripts/pick_remote_client.py: it imports in about 13 ms
where s3fs takes about 270 ms, and a put/get round trip on the loopback is
about 2-3 times faster; both refuse a create-only put of an existing object.
obstore is imported when the first request is made, never before: a process
whose lookups all hit the local cache never loads it.

Every call runs in a daemon thread and is waited for at most the time left
to the caller's deadline, so that a server that accepts a connection and
never answers costs the deadline, not the store's own (longer) retry
schedule; within the deadline the store retries throttling (429), 5xx and
dropped connections with backoff. The request timeout (Limits.timeout)
bounds connecting and a read's stall (no byte for that long), never a whole
transfer: a large entry over a slow but steady link arrives within the
deadline its caller sized for it (Limits.deadline_for), and a read stops at
its first chunk after that deadline. Writes have no stall bound of their own
(the client's read timeout would count the upload): a stalled write costs
its deadline.

Conditional writes: put_new (create-only) and put_if_match (replace the
version a read saw; leases, record repairs). A file:// remote makes both
itself (files.py), since the store's local file system has no conditional
replace, and reads and deletes its objects there too (no link followed).
Only a failed precondition means "not written": a bucket (or container)
that does not exist is an error naming it (Failure.MISSING), on a write and
on a read alike, never "already there" or "none there".
"""

from __future__ import annotations

import datetime
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar
from urllib.parse import unquote, urlsplit

from worker.cache.remote import files
from worker.cache.remote.location import Limits, RemoteLocation, plain_http, redact_text

T = TypeVar("T")

CHUNK = 1 << 20
"""Bytes a read takes from the stream between two looks at its deadline."""
BACKSTOP = datetime.timedelta(hours=6)
"""The store's own bound on a whole request: only for one this process gave up on (its
deadline passed) and left to a daemon thread, which ends with it."""


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


def _etag(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _version(path: str, meta: Any) -> ObjectVersion:
    """The size and tag of an object's metadata; raises RemoteError if the store gave no size."""
    size = meta.get("size")
    if not isinstance(size, int) or size < 0:
        raise RemoteError(Failure.UNAVAILABLE, f"{path}: the store gave no size")
    return ObjectVersion(size, _etag(meta.get("e_tag")))


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


class RemoteError(Exception):
    """A request to the remote failed; `failure` says how (the message holds no credential)."""

    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(redact_text(message))
        self.failure = failure


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


_NO_BUCKET = ("NoSuchBucket", "ContainerNotFound", "The specified bucket does not exist")
"""What S3 (and S3-compatible servers, and GCS's XML API), Azure and GCS's JSON API answer for
a bucket or container that does not exist: a 404 the client reports as it reports a missing
object."""


def _names_no_bucket(error: BaseException) -> bool:
    text = str(error)
    return any(code in text for code in _NO_BUCKET)


class ObjectClient:
    """Reads and writes objects under a remote location's prefix."""

    def __init__(self, location: RemoteLocation, limits: Limits) -> None:
        self.location = location
        self.limits = limits
        self._stores: dict[bool, Any] = {}
        self._lock = threading.Lock()

    def _open(self, writing: bool = False) -> Any:
        """The store: one for reads, with a stall bound; one for writes, without (below)."""
        with self._lock:
            if writing not in self._stores:
                self._stores[writing] = self._make_store(writing)
            return self._stores[writing]

    def _make_store(self, writing: bool) -> Any:
        try:
            from obstore.store import from_url
        except ImportError:
            raise RemoteError(
                Failure.UNAVAILABLE,
                "the remote cache needs obstore: pip install 'pjrt-pool[remote]'",
            ) from None
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
        retry = {
            "max_retries": limits.retries,
            "retry_timeout": datetime.timedelta(seconds=limits.deadline),
            "backoff": {
                "init_backoff": datetime.timedelta(milliseconds=100),
                "max_backoff": datetime.timedelta(seconds=2),
                "base": 2,
            },
        }
        options: dict[str, Any] = {}
        if self.location.scheme == "file":
            options["mkdir"] = not self.location.read_only
        else:
            if plain_http(self.location):  # what the user configured: the store refuses http
                client["allow_http"] = True
            options["client_options"] = client
            options["retry_config"] = retry
        try:
            return from_url(self.location.url, **options)
        except Exception as error:  # obstore raises its own for bad configuration
            message = f"cannot open the store: {_first_line(error)}"
            raise RemoteError(Failure.UNAVAILABLE, message) from None

    def _file(self, path: str) -> Path:
        """Where a file:// remote keeps an object."""
        return self._root() / path

    def _no_bucket(self, what: str) -> RemoteError:
        """The error for an answer that the URL's bucket (or container) does not exist."""
        kind = "container" if self.location.scheme == "az" else "bucket"
        name = urlsplit(self.location.shown).netloc
        return RemoteError(
            Failure.MISSING,
            f"{what}: the {kind} {name!r} does not exist (the store answered 404); create it, "
            f"or name an existing {kind} in the URL",
        )

    def _root(self) -> Path:
        return Path(unquote(urlsplit(self.location.url).path))

    def _bounded(self, call: Callable[[], T], deadline: float, what: str) -> T:
        """Runs call in a daemon thread; raises RemoteError if it fails (the store's errors
        classified: _classified) or outlives deadline."""
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
            if _names_no_bucket(error):
                raise self._no_bucket(what) from None
            raise _classified(error, what) from None  # the store's own, named by what it did
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

    def get_versioned(self, path: str, max_size: int, deadline: float) -> Versioned | None:
        """Returns an object's bytes and version, None if there is none; raises RemoteError.

        An object larger than max_size is not read: its bytes are None.
        """
        if self.location.scheme == "file":
            root, local = self._root(), self._file(path)

            def read_file() -> Versioned | None:
                found = files.read_versioned(root, local, max_size)
                return None if found is None else Versioned(*found)

            return self._bounded(read_file, deadline, f"reading {path}")
        store = self._open()
        import obstore

        def call() -> Versioned | None:
            try:
                result = obstore.get(store, path)
            except FileNotFoundError as error:
                if _names_no_bucket(error):
                    raise
                return None
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

        return self._bounded(call, deadline, f"reading {path}")

    def put_new(self, path: str, data: bytes, deadline: float) -> Written:
        """Writes an object only if none is there; written False if one was.

        Raises RemoteError; "already exists" is not an error, since every
        object's name says what it holds (a digest, or a key and a signer).
        """
        if self.location.scheme == "file":
            root, local, mkdir = self._root(), self._file(path), not self.location.read_only

            def create() -> Written:
                etag = files.create(root, local, data, mkdir)
                return Written(etag is not None, etag)

            return self._bounded(create, deadline, f"writing {path}")
        return self._put(path, data, "create", deadline)

    def put_if_match(self, path: str, data: bytes, etag: str, deadline: float) -> Written:
        """Replaces an object if it is still the version etag names (If-Match); written False
        if it is gone or another version by now. Raises RemoteError."""
        if self.location.scheme == "file":
            root, local = self._root(), self._file(path)

            def replace() -> Written:
                new = files.replace_if(root, local, data, etag)
                return Written(new is not None, new)

            return self._bounded(replace, deadline, f"replacing {path}")
        return self._put(path, data, {"e_tag": etag}, deadline)

    def _put(self, path: str, data: bytes, mode: Any, deadline: float) -> Written:
        store = self._open(writing=True)
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        def call() -> Written:
            # Only a failed precondition is "not written". A 404 to a create-only put
            # (FileNotFoundError) can only mean that there is no bucket; a 404 to an
            # If-Match put is a PreconditionError, and names the bucket if it is that.
            try:
                result = obstore.put(store, path, data, mode=mode)
            except FileNotFoundError:
                raise self._no_bucket(f"writing {path}") from None
            except (AlreadyExistsError, PreconditionError) as error:
                if _names_no_bucket(error):
                    raise
                return Written(False)
            return Written(True, _etag(result.get("e_tag")))

        return self._bounded(call, deadline, f"writing {path}")

    def delete(self, path: str, deadline: float) -> None:
        """Removes an object (none there is no error); raises RemoteError."""
        if self.location.scheme == "file":  # the store's own follows links
            root, local = self._root(), self._file(path)
            self._bounded(lambda: files.delete(root, local), deadline, f"removing {path}")
            return
        store = self._open(writing=True)
        import obstore

        def call() -> None:
            try:
                obstore.delete(store, path)
            except FileNotFoundError as error:
                if _names_no_bucket(error):
                    raise

        self._bounded(call, deadline, f"removing {path}")

    def list_objects(self, folder: str, deadline: float) -> list[ObjectInfo]:
        """Every object whose name starts with folder, with sizes and write times; raises
        RemoteError. Reads only the listing, never an object (and writes nothing)."""
        store = self._open()
        import obstore

        def call() -> list[ObjectInfo]:
            found = []
            for batch in obstore.list(store, prefix=folder):
                for meta in batch:
                    modified = meta.get("last_modified")
                    stamp = modified.timestamp() if modified is not None else 0.0
                    found.append(ObjectInfo(str(meta["path"]), int(meta["size"]), stamp))
            return found

        return self._bounded(call, deadline, f"listing {folder}")

    def head(self, path: str, deadline: float) -> ObjectVersion | None:
        """Returns an object's size and entity tag, None if there is none; raises RemoteError."""
        store = self._open()
        import obstore

        def call() -> ObjectVersion | None:
            try:
                return _version(path, obstore.head(store, path))
            except FileNotFoundError as error:
                if _names_no_bucket(error):
                    raise
                return None

        return self._bounded(call, deadline, f"asking for {path}")

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
        store = self._open()
        import obstore
        from obstore.exceptions import PreconditionError

        options: dict[str, Any] = {"range": (start, start + length)}
        if etag is not None:
            options["if_match"] = etag

        def call() -> bytes:
            try:
                return bytes(obstore.get(store, path, options=options).bytes())
            except PreconditionError:
                raise RemoteError(
                    Failure.UNAVAILABLE, f"{path} changed while it was read (another version)"
                ) from None

        what = f"reading {length} bytes of {path} at {start}"
        return self._bounded(call, deadline, what)

    def get_tail(
        self, path: str, length: int, deadline: float
    ) -> tuple[ObjectVersion, bytes] | None:
        """Returns an object's size and tag with its last length bytes (all of a shorter one),
        in one request; None if there is none; raises RemoteError.

        Azure takes no suffix ranges: there it is a HEAD, then a ranged read.
        """
        if self.location.scheme == "az":
            info = self.head(path, deadline)
            if info is None:
                return None
            start = max(0, info.size - length)
            return info, self.get_range(path, start, info.size - start, deadline, info.etag)
        store = self._open()
        import obstore

        def call() -> tuple[ObjectVersion, bytes] | None:
            try:
                result = obstore.get(store, path, options={"range": {"suffix": length}})
            except FileNotFoundError as error:
                if _names_no_bucket(error):
                    raise
                return None
            version = _version(path, result.meta)
            data = bytes(result.bytes())
            if result.range[1] != version.size or len(data) != result.range[1] - result.range[0]:
                raise RemoteError(Failure.UNAVAILABLE, f"{path}: the store sent another range")
            return version, data

        what = f"reading the last {length} bytes of {path}"
        return self._bounded(call, deadline, what)

    def get_ranges(
        self, path: str, starts: list[int], length: int, deadline: float, gap: int
    ) -> list[bytes]:
        """Returns length bytes at each start, fetched concurrently, ranges nearer than gap
        bytes read as one; raises RemoteError."""
        if not starts:
            return []
        store = self._open()
        import obstore

        def call() -> list[bytes]:
            found = obstore.get_ranges(
                store, path, starts=starts, lengths=[length] * len(starts), coalesce=gap
            )
            return [bytes(part) for part in found]

        what = f"reading {len(starts)} ranges of {path}"
        return self._bounded(call, deadline, what)


def _classified(error: Exception, what: str) -> RemoteError:
    from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

    # A file:// remote's own writes (files.py) raise the OS's PermissionError.
    if isinstance(error, (PermissionDeniedError, UnauthenticatedError, PermissionError)):
        return RemoteError(Failure.DENIED, f"{what}: {_first_line(error)}")
    return RemoteError(Failure.UNAVAILABLE, f"{what}: {_first_line(error)}")
