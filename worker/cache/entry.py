"""The file format of one cache entry.

An entry is self-describing and verified before anything in it is used::

    magic      8 bytes   b"PJRTPOOL"
    version    4 bytes   little-endian format version
    flags      4 bytes   little-endian; bit 0: signed
    length     4 bytes   little-endian length of the header
    header     JSON      key, key parts, payload size and SHA-256, metadata
    digest     32 bytes  SHA-256 of magic, version, flags, length and header
    mac        32 bytes  only when signed: HMAC-SHA256 of the same bytes (signing.py)
    payload              the plugin's serialized executable

The header digest covers every byte before it and the payload's own digest
sits in the header, so any flipped, missing or extra byte is caught; the MAC
covers the same bytes, and so the payload through its digest. Nothing in
the file is executable: JSON and opaque bytes only, never pickle, so that
whoever can write the cache directory cannot run code in a reader.

A reader bounds what it reads before it has checked it: the header's length
(at most MAX_HEADER_SIZE) before reading the header, the MAC (when signing)
over the header's raw bytes before parsing it, its nesting while parsing, and
the payload's size against the file's size and the cache's bound before
reading the payload. A file that fails any of these is corrupt, never a
reason to run out of memory or stack.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import struct
from typing import Any, BinaryIO, NamedTuple

from worker.cache.signing import MAC_SIZE, Signer
from worker.errors import PjrtPoolError
from worker.identity.keys import key_of
from worker.untrusted import parse_json

MAGIC = b"PJRTPOOL"
ENTRY_SUFFIX = ".pjx"
"""How an entry's file is named: its key and this (entries/<key>.pjx, in a cache and a bundle)."""
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<8sIII")
_DIGEST_SIZE = 32
SIGNED = 1
"""Flag: a MAC follows the header digest."""
MAX_HEADER_SIZE = 1 << 20


class CorruptEntryError(PjrtPoolError):
    """An entry file failed verification; the message says how.

    `stat` is the os.stat_result of the file judged bad, when there was one
    (so that exactly that file is removed).
    """

    stat: os.stat_result | None = None


class SignatureError(CorruptEntryError):
    """Signing is on and an entry is unsigned, signed with another secret, or changed."""


class UnreadableEntryError(PjrtPoolError):
    """An entry file exists but could not be read (EACCES, EMFILE, EIO, ...).

    This says nothing about the entry, which may be perfectly good: it is
    never removed for it. `error` is the OSError.
    """

    def __init__(self, message: str, error: OSError | None = None) -> None:
        super().__init__(message)
        self.error = error


class Entry(NamedTuple):
    """A verified entry: its header fields and payload."""

    key: str
    parts: dict[str, Any]
    metadata: dict[str, Any]
    payload: bytes
    signed: bool = False


def encode(
    key: str,
    parts: dict[str, Any],
    metadata: dict[str, Any],
    payload: bytes,
    signer: Signer | None = None,
) -> bytes:
    """Returns the bytes of an entry file, signed when a signer is given."""
    header = json.dumps(
        {
            "key": key,
            "parts": parts,
            "payload_size": len(payload),
            "payload_sha256": hashlib.sha256(payload).hexdigest(),
            "metadata": metadata,
            **({"signer": signer.key_id} if signer is not None else {}),
        },
        sort_keys=True,
    ).encode()
    flags = SIGNED if signer is not None else 0
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, flags, len(header))
    signed_part = prefix + header
    mac = signer.sign(signed_part) if signer is not None else b""
    return b"".join((signed_part, hashlib.sha256(signed_part).digest(), mac, payload))


class Header(NamedTuple):
    """A verified header: its JSON, where the payload starts, and the MAC if signed."""

    fields: dict[str, Any]
    payload_offset: int
    signed_part: bytes
    mac: bytes | None


def header_length(prefix: bytes) -> int:
    """Returns how many bytes an entry's prefix, header, digest and MAC take, from its prefix.

    prefix is the file's first PREFIX_SIZE bytes; a header longer than
    MAX_HEADER_SIZE raises CorruptEntryError, before any of it is read.
    """
    if len(prefix) < _PREFIX.size:
        raise CorruptEntryError(f"truncated: {len(prefix)} bytes is shorter than the file prefix")
    _, _, flags, length = _PREFIX.unpack_from(prefix)
    if length > MAX_HEADER_SIZE:
        raise CorruptEntryError(f"header length {length} is implausible")
    return _PREFIX.size + length + _DIGEST_SIZE + (MAC_SIZE if flags & SIGNED else 0)


PREFIX_SIZE = _PREFIX.size
"""Bytes of the fixed prefix (magic, version, flags, header length)."""

# The header's signer field as encode writes it (json.dumps, sort_keys): read from the raw
# bytes of a header whose MAC failed, which is never parsed.
_SIGNER_FIELD = re.compile(rb'"signer": "([0-9a-f]{1,64})"')


def decode_header(data: bytes | memoryview, signer: Signer | None = None) -> Header:
    """Verifies an entry's header digest (and MAC, with a signer) and returns the header.

    Needs only the bytes up to the payload; raises CorruptEntryError, and
    SignatureError with a signer. With a signer, the MAC is checked over the
    raw bytes before the header's JSON is parsed: a header from whoever lacks
    the secret is never parsed.
    """
    if len(data) < _PREFIX.size:
        raise CorruptEntryError(f"truncated: {len(data)} bytes is shorter than the file prefix")
    magic, version, flags, length = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntryError("not a pjrt-pool cache entry (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptEntryError(f"entry format {version}, expected {FORMAT_VERSION}")
    if length > MAX_HEADER_SIZE:
        raise CorruptEntryError(f"header length {length} is implausible")
    end = _PREFIX.size + length
    mac_size = MAC_SIZE if flags & SIGNED else 0
    if len(data) < end + _DIGEST_SIZE + mac_size:
        raise CorruptEntryError("truncated inside the header")
    signed_part = bytes(data[:end])
    if hashlib.sha256(signed_part).digest() != data[end : end + _DIGEST_SIZE]:
        raise CorruptEntryError("header digest mismatch")
    offset = end + _DIGEST_SIZE
    mac = bytes(data[offset : offset + mac_size]) if mac_size else None
    if signer is not None:
        _check_mac(signed_part, mac, signer)
    try:
        header = parse_json(signed_part[_PREFIX.size :])
    except ValueError as error:  # only a crafted file: the digest matched
        raise CorruptEntryError(f"header is not JSON: {error}") from None
    if not isinstance(header, dict) or not isinstance(header.get("parts", {}), dict):
        raise CorruptEntryError("header is not a JSON object with key parts")
    if not isinstance(header.get("metadata", {}), dict):
        raise CorruptEntryError("the header's metadata is not a JSON object")
    return Header(header, offset + mac_size, signed_part, mac)


def _check_mac(signed_part: bytes, mac: bytes | None, signer: Signer) -> None:
    if mac is None:
        raise SignatureError(
            f"unsigned, and this process signs entries (secret from {signer.source})"
        )
    if not signer.verify(signed_part, mac):
        found = _SIGNER_FIELD.search(signed_part, _PREFIX.size)
        other = None if found is None else found.group(1).decode()
        why = (
            f"signed with another secret (key id {other}, this process's is {signer.key_id})"
            if other != signer.key_id
            else "its signature does not match: it was changed after signing"
        )
        raise SignatureError(why)


def check_signature(header: Header, signer: Signer) -> None:
    """Raises SignatureError unless the header carries signer's MAC."""
    _check_mac(header.signed_part, header.mac, signer)


def _not_an_entry(message: str, found: os.stat_result | None) -> CorruptEntryError:
    error = CorruptEntryError(message)
    error.stat = found
    return error


def open_entry(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> BinaryIO:
    """Opens an entry file for reading; raises CorruptEntryError unless it is a regular file.

    path is relative to dir_fd when given. A symlink is not followed, and a
    directory, FIFO or device (which would block, or never end) is refused
    before reading; the error's stat then describes what lies there. Raises
    OSError (FileNotFoundError included) when the file cannot be opened.
    """
    flags = (
        os.O_RDONLY
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_NONBLOCK", 0)
        | getattr(os, "O_CLOEXEC", 0)
    )
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            found = _lstat(path, dir_fd)
            raise _not_an_entry("a symbolic link, not an entry file", found) from None
        raise
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            kind = "a directory" if stat.S_ISDIR(found.st_mode) else "not a regular file"
            raise _not_an_entry(f"{kind}, not an entry file", found)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _lstat(path: str | os.PathLike[str], dir_fd: int | None) -> os.stat_result | None:
    try:
        return os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def _read_exactly(file: BinaryIO, size: int, what: str) -> bytes:
    data = file.read(size)
    if len(data) != size:
        raise CorruptEntryError(f"truncated inside the {what}")
    return data


def _read_header_bytes(file: BinaryIO) -> bytes:
    """Reads the prefix, header, digest and MAC of an open entry, bounded by MAX_HEADER_SIZE."""
    prefix = file.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size:
        return prefix  # decode_header says how short it is
    return prefix + file.read(header_length(prefix) - _PREFIX.size)


def read_header(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> Header:
    """Reads and verifies only the header of an entry file (for listings).

    Raises CorruptEntryError, and OSError when the file cannot be read.
    """
    with open_entry(path, dir_fd=dir_fd) as file:
        return decode_header(_read_header_bytes(file))


def read_entry(
    file: BinaryIO,
    file_size: int,
    expected_key: str | None,
    signer: Signer | None,
    max_payload: int,
) -> Entry:
    """Reads and verifies an open entry file of file_size bytes; raises CorruptEntryError.

    The header is read and verified first (and the MAC checked, with a
    signer); the payload is read only if the header's payload size is an
    integer no larger than max_payload and the file holds exactly that much
    after the header. So a huge or sparse file costs a header's read, not
    its size in memory.
    """
    verified = decode_header(_read_header_bytes(file), signer)
    key = verified.fields.get("key")
    if expected_key is not None and key != expected_key:
        raise CorruptEntryError(f"entry is for key {key}, not {expected_key}")
    size = payload_size(verified, file_size, max_payload)
    return _verified_entry(verified, key, _read_exactly(file, size, "payload"))


def payload_size(verified: Header, file_size: int, max_payload: int) -> int:
    """Returns the payload size a verified header gives, checked before the payload is read.

    Raises CorruptEntryError unless it is a byte count of at most max_payload
    and the file (of file_size bytes) holds exactly that much after the header.
    """
    size = verified.fields.get("payload_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise CorruptEntryError(f"the header's payload size {size!r} is not a byte count")
    if size > max_payload:
        raise CorruptEntryError(
            f"the header's payload size {size} is larger than the cache's bound {max_payload}"
        )
    if file_size != verified.payload_offset + size:
        raise CorruptEntryError(
            f"payload is {file_size - verified.payload_offset} bytes, the header says {size}"
        )
    return size


def verified_entry(verified: Header, expected_key: str, payload: bytes | bytearray) -> Entry:
    """Returns the entry of a verified header (decode_header) and its payload, read apart.

    Checks what verify checks but the header: the key, that the key parts
    hash to it, and the payload's size and digest. Raises CorruptEntryError.
    """
    key = verified.fields.get("key")
    if key != expected_key:
        raise CorruptEntryError(f"entry is for key {key}, not {expected_key}")
    if key_of(verified.fields.get("parts", {})) != key:
        raise CorruptEntryError("the key parts do not hash to the key")
    return _verified_entry(verified, key, payload)


def _verified_entry(verified: Header, key: Any, payload: bytes) -> Entry:
    header = verified.fields
    if len(payload) != header.get("payload_size"):
        raise CorruptEntryError(
            f"payload is {len(payload)} bytes, the header says {header.get('payload_size')}"
        )
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise CorruptEntryError("payload digest mismatch")
    return Entry(
        key, header.get("parts", {}), header.get("metadata", {}), payload, verified.mac is not None
    )


def decode(data: bytes, expected_key: str | None = None, signer: Signer | None = None) -> Entry:
    """Verifies a whole entry file held in memory and returns it; raises CorruptEntryError.

    With expected_key, an entry for another key (a file renamed or copied
    over this one) is corrupt too. With a signer, an entry without its MAC
    raises SignatureError.
    """
    verified = decode_header(data, signer)
    key = verified.fields.get("key")
    if expected_key is not None and key != expected_key:
        raise CorruptEntryError(f"entry is for key {key}, not {expected_key}")
    return _verified_entry(verified, key, data[verified.payload_offset :])


def verify(data: bytes, key: str, signer: Signer | None = None) -> Entry:
    """Verifies the whole file of a key's entry, held in memory; raises CorruptEntryError.

    Besides what decode checks, the key parts in the header must hash to the
    key, so that an entry copied under another key's name is never loaded
    (as DiskCache.read checks an entry it reads from the cache).
    """
    entry = decode(data, expected_key=key, signer=signer)
    if key_of(entry.parts) != key:
        raise CorruptEntryError("the key parts do not hash to the key")
    return entry
