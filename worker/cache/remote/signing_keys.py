"""Public-key signatures of remote records: CI signs, serving hosts only verify.

With the shared HMAC secret (worker.cache.signing) every reader holds what
forges entries. For a fleet, a writer (CI) holds an Ed25519 private key in
``PJRT_POOL_CACHE_PRIVATE_KEY_FILE`` (a PEM file, mode 600, as ``openssl
genpkey -algorithm ed25519`` writes it) and signs each record it publishes;
readers set ``PJRT_POOL_CACHE_PUBLIC_KEY`` (the 32-byte public key in hex)
and load only records whose signature that key verifies. A record covers
the entry's SHA-256, so it vouches for every byte of the entry. A process
with a public key and no private key never writes the remote: nothing it
wrote would be loaded by the others.

``cryptography`` is imported only when one of these is set; where it is not
installed, MissingExtraError names the remote extra that installs it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

from worker.cache.signing import read_key_file
from worker.extras import Feature, import_for

PRIVATE_KEY_FILE_ENV = "PJRT_POOL_CACHE_PRIVATE_KEY_FILE"
"""A PEM file with the Ed25519 private key that signs remote records (writers only)."""
PUBLIC_KEY_ENV = "PJRT_POOL_CACHE_PUBLIC_KEY"
"""The Ed25519 public key (64 hex digits) that remote records must be signed with."""
MAX_PEM_BYTES = 4096


def _crypto() -> Any:
    """cryptography's ed25519 module; MissingExtraError (the remote extra) without it."""
    return import_for(Feature.ED25519, "cryptography.hazmat.primitives.asymmetric.ed25519")


@dataclass(frozen=True)
class RecordKeys:
    """The public key records must carry a signature of, and the private key if this host signs."""

    public: Any
    private: Any = None

    @property
    def raw_public(self) -> bytes:
        """The public key's 32 bytes."""
        from cryptography.hazmat.primitives import serialization

        return self.public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def signer(self) -> str:
        """The signer name of records these keys vouch for: ed25519-<16 hex of the key's hash>."""
        return "ed25519-" + hashlib.sha256(self.raw_public).hexdigest()[:16]

    def sign(self, data: bytes) -> str:
        """The hex signature of data; raises ValueError without a private key."""
        if self.private is None:
            raise ValueError(f"this process has no private key ({PRIVATE_KEY_FILE_ENV})")
        return self.private.sign(data).hex()

    def verify(self, data: bytes, signature: str | None) -> bool:
        """Whether signature (hex) is the public key's signature of data."""
        from cryptography.exceptions import InvalidSignature

        if signature is None:
            return False
        try:
            self.public.verify(bytes.fromhex(signature), data)
        except (InvalidSignature, ValueError):
            return False
        return True


def _private_file(path: str) -> bytes:
    try:
        return read_key_file(
            path,
            variable=PRIVATE_KEY_FILE_ENV,
            limit=MAX_PEM_BYTES,
            what="private key file",
            secret="the signing key",
        )
    except OSError as error:
        raise ValueError(f"{PRIVATE_KEY_FILE_ENV}={path}: cannot read it: {error}") from None


def keys_from_environment() -> RecordKeys | None:
    """The keys PJRT_POOL_CACHE_PRIVATE_KEY_FILE and PJRT_POOL_CACHE_PUBLIC_KEY configure.

    None when neither is set. Raises ValueError for a malformed key, a key
    file others can read, or a private key whose public half is not the
    configured public key; MissingExtraError without the cryptography package.
    """
    private_path = os.environ.get(PRIVATE_KEY_FILE_ENV, "").strip()
    public_hex = os.environ.get(PUBLIC_KEY_ENV, "").strip()
    if not private_path and not public_hex:
        return None
    ed25519 = _crypto()
    public = None
    if public_hex:
        try:
            public = ed25519.Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))
        except ValueError:
            raise ValueError(
                f"{PUBLIC_KEY_ENV} must be an Ed25519 public key as 64 hex digits"
            ) from None
    if not private_path:
        return RecordKeys(public)
    from cryptography.hazmat.primitives import serialization

    pem = _private_file(private_path)  # its ValueError names the variable already
    try:
        private = serialization.load_pem_private_key(pem, password=None)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{PRIVATE_KEY_FILE_ENV}={private_path}: {error}") from None
    if not isinstance(private, ed25519.Ed25519PrivateKey):
        raise ValueError(f"{PRIVATE_KEY_FILE_ENV}={private_path} is not an Ed25519 private key")
    keys = RecordKeys(private.public_key(), private)
    if public is not None and RecordKeys(public).raw_public != keys.raw_public:
        raise ValueError(
            f"the private key in {PRIVATE_KEY_FILE_ENV} does not belong to {PUBLIC_KEY_ENV}"
        )
    return keys


def generate_private_key(path: str | os.PathLike[str]) -> str:
    """Writes a new Ed25519 private key as PEM (mode 600); returns its public key in hex.

    Raises MissingExtraError without the cryptography package (the remote extra)."""
    ed25519 = _crypto()
    from cryptography.hazmat.primitives import serialization

    private = ed25519.Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(pem)
    return RecordKeys(private.public_key(), private).raw_public.hex()
