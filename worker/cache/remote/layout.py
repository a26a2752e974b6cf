"""What the remote holds, and under which names::

    <prefix>/blobs/<sha256>.pjx            an entry file, named by the SHA-256 of its bytes
    <prefix>/records/<key>/<signer>.json   the commit point of one cache key (below)
    <prefix>/programs/<program>/<key>      empty: one environment the program was built for

A record holds the key, its parts, the entry's SHA-256 and size, the name
of whoever may vouch for it (``signer``: "unsigned", "hmac-<id>" for the
shared secret, "ed25519-<id>" for a public key) and, for Ed25519, the
signature of the record. The blob is written first and the record last, both
create-only, so a record never names a blob that is not whole, and no
writer ever replaces what another wrote. A record's name holds its signer,
so a record planted by someone without the signing key never takes the
name under which the signed one is looked for.

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

from worker.cache.key import check_key, is_key
from worker.untrusted import parse_json

RECORD_FORMAT = 1
MAX_RECORD_SIZE = 256 << 10
"""Records hold key parts (a few KB); anything larger is not one."""
UNSIGNED = "unsigned"


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


class BadRecordError(ValueError):
    """A remote record is malformed; the message says how."""


@dataclass(frozen=True)
class Record:
    """A key's commit point: which entry file holds it."""

    key: str
    parts: dict[str, Any]
    sha256: str
    size: int
    signer: str = UNSIGNED
    signature: str | None = None
    """Hex Ed25519 signature of signed_bytes(), for "ed25519-..." signers."""

    def signed_bytes(self) -> bytes:
        """What an Ed25519 signature covers: the record without its signature."""
        fields = {
            "format": RECORD_FORMAT,
            "key": self.key,
            "parts": self.parts,
            "sha256": self.sha256,
            "size": self.size,
            "signer": self.signer,
        }
        return b"pjrt-pool remote record\n" + json.dumps(fields, sort_keys=True).encode()

    def encode(self) -> bytes:
        """The record's JSON bytes."""
        fields = json.loads(self.signed_bytes().split(b"\n", 1)[1])
        if self.signature is not None:
            fields["signature"] = self.signature
        return json.dumps(fields, sort_keys=True).encode()


def decode_record(data: bytes, key: str, signer: str) -> Record:
    """Parses a record read under record_name(key, signer); raises BadRecordError."""
    if len(data) > MAX_RECORD_SIZE:
        raise BadRecordError(f"the record is {len(data)} bytes, over {MAX_RECORD_SIZE}")
    try:
        fields = parse_json(data)
    except ValueError as error:
        raise BadRecordError(f"the record is not JSON: {error}") from None
    if not isinstance(fields, dict) or fields.get("format") != RECORD_FORMAT:
        raise BadRecordError("the record is not a JSON object of format 1")
    if fields.get("key") != key or fields.get("signer") != signer:
        raise BadRecordError(
            f"the record names key {fields.get('key')!r} and signer {fields.get('signer')!r}, "
            f"not the {key} and {signer} of its name"
        )
    parts, sha256, size = fields.get("parts"), fields.get("sha256"), fields.get("size")
    signature = fields.get("signature")
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
    if signature is not None and not isinstance(signature, str):
        raise BadRecordError("the record's signature is not text")
    return Record(key, parts, sha256, size, signer, signature)


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
