"""The file format of one cache entry.

An entry is self-describing and verified before anything in it is used::

    magic      8 bytes   b"PJRTPOOL"
    version    4 bytes   little-endian format version
    length     4 bytes   little-endian length of the header
    header     JSON      key, key parts, payload size and SHA-256, metadata
    digest     32 bytes  SHA-256 of magic, version, length and header
    payload              the plugin's serialized executable

The header digest covers every byte before the payload and the payload's own
digest sits in the header, so any flipped, missing or extra byte is caught.
Nothing in the file is executable: JSON and opaque bytes only, never pickle,
so that whoever can write the cache directory cannot run code in a reader.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

MAGIC = b"PJRTPOOL"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")
_DIGEST_SIZE = 32
MAX_HEADER_SIZE = 1 << 20


class CorruptEntryError(Exception):
    """An entry file failed verification; the message says how.

    `stat` is the os.stat_result of the file read, when there was one.
    """

    stat: os.stat_result | None = None


@dataclass(frozen=True)
class Entry:
    """A verified entry: its header fields and payload."""

    key: str
    parts: dict[str, Any]
    metadata: dict[str, Any]
    payload: bytes


def encode(key: str, parts: dict[str, Any], metadata: dict[str, Any], payload: bytes) -> bytes:
    """Returns the bytes of an entry file."""
    header = json.dumps(
        {
            "key": key,
            "parts": parts,
            "payload_size": len(payload),
            "payload_sha256": hashlib.sha256(payload).hexdigest(),
            "metadata": metadata,
        },
        sort_keys=True,
    ).encode()
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header))
    digest = hashlib.sha256(prefix + header).digest()
    return b"".join((prefix, header, digest, payload))


def decode_header(data: bytes) -> tuple[dict[str, Any], int]:
    """Verifies and returns an entry's header and the offset of its payload.

    Needs only the bytes up to the payload; raises CorruptEntryError.
    """
    if len(data) < _PREFIX.size:
        raise CorruptEntryError(f"truncated: {len(data)} bytes is shorter than the file prefix")
    magic, version, length = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntryError("not a pjrt-pool cache entry (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptEntryError(f"entry format {version}, expected {FORMAT_VERSION}")
    if length > MAX_HEADER_SIZE:
        raise CorruptEntryError(f"header length {length} is implausible")
    end = _PREFIX.size + length
    if len(data) < end + _DIGEST_SIZE:
        raise CorruptEntryError("truncated inside the header")
    if hashlib.sha256(data[:end]).digest() != data[end : end + _DIGEST_SIZE]:
        raise CorruptEntryError("header digest mismatch")
    try:
        header = json.loads(data[_PREFIX.size : end])
    except ValueError as error:  # only a crafted file: the digest matched
        raise CorruptEntryError(f"header is not JSON: {error}") from None
    if not isinstance(header, dict) or not isinstance(header.get("parts", {}), dict):
        raise CorruptEntryError("header is not a JSON object with key parts")
    return header, end + _DIGEST_SIZE


def open_entry(path: str | os.PathLike[str]) -> BinaryIO:
    """Opens an entry file for reading; raises CorruptEntryError unless it is a regular file.

    A symlink is not followed, and a FIFO or device (which would block, or
    never end) is refused before reading. Raises OSError (FileNotFoundError
    included) when the file cannot be opened.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise CorruptEntryError("a symbolic link, not an entry file") from None
        raise
    file = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        file.close()
        raise CorruptEntryError("not a regular file")
    return file


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads and verifies only the header of an entry file (for listings).

    Raises CorruptEntryError, and OSError when the file cannot be read.
    """
    with open_entry(path) as file:
        prefix = file.read(_PREFIX.size)
        if len(prefix) == _PREFIX.size:
            length = min(_PREFIX.unpack(prefix)[2], MAX_HEADER_SIZE)
            prefix += file.read(length + _DIGEST_SIZE)
    return decode_header(prefix)[0]


def decode(data: bytes, expected_key: str | None = None) -> Entry:
    """Verifies a whole entry file and returns it; raises CorruptEntryError.

    With expected_key, an entry for another key (a file renamed or copied
    over this one) is corrupt too.
    """
    header, offset = decode_header(data)
    key = header.get("key")
    if expected_key is not None and key != expected_key:
        raise CorruptEntryError(f"entry is for key {key}, not {expected_key}")
    payload = data[offset:]
    if len(payload) != header.get("payload_size"):
        raise CorruptEntryError(
            f"payload is {len(payload)} bytes, the header says {header.get('payload_size')}"
        )
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise CorruptEntryError("payload digest mismatch")
    return Entry(key, header.get("parts", {}), header.get("metadata", {}), payload)
