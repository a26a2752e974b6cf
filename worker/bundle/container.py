"""Reading the bundle's container: an uncompressed POSIX ustar archive.

Any tar lists and extracts it (``tar tvf app.bundle``); writer.py writes it
deterministically. Reading needs no tarfile module and trusts nothing: each 512-byte header is
checked (its checksum, the POSIX ustar magic, that it is a regular file, that
its data lies within the file, that no name repeats) and whatever follows the
end-of-archive marker must be tar's zero padding. A member's data is read
only when asked for, by offset, so opening a bundle of hundreds of programs
reads one header per member and nothing else.
"""

from __future__ import annotations

import hashlib
import os
import stat
from typing import NamedTuple

from worker.errors import BundleError

BLOCK = 512
MAX_MEMBERS = 1 << 17
"""More members than this is no bundle pjrt-pool wrote (a program has one entry per
environment): refused before the listing grows without bound."""
_CHUNK = 1 << 24
"""Bytes read per call when a member is read whole or hashed."""
MAX_TRAILER = 1 << 16
"""More zeros than this after the last member is refused before they are read (tar's end
marker and padding are at most RECORD bytes: archive_size)."""
RECORD = 20 * BLOCK
"""tar's record (tarfile.RECORDSIZE, which writer.py's tarfile pads to): an archive's size is
a multiple of it."""

_USTAR_MAGIC = b"ustar\x0000"
_REGULAR = (b"0", b"\x00")
_KINDS = {
    b"1": "a hard link",
    b"2": "a symbolic link",
    b"3": "a character device",
    b"4": "a block device",
    b"5": "a directory",
    b"6": "a FIFO",
    b"7": "a contiguous file",
    b"x": "a pax extended header",
    b"g": "a pax global header",
    b"L": "a GNU long name",
    b"K": "a GNU long link name",
}


class Member(NamedTuple):
    """A member of an archive: its name and where its data lies."""

    name: str
    offset: int
    """Byte offset of its data in the archive file."""
    size: int


class Archive:
    """An archive file opened for reading: its members, and their data by offset."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise BundleError(f"bundle {self.path} does not exist") from None
        except OSError as error:
            raise BundleError(f"cannot open bundle {self.path}: {error.strerror}") from None
        try:
            found = os.fstat(self._fd)
            if not stat.S_ISREG(found.st_mode):
                raise BundleError(f"{self.path} is not a regular file, so not a bundle")
            self.size = found.st_size
            self.members = self._list()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Closes the file (reading members afterwards raises)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def check_headers(self) -> None:
        """Nothing to do: every member's header was checked as the archive opened (a
        RemoteArchive checks a header when its member is first read, or in this call)."""

    def read(self, member: Member) -> bytes:
        """Returns a member's data; raises BundleError if the file got shorter meanwhile."""
        data = self._read_at(member.offset, member.size)
        if len(data) != member.size:
            raise BundleError(f"{self.path}: {member.name} is truncated (the file changed?)")
        return data

    def read_part(self, member: Member, start: int, size: int) -> bytes:
        """Returns up to size bytes of a member's data from start (fewer at its end)."""
        size = max(0, min(size, member.size - start))
        return self._read_at(member.offset + start, size)

    def read_into(self, member: Member, buffer: bytearray) -> None:
        """Reads a member's data into a buffer of its size; raises BundleError if truncated."""
        if self._fd < 0:
            raise ValueError(f"bundle {self.path} is closed")
        view = memoryview(buffer)
        done = 0
        while done < member.size:
            count = os.preadv(self._fd, [view[done : done + _CHUNK]], member.offset + done)
            if not count:
                raise BundleError(f"{self.path}: {member.name} is truncated (the file changed?)")
            done += count

    def digest(self, member: Member) -> str:
        """Returns the SHA-256 of a member's data, read in chunks (never held whole)."""
        digest = hashlib.sha256()
        done = 0
        while done < member.size:
            chunk = self._read_at(member.offset + done, min(_CHUNK, member.size - done))
            if not chunk:
                break
            digest.update(chunk)
            done += len(chunk)
        return digest.hexdigest()

    def _read_at(self, offset: int, size: int) -> bytes:
        if self._fd < 0:
            raise ValueError(f"bundle {self.path} is closed")
        chunks = []
        while size > 0:
            chunk = os.pread(self._fd, min(size, _CHUNK), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def _list(self) -> list[Member]:
        members: list[Member] = []
        seen: set[str] = set()
        offset = 0
        while True:
            header = self._read_at(offset, BLOCK)
            if len(header) < BLOCK:
                raise BundleError(
                    f"{self.path} is truncated: it ends {len(header)} bytes into a member "
                    f"header at offset {offset}, before tar's end-of-archive marker"
                )
            if not any(header):
                self._check_trailer(offset)
                return members
            name, size = parse_header(header, offset, self.path)
            data = offset + BLOCK
            end = data + -(-size // BLOCK) * BLOCK
            if data + size > self.size:
                raise BundleError(
                    f"{self.path} is truncated: member {name} is {size} bytes, but the file "
                    f"ends {self.size - data} bytes after its header"
                )
            if name in seen:
                raise BundleError(f"{self.path}: member {name} appears twice")
            seen.add(name)
            members.append(Member(name, data, size))
            if len(members) > MAX_MEMBERS:
                raise BundleError(f"{self.path} has more than {MAX_MEMBERS} members")
            offset = end

    def _check_trailer(self, offset: int) -> None:
        rest = self.size - offset
        if rest > MAX_TRAILER or any(self._read_at(offset, rest)):
            raise BundleError(
                f"{self.path} holds data after tar's end-of-archive marker (offset {offset}): "
                "something was appended after the bundle was made"
            )
        if self.size != archive_size(offset):
            raise BundleError(wrong_size(self.path, offset, self.size))


def archive_size(end: int) -> int:
    """The size of the archive pjrt-pool writes whose last member's data (padded to a block)
    ends at `end`: tar's end-of-archive marker, two zero blocks, then zeros to a whole
    RECORD. The members' headers give `end`, so a bundle cut short or added to anywhere,
    its padding included, has another size than this."""
    return -(-(end + 2 * BLOCK) // RECORD) * RECORD


def _octal(field: bytes, what: str, offset: int, path: str) -> int:
    text = field.rstrip(b"\x00 ").lstrip(b" ")
    if not text or any(c not in b"01234567" for c in text):
        raise BundleError(f"{path}: the member header at offset {offset} has a bad {what} field")
    return int(text, 8)


def parse_header(header: bytes, offset: int, path: str) -> tuple[str, int]:
    """Checks one ustar header; returns the member's name and size, or raises BundleError."""
    stored = _octal(header[148:156], "checksum", offset, path)
    if stored != sum(header[:148]) + 8 * 32 + sum(header[156:]):
        raise BundleError(
            f"{path}: the member header at offset {offset} fails its checksum (damaged, "
            "or not a tar archive)"
        )
    if header[257:265] != _USTAR_MAGIC:
        raise BundleError(
            f"{path}: the member header at offset {offset} is not POSIX ustar; pjrt-pool "
            "writes bundles as ustar (pjrt-pool bundle create)"
        )
    prefix, base = header[345:500].split(b"\x00", 1)[0], header[:100].split(b"\x00", 1)[0]
    try:
        name = (prefix + b"/" + base if prefix else base).decode("ascii")
    except UnicodeDecodeError:
        raise BundleError(f"{path}: a member name at offset {offset} is not ASCII") from None
    kind = header[156:157]
    if kind not in _REGULAR:
        what = _KINDS.get(kind, f"of tar type {kind!r}")
        raise BundleError(f"{path}: member {name!r} is {what}; a bundle holds regular files only")
    if header[124] & 0x80:  # base-256: larger than 8 GiB
        raise BundleError(f"{path}: member {name!r} is larger than a bundle member may be")
    return name, _octal(header[124:136], "size", offset, path)


def wrong_size(path: str, end: int, size: int) -> str:
    """What to say of a bundle whose size is not archive_size(end)."""
    expected = archive_size(end)
    how = "cut short" if size < expected else "added to"
    return (
        f"{path} has {size} bytes where its members make {expected} (the last ends at {end}, "
        f"then tar's end marker and zero padding to {RECORD} bytes): it was {how} after it was "
        "made, so none of it is used; copy it again, or make it again from its manifests"
    )


def looks_like_archive(path: str | os.PathLike[str]) -> bool:
    """Whether a file is a bundle, or an attempt at one (damaged included), not a manifest.

    A file starting with a ustar header is one; so is a regular file whose
    first block holds a NUL byte, which no JSON text does: a bundle whose
    header was damaged is then reported as a damaged bundle by its reader,
    not as a manifest that fails to decode. The file is opened without
    blocking and only a regular file is read (a FIFO would wait for a writer
    forever): anything else is not an archive, and its reader refuses it.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        first = os.pread(fd, BLOCK, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return first[257:265] == _USTAR_MAGIC or b"\x00" in first
