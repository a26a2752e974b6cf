"""What the remote holds, and under which names::

    <prefix>/blobs/<sha256>.pjx            an entry file, named by the SHA-256 of its bytes
    <prefix>/records/<key>/<signer>.json   the commit point of one cache key (below)
    <prefix>/programs/<program>/<key>      empty: one environment the program was built for

A record is a header line, then a JSON body::

    pjrt-pool remote record 2 <signature>
    {"format": 2, "key": ..., "parts": {...}, "sha256": ..., "size": ..., "signer": ...}

The body holds the key, its parts, the entry's SHA-256 and size, and the
name of whoever may vouch for it (``signer``: "unsigned", "hmac-<id>" for
the shared secret, "ed25519-<id>" for a public key); the header the format
and the hex signature (Ed25519) or MAC (HMAC) of the body, ``-`` for
unsigned records. The signature is apart from the body so that a reader
checks it over the raw bytes before it parses anything (verify.py). Format 1
(a JSON object with the signature inside, pjrt-pool before this layout) is
refused as older (OldRecordError): a reader takes it for a miss, and the next
publish replaces it. A record of a newer format (NewRecordError), written by
a newer pjrt-pool sharing the remote, is refused and left alone: neither
replaced by a publish nor taken by a collection to name no blob.

The blob is written first and the record last, both create-only, so a
record never names a blob that is not whole. A record is replaced only by
its own signer, conditionally on the version it read (If-Match), and only
when it does not serve: it names a blob that is gone, or is of an older
format (RemoteCache.publish). A record's name holds its signer, so a record
planted by someone without the signing key never takes the name under which
the signed one is looked for.

A program (its text and compile options: the key parts program_sha256 and
compile_options, hashed together into <program>) is built once per
environment (plugin build, host, XLA flags, ...), each under its own key.
The program index lists those keys, so that a host whose key is missing
can say how the environments the program was built for differ from its own
(never-compile's refusal). An index name is only a hint: it is written
after the record it points to, and a reader trusts nothing but the record
it then reads and checks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from worker.errors import PjrtPoolError
from worker.identity.keys import check_key, is_key
from worker.untrusted import parse_json

RECORD_FORMAT = 2
RECORD_MAGIC = b"pjrt-pool remote record"
MAX_RECORD_SIZE = 256 << 10
"""Records hold key parts (a few KB); anything larger is not one."""
MAX_HEADER_SIZE = 256
"""A header line: the magic, the format and at most a 128-digit signature."""
UNSIGNED = "unsigned"
_HEX = frozenset(b"0123456789abcdef")


def blob_name(sha256: str) -> str:
    """The object name of an entry file with this SHA-256 (64 hex digits)."""
    return f"blobs/{check_key(sha256, 'an entry digest')}.pjx"


def record_name(key: str, signer: str) -> str:
    """The object name of a key's record vouched for by signer."""
    return f"records/{check_key(key)}/{signer}.json"


def program_folder(parts: dict[str, Any]) -> str:
    """The folder of a program's index: every key the program was built under (see above)."""
    program = json.dumps([parts.get("program_sha256"), parts.get("compile_options")])
    return f"programs/{hashlib.sha256(program.encode()).hexdigest()}/"


def program_index_name(parts: dict[str, Any], key: str) -> str:
    """The index name that says the program of parts was built under key."""
    return program_folder(parts) + check_key(key)


class BadRecordError(PjrtPoolError, ValueError):
    """A remote record is malformed; the message says how."""


class OldRecordError(BadRecordError):
    """A remote record of an older format: unused, and replaced by the next publish."""


class NewRecordError(BadRecordError):
    """A remote record of a newer format (a newer pjrt-pool's): unused, and left as it is."""


@dataclass(frozen=True)
class Record:
    """A key's commit point: which entry file holds it."""

    key: str
    parts: dict[str, Any]
    sha256: str
    size: int
    signer: str = UNSIGNED

    def body(self) -> bytes:
        """The record's JSON body: what its signature covers (with signed_bytes)."""
        fields = {
            "format": RECORD_FORMAT,
            "key": self.key,
            "parts": self.parts,
            "sha256": self.sha256,
            "size": self.size,
            "signer": self.signer,
        }
        return json.dumps(fields, sort_keys=True).encode()

    def encode(self, signature: str | None = None) -> bytes:
        """The record's bytes: its header (with signature, hex, if signed) and body."""
        return encode_record(self.body(), signature)


def signed_bytes(body: bytes) -> bytes:
    """What a record's signature or MAC covers: its body, named as one of this format."""
    return RECORD_MAGIC + b" %d\n" % RECORD_FORMAT + body


def encode_record(body: bytes, signature: str | None) -> bytes:
    """A record's bytes from its body and the hex signature of signed_bytes(body), if any."""
    return RECORD_MAGIC + b" %d %s\n" % (RECORD_FORMAT, (signature or "-").encode()) + body


def split_record(data: bytes) -> tuple[str | None, bytes]:
    """A record's signature (hex; None for "-") and its body, unparsed; raises BadRecordError
    (OldRecordError for format 1). Reads only the header line."""
    if len(data) > MAX_RECORD_SIZE:
        raise BadRecordError(f"the record is {len(data)} bytes, over {MAX_RECORD_SIZE}")
    header, newline, _ = data[:MAX_HEADER_SIZE].partition(b"\n")
    if not newline or not header.startswith(RECORD_MAGIC + b" "):
        if data.lstrip()[:1] == b"{":
            raise OldRecordError(
                "the record is of format 1 (written by an older pjrt-pool, which this one does "
                f"not read: format {RECORD_FORMAT}); the next publish of its key replaces it"
            )
        raise BadRecordError("the record has no header line (pjrt-pool remote record ...)")
    words = header[len(RECORD_MAGIC) + 1 :].split(b" ")
    if len(words) != 2 or words[0] != b"%d" % RECORD_FORMAT:
        found = words[0][:16].decode("ascii", "replace")
        newer = found.isdigit() and int(found) > RECORD_FORMAT
        raise (NewRecordError if newer else BadRecordError)(
            f"the record is of format {found!r}; this pjrt-pool reads format {RECORD_FORMAT}"
        )
    signature = words[1]
    if signature != b"-" and (not signature or not _HEX.issuperset(signature)):
        raise BadRecordError("the record's signature is not hex")
    return (None if signature == b"-" else signature.decode()), data[len(header) + 1 :]


def parse_record_body(body: bytes, key: str, signer: str) -> Record:
    """Parses a record's body read under record_name(key, signer); raises BadRecordError."""
    try:
        fields = parse_json(body)
    except ValueError as error:
        raise BadRecordError(f"the record is not JSON: {error}") from None
    if not isinstance(fields, dict) or fields.get("format") != RECORD_FORMAT:
        raise BadRecordError(f"the record's body is not a JSON object of format {RECORD_FORMAT}")
    if fields.get("key") != key or fields.get("signer") != signer:
        raise BadRecordError(
            f"the record names key {fields.get('key')!r} and signer {fields.get('signer')!r}, "
            f"not the {key} and {signer} of its name"
        )
    parts, sha256, size = fields.get("parts"), fields.get("sha256"), fields.get("size")
    if not isinstance(parts, dict):
        raise BadRecordError("the record's parts are not a JSON object")
    if not isinstance(sha256, str) or len(sha256) != 64:
        raise BadRecordError("the record's sha256 is not a digest")
    try:
        check_key(sha256, "an entry digest")
    except ValueError as error:
        raise BadRecordError(str(error)) from None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise BadRecordError(f"the record's size {size!r} is not a byte count")
    return Record(key, parts, sha256, size, signer)


def decode_record(data: bytes, key: str, signer: str) -> Record:
    """Parses a record read under record_name(key, signer), its signature unchecked (for
    collection; a reader checks it first: verify.checked_record); raises BadRecordError."""
    return parse_record_body(split_record(data)[1], key, signer)


def parse_record_name(name: str) -> tuple[str, str] | None:
    """The key and signer of a listed record's name, or None if it does not name one."""
    folder, _, rest = name.partition("/")
    key, _, file = rest.partition("/")
    signer = file.removesuffix(".json")
    if folder != "records" or not is_key(key) or signer == file or not signer or "/" in signer:
        return None
    return key, signer


def parse_blob_name(name: str) -> str | None:
    """The SHA-256 a listed blob's name holds, or None if it does not name one."""
    folder, _, file = name.partition("/")
    digest = file.removesuffix(".pjx")
    return digest if folder == "blobs" and digest != file and is_key(digest) else None


def parse_index_name(name: str) -> str | None:
    """The key a listed program index name, ``programs/<program>/<key>``, names, or None."""
    parts = name.split("/")
    if len(parts) != 3 or parts[0] != "programs" or not is_key(parts[2]):
        return None
    return parts[2]
