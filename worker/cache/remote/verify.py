"""What a reader checks before it uses anything it downloaded.

A record: its form and name (layout.decode_record), that its key parts hash
to the key this host computed (so it was built for this host's plugin,
options, environment and CPU), and its Ed25519 signature when this process
has a public key. An entry file: its size against the record before it is
read (client.get's bound), the SHA-256 the record names, then everything
the local cache checks (worker.cache.entry.verify: header digest, payload
digest, key, key parts, and the HMAC when a secret is set). Anything that
fails is refused, never loaded.
"""

from __future__ import annotations

import hashlib

from worker.cache import entry as entry_format
from worker.cache.key import key_of
from worker.cache.remote.keys import RecordKeys
from worker.cache.remote.layout import BadRecordError, Record, decode_record
from worker.cache.signing import Signer


class RefusedObjectError(Exception):
    """A remote object failed a check; the message says which."""


def checked_record(data: bytes, key: str, signer: str, keys: RecordKeys | None) -> Record:
    """Parses and checks a key's record; raises RefusedObjectError."""
    try:
        record = decode_record(data, key, signer)
    except BadRecordError as error:
        raise RefusedObjectError(str(error)) from None
    if key_of(record.parts) != key:
        raise RefusedObjectError("the record's key parts do not hash to its key")
    if keys is not None and not keys.verify(record.signed_bytes(), record.signature):
        raise RefusedObjectError(f"the record's signature is not {keys.signer}'s")
    return record


def checked_entry(data: bytes, record: Record, hmac_signer: Signer | None) -> entry_format.Entry:
    """Verifies a downloaded entry file against its record; raises RefusedObjectError."""
    if len(data) != record.size:
        raise RefusedObjectError(f"the entry is {len(data)} bytes, its record says {record.size}")
    if hashlib.sha256(data).hexdigest() != record.sha256:
        raise RefusedObjectError("the entry's SHA-256 is not the one its record names")
    try:
        entry = entry_format.verify(data, record.key, hmac_signer)
    except entry_format.CorruptEntryError as error:
        raise RefusedObjectError(f"the entry failed verification: {error}") from None
    if entry.parts != record.parts:
        raise RefusedObjectError("the entry's key parts differ from its record's")
    return entry
