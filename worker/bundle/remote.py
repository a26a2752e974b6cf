"""Reading a bundle at a URL (s3://, gs://, az://, file://, http(s)://) with ranged reads.

RemoteArchive has the interface of container.Archive, so Bundle checks a
bundle at a URL as it checks a file; what differs is what is read when:

- Opening: one ranged read of the object's last 64 KiB, which also gives
  its size and entity tag (every later read names the tag, so two versions
  of the object are never mixed; on Azure, which takes no suffix ranges, a
  HEAD comes first); an index that does not fit costs one more read of the
  missing part (four times as long, up to what the largest index needs). pjrt-pool writes members
  sorted by name, so the end holds index.json, index.mac and tar's zero
  padding: their headers are checked (checksum, ustar magic, regular file)
  and the padding must be zeros. Then the index is read as a file's is
  (index.open_index: with a secret, its MAC is checked over its raw bytes
  before it is parsed), and the offset of every member is computed from
  it: entries/<key>.pjx in name order, then index.json and index.mac. The
  bundle is refused unless the index and its MAC lie exactly where that
  layout puts them and the layout ends where the object does, so a member
  added, removed or resized anywhere shifts the index and is refused at
  once, before any entry is read.
- Reading an entry: its 512-byte tar header is read in the same request as
  its first bytes (up to the largest entry header, 1 MiB) and checked
  before any of it is used: checksum, magic, regular file, and exactly the
  name and size the layout gives. The rest of the entry follows in ranges
  of at most 16 MiB, after Bundle has checked the entry's own header and
  sizes. So a member's header is checked when the member is first read:
  an entry that is never used costs no request, and a bundle whose used
  entries and index pass gives exactly what a local reader would. bundle
  import (which reads every entry) thereby checks every header, and bundle
  check reads all the others too (check_headers: concurrent ranged reads,
  64 headers at a time), so that it refuses what a check of the file
  refuses.

Every read lies inside the object's size (taken before anything is read),
and memory holds the end read at open plus one member. A request that
fails, or outlives PJRT_POOL_CACHE_REMOTE_DEADLINE (the remote tier's
limits), raises BundleError naming the URL without its credentials.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

from worker.bundle.container import (
    BLOCK,
    MAX_MEMBERS,
    MAX_TRAILER,
    Member,
    archive_size,
    parse_header,
    wrong_size,
)
from worker.bundle.index import (
    INDEX_NAME,
    MAC_NAME,
    MAX_INDEX_SIZE,
    MAX_MAC_SIZE,
    Index,
    member_name,
    open_index,
)
from worker.cache import entry as entry_format
from worker.cache.remote.client import ObjectClient
from worker.cache.remote.location import Limits, parse_remote, redact
from worker.cache.remote.objects import ObjectVersion, RemoteError
from worker.cache.signing import Signer
from worker.errors import BundleError

_FIRST_TAIL = 64 << 10
"""Bytes read from the object's end at first: the index of about 50 programs (a larger one
costs one more read, by quadrupling)."""
_MAX_TAIL = MAX_INDEX_SIZE + 3 * BLOCK + MAX_MAC_SIZE + MAX_TRAILER
"""The end that holds the largest index, its MAC and the padding."""
_WINDOW = entry_format.MAX_HEADER_SIZE
"""Bytes of an entry read with its tar header: its whole entry header, whatever its size."""
_CHUNK = 16 << 20
"""Bytes per ranged read of the rest of a member (what one read holds in memory)."""
_HEADER_BATCH = 64
_HEADER_GAP = 64 << 10
"""check_headers reads the headers of 64 members at a time, and two nearer than this as one."""
_MAGIC = b"ustar\x0000"
_T = TypeVar("_T")


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _split(url: str) -> tuple[ObjectClient, str, str]:
    """The client of the URL's folder, the object's name in it, and the URL for messages."""
    shown = redact(url)
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise BundleError(
            f"{shown}: a bundle URL with a query (a presigned URL) is not supported: give the "
            "store's own URL (s3://bucket/app.bundle) and its credentials through its environment"
        )
    folder, _, name = parts.path.rpartition("/")
    if not name:
        raise BundleError(f"{shown} names a folder, not a bundle: end it with the bundle's name")
    try:
        location = parse_remote(
            urlunsplit((parts.scheme, parts.netloc, folder + "/", "", "")), read_only=True
        )
        limits = Limits.from_environment()
    except ValueError as error:
        raise BundleError(f"bundle {shown}: {error}") from None
    return ObjectClient(location, limits), name, shown


class RemoteArchive:
    """A bundle's archive at a URL, read by ranges (see the module docstring)."""

    def __init__(self, url: str, signer: Signer | None = None) -> None:
        self.client, self._name, self.path = _split(url)
        self._signer = signer
        self.index_bytes = b""
        """index.json's bytes, read at open (index.open_index: its MAC checked first)."""
        self.index: Index
        """The index, decoded at open: it gives the layout."""
        self._lock = threading.Lock()
        self._closed = False
        self._window: tuple[str, bytes] | None = None  # the member read last: its first bytes
        self._checked: set[str] = set()  # members whose tar header was checked
        self.requests = 0
        """Reads from the store so far (on Azure the first is two requests: a HEAD, a GET)."""
        self.bytes_read = 0
        """Bytes received so far (of check_headers' reads, the headers only)."""
        deadline = self._deadline()
        found = self._call(
            lambda: self.client.get_tail(self._name, _FIRST_TAIL, deadline), "cannot reach it"
        )
        if found is None:
            raise BundleError(f"bundle {self.path} does not exist")
        self._info: ObjectVersion = found[0]
        self.size = self._info.size
        self.bytes_read += len(found[1])
        if self.size < 2 * BLOCK:
            raise BundleError(
                f"{self.path} is {self.size} bytes: too short to be a bundle (truncated?)"
            )
        self._tail_start, self._tail = self._read_end(found[1], deadline)
        self.members = self._layout()

    def close(self) -> None:
        """Forgets what was read (reading members afterwards raises)."""
        self._closed = True
        self._tail = b""
        self._window = None

    def __enter__(self) -> RemoteArchive:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _deadline(self) -> float:
        return time.monotonic() + self.client.limits.deadline

    def _call(self, call: Callable[[], _T], why: str) -> _T:
        try:
            return call()
        except RemoteError as error:
            raise BundleError(f"bundle {self.path}: {why}: {error}") from None
        finally:
            self.requests += 1

    def _get(self, offset: int, size: int, deadline: float) -> bytes:
        """Bytes [offset, offset + size) of the object, all of them, read remotely."""
        etag = self._info.etag
        data = self._call(
            lambda: self.client.get_range(self._name, offset, size, deadline, etag),
            f"reading {size} bytes at {offset} failed",
        )
        self.bytes_read += len(data)
        if len(data) != size:
            raise BundleError(
                f"{self.path} is truncated: {len(data)} of the {size} bytes at offset {offset} "
                f"came back, though the store said it holds {self.size} (the object changed?)"
            )
        return data

    def _bytes_at(self, offset: int, size: int, deadline: float) -> bytes:
        if offset >= self._tail_start:
            return self._tail[offset - self._tail_start : offset - self._tail_start + size]
        return self._get(offset, size, deadline)

    # -- opening: the end of the object, and the layout the index gives -----------------

    def _read_end(self, tail: bytes, deadline: float) -> tuple[int, bytes]:
        """The object's end from the first bytes of its index's header on, as (offset, bytes).

        tail is the end read with the object's size; while it holds no
        index.json header, the four times longer end is read, by its missing
        start only, up to what the largest index needs.
        """
        while True:
            start = self.size - len(tail)
            if start == 0 or self._index_header(tail, start):
                return start, tail
            if len(tail) >= _MAX_TAIL:
                raise BundleError(
                    f"{self.path}: no {INDEX_NAME} within {_MAX_TAIL} bytes of its end; bundles "
                    "end with their index (pjrt-pool bundle create): not a pjrt-pool bundle"
                )
            more = min(start, 3 * len(tail), _MAX_TAIL - len(tail))
            tail = self._get(start - more, more, deadline) + tail

    def _index_header(self, tail: bytes, start: int) -> bool:
        """Whether the end read holds the header of index.json (the last member, or before
        index.mac); anything else it holds is checked by _layout."""
        last = self._last_header(tail, start, self.size)
        if last is not None and last[1] == MAC_NAME:
            last = self._last_header(tail, start, last[0])
        return last is not None

    def _last_header(self, tail: bytes, start: int, end: int) -> tuple[int, str, int] | None:
        """The last member header that ends (padded) at most at end: (offset, name, size).

        Scanned backwards from end in 512-byte blocks: the members at the end
        (index.json, index.mac) are JSON text, which no block of holds a
        valid ustar header, so the first header found is the last member's.
        An entry's bytes might imitate one; the layout check then refuses.
        """
        data_end = start + len(tail[: end - start].rstrip(b"\x00"))
        block = (data_end - 1) // BLOCK * BLOCK
        first = -(-start // BLOCK) * BLOCK
        while block >= first:
            header = tail[block - start : block - start + BLOCK]
            if header[257:265] == _MAGIC:
                try:
                    name, size = parse_header(header, block, self.path)
                except BundleError:
                    name, size = "", -1
                if size >= 0 and block + BLOCK + size >= data_end:
                    if block + BLOCK + _padded(size) > end:
                        return None
                    return block, name, size
            block -= BLOCK
        return None

    def _layout(self) -> list[Member]:
        tail, start = self._tail, self._tail_start
        last = self._last_header(tail, start, self.size)
        if last is None:
            raise BundleError(
                f"{self.path}: no member header found at its end: damaged, truncated, or not a "
                "pjrt-pool bundle"
            )
        found = {last[1]: last}
        if last[1] == MAC_NAME:
            before = self._last_header(tail, start, last[0])
            if before is not None:
                found[before[1]] = before
        if INDEX_NAME not in found:
            raise BundleError(
                f"{self.path} does not end with its {INDEX_NAME} (its last member is "
                f"{last[1]!r}): pjrt-pool writes bundles with their index last; if this one was "
                "written otherwise, copy it here and open the file"
            )
        ends = {name: Member(name, at + BLOCK, size) for name, (at, _, size) in found.items()}
        self.index_bytes, self.index = open_index(
            ends,
            lambda member: tail[member.offset - start : member.offset - start + member.size],
            self._signer,
            self.path,
        )
        index = self.index
        if len(index.entries) + 2 > MAX_MEMBERS:
            raise BundleError(f"{self.path} has more than {MAX_MEMBERS} members")
        sizes = {member_name(key): entry.size for key, entry in index.entries.items()}
        sizes.update({name: size for name, (_, _, size) in found.items()})
        members, offset = [], 0
        for name in sorted(sizes):
            members.append(Member(name, offset + BLOCK, sizes[name]))
            offset += BLOCK + _padded(sizes[name])
        for name, (header_offset, _, _) in found.items():
            placed = next(member.offset - BLOCK for member in members if member.name == name)
            if placed != header_offset:
                raise BundleError(
                    f"{self.path}: its {name} lies at offset {header_offset}, but the members "
                    f"its index lists put it at {placed}: a member was added, removed or "
                    "resized after the bundle was made, so none of it is used"
                )
        self._checked.update(found)
        rest = self.size - offset
        if rest < BLOCK or rest > MAX_TRAILER or any(tail[offset - start :]):
            raise BundleError(
                f"{self.path} holds {rest} bytes after its last member (offset {offset}), where "
                f"tar's end-of-archive marker and zero padding (at most {MAX_TRAILER} bytes) "
                "belong: something was appended after the bundle was made"
            )
        if self.size != archive_size(offset):
            raise BundleError(wrong_size(self.path, offset, self.size))
        return members

    def check_headers(self) -> None:
        """Checks the tar header of every member not read yet, as opening a file checks them.

        The headers are read concurrently in batches of 64 (ranges nearer
        than 64 KiB read as one, so a batch holds at most 4 MiB); raises
        BundleError for the first that is not the one the layout gives.
        """
        with self._lock:
            left = [member for member in self.members if member.name not in self._checked]
            for first in range(0, len(left), _HEADER_BATCH):
                batch = left[first : first + _HEADER_BATCH]
                starts = [member.offset - BLOCK for member in batch]
                read = functools.partial(
                    self.client.get_ranges,
                    self._name,
                    starts,
                    BLOCK,
                    self._deadline(),
                    _HEADER_GAP,
                )
                blocks = self._call(read, f"reading {len(batch)} member headers failed")
                for member, block in zip(batch, blocks, strict=True):
                    self.bytes_read += len(block)
                    self._check_header(member, block)

    def _check_header(self, member: Member, block: bytes) -> None:
        where = member.offset - BLOCK
        if len(block) < BLOCK:
            raise BundleError(f"{self.path} is truncated: it ends in the header at {where}")
        name, size = parse_header(block[:BLOCK], where, self.path)
        if (name, size) != (member.name, member.size):
            raise BundleError(
                f"{self.path}: the member header at offset {where} names {name!r} of {size} "
                f"bytes, where its index puts {member.name} of {member.size}: the bundle was "
                "changed after it was made"
            )
        self._checked.add(member.name)

    # -- members ------------------------------------------------------------------

    def _first_bytes(self, member: Member, deadline: float) -> bytes:
        """A member's first bytes, read with its tar header, which is checked on first read."""
        if self._closed:
            raise ValueError(f"bundle {self.path} is closed")
        if self._window is not None and self._window[0] == member.name:
            return self._window[1]
        length = min(member.size, _WINDOW)
        block = self._bytes_at(member.offset - BLOCK, BLOCK + length, deadline)
        if member.name not in self._checked:
            self._check_header(member, block)
        self._window = (member.name, block[BLOCK:])
        return block[BLOCK:]

    def read(self, member: Member) -> bytes:
        """Returns a member's data; raises BundleError if the object ends early."""
        return self.read_part(member, 0, member.size)

    def read_part(self, member: Member, start: int, size: int) -> bytes:
        """Returns up to size bytes of a member's data from start (fewer at its end)."""
        size = max(0, min(size, member.size - start))
        with self._lock:
            deadline = self._deadline()
            first = self._first_bytes(member, deadline)
            if start + size <= len(first):
                return first[start : start + size]
            return self._bytes_at(member.offset + start, size, deadline)

    def read_into(self, member: Member, buffer: bytearray) -> None:
        """Reads a member's data into a buffer of its size, in ranges of at most 16 MiB."""
        view = memoryview(buffer)
        with self._lock:
            deadline = self._deadline()
            first = self._first_bytes(member, deadline)
            view[: len(first)] = first
            done = len(first)
            while done < member.size:
                count = min(_CHUNK, member.size - done)
                view[done : done + count] = self._bytes_at(member.offset + done, count, deadline)
                done += count
            self._window = None  # the caller holds it now

    def digest(self, member: Member) -> str:
        """Returns the SHA-256 of a member's data, read in ranges (never held whole)."""
        digest = hashlib.sha256()
        with self._lock:
            deadline = self._deadline()
            first = self._first_bytes(member, deadline)
            digest.update(first)
            done = len(first)
            while done < member.size:
                count = min(_CHUNK, member.size - done)
                digest.update(self._bytes_at(member.offset + done, count, deadline))
                done += count
        return digest.hexdigest()
