"""What a reader checks before it uses anything it downloaded.

A record, in this order: its header (layout.split_record), then its
signature over the raw body when this process has a public key (Ed25519)
or the shared secret (HMAC), before any of it is parsed; then its form and
name (layout.parse_record_body), then that its key parts hash to the key
this host computed (so it was built for this host's plugin, options,
environment and CPU). An entry file: its size against the record before it is
read (client.get's bound), the SHA-256 the record names, then everything
the local cache checks (worker.cache.entry.verify: header digest, payload
digest, key, key parts, and the HMAC when a secret is set). Anything that
fails is refused, never loaded.
"""

from __future__ import annotations

import hashlib

from worker.cache import entry as entry_format
from worker.cache.remote.layout import (
    BadRecordError,
    NewRecordError,
    OldRecordError,
    Record,
    parse_record_body,
    signed_bytes,
    split_record,
)
from worker.cache.remote.signing_keys import RecordKeys
from worker.cache.signing import Signer
from worker.errors import PjrtPoolError
from worker.identity.keys import key_of


class RefusedObjectError(PjrtPoolError):
    """A remote object failed a check; the message says which."""


class OlderRecordError(RefusedObjectError):
    """A record of an older format (layout.OldRecordError): a miss, not a damaged object."""


class NewerRecordError(RefusedObjectError):
    """A record of a newer format (layout.NewRecordError): refused, and left as it is."""


def checked_record(
    data: bytes,
    key: str,
    signer: str,
    keys: RecordKeys | None,
    hmac_signer: Signer | None = None,
) -> Record:
    """Checks a key's record, its signature first, then parses it; raises RefusedObjectError
    (OlderRecordError, NewerRecordError for a record of an older, a newer format)."""
    try:
        signature, body = split_record(data)
        _check_signature(signature, body, keys, hmac_signer)
        record = parse_record_body(body, key, signer)
    except OldRecordError as error:
        raise OlderRecordError(str(error)) from None
    except NewRecordError as error:
        raise NewerRecordError(str(error)) from None
    except BadRecordError as error:
        raise RefusedObjectError(str(error)) from None
    if key_of(record.parts) != key:
        raise RefusedObjectError("the record's key parts do not hash to its key")
    return record


def sign_record(body: bytes, keys: RecordKeys | None, hmac_signer: Signer | None) -> str | None:
    """The hex signature a record body carries: Ed25519 with keys, else the HMAC, else none."""
    if keys is not None:
        return keys.sign(signed_bytes(body))
    if hmac_signer is not None:
        return hmac_signer.sign(signed_bytes(body)).hex()
    return None


def _check_signature(
    signature: str | None, body: bytes, keys: RecordKeys | None, hmac_signer: Signer | None
) -> None:
    """Raises RefusedObjectError unless the body carries the signature this process needs
    (sign_record's choice); over the raw bytes, nothing parsed yet."""
    if keys is not None:
        if not keys.verify(signed_bytes(body), signature):
            raise RefusedObjectError(f"the record's signature is not {keys.signer}'s")
    elif hmac_signer is not None:
        even = signature is not None and len(signature) % 2 == 0
        mac = bytes.fromhex(signature) if even else b""  # split_record let only hex through
        if not hmac_signer.verify(signed_bytes(body), mac):
            raise RefusedObjectError(f"the record's MAC is not hmac-{hmac_signer.key_id}'s")


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
