"""Signed cache entries: an HMAC-SHA256 that only holders of a secret can make.

Directory permissions say who may write a cache. Where they cannot say it
(a cache on a shared or network filesystem, a cache copied between
machines, a group larger than the people who should write it), a secret
can: with ``PJRT_POOL_CACHE_SECRET`` (the secret itself) or
``PJRT_POOL_CACHE_KEY_FILE`` (a file holding it) set, every entry written
carries an HMAC-SHA256 made with the secret, and every entry read must carry
one that matches. An unsigned entry, one signed with another secret, or one
changed after signing is refused (counted in CacheCounters.bad_signatures)
and compiled again, so that whoever can write the directory but does not
hold the secret cannot choose the machine code a reader loads.

The MAC covers the entry's prefix and JSON header, and the header holds the
SHA-256 of the payload, which the reader checks anyway; so the MAC covers the
payload too without hashing it a second time. A process without a secret
reads signed and unsigned entries alike (it checks digests, not MACs).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from worker.untrusted import read_file

SECRET_ENV = "PJRT_POOL_CACHE_SECRET"
"""The signing secret itself (at least MIN_SECRET_BYTES bytes)."""
KEY_FILE_ENV = "PJRT_POOL_CACHE_KEY_FILE"
"""A file holding the signing secret (used when PJRT_POOL_CACHE_SECRET is not set)."""
MIN_SECRET_BYTES = 16
MAC_SIZE = 32
_HOW_TO_MAKE = "for example: python -c 'import secrets; print(secrets.token_hex(32))'"


class Signer:
    """Signs and checks entries with one secret."""

    def __init__(self, secret: bytes, source: str) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the cache signing secret from {source} is {len(secret)} bytes; use at least "
                f"{MIN_SECRET_BYTES} random bytes ({_HOW_TO_MAKE})"
            )
        # Imported here, when a secret is set: every process that reads an entry
        # imports this module, and most sign nothing (hmac costs a few ms).
        import hmac

        self._hmac = hmac
        self._secret = secret
        self.source = source
        """Where the secret came from (an environment variable or a file), for messages."""
        self.key_id = hmac.new(secret, b"pjrt-pool cache key id", hashlib.sha256).hexdigest()[:16]
        """Names the secret without revealing it: entries record the key_id that signed them."""

    def sign(self, data: bytes | memoryview) -> bytes:
        """Returns the MAC of data."""
        return self._hmac.new(self._secret, data, hashlib.sha256).digest()

    def verify(self, data: bytes | memoryview, mac: bytes | memoryview) -> bool:
        """Returns whether mac is data's MAC under this secret (in constant time)."""
        return self._hmac.compare_digest(self.sign(data), bytes(mac))

    def __repr__(self) -> str:
        return f"<Signer key_id={self.key_id} from {self.source}>"


MAX_KEY_FILE_BYTES = 4096
"""A key file holds a secret of a few dozen bytes; anything much larger is not one."""


def read_key_file(
    path: str, *, variable: str, limit: int, what: str, secret: str, suggest_group: bool = False
) -> bytes:
    """Reads a file holding a key (this module's secret, a remote's private key), named by the
    environment variable `variable`: checked on the opened descriptor (fstat) before a
    bounded read (worker.untrusted.read_file).

    Opened without blocking, so that a FIFO cannot hang the process, and
    refused unless it is a regular file (``/dev/zero`` would never end) of at
    most `limit` bytes that others cannot read or change and its group
    cannot change: ValueError naming the variable, `secret` (what the file
    holds) and the chmod that fixes it (640 too, with suggest_group). Raises
    OSError when it cannot be read.
    """

    def private(found: os.stat_result) -> None:
        mode = stat.S_IMODE(found.st_mode)
        if mode & (stat.S_IRWXO | stat.S_IWGRP):
            group = " (or 640 to share it with your group)" if suggest_group else ""
            raise ValueError(
                f"{variable}={path} has mode {mode:04o}: others can read or change {secret}; "
                f"run 'chmod 600 {path}'{group}"
            )

    return read_file(Path(path).expanduser(), limit, follow_symlinks=True, what=what, check=private)


def _read_key_file(path: str) -> bytes:
    """Reads the signing secret from a key file (read_key_file), without its surrounding
    whitespace."""
    try:
        secret = read_key_file(
            path,
            variable=KEY_FILE_ENV,
            limit=MAX_KEY_FILE_BYTES,
            what="signing key file",
            secret="the cache signing key",
            suggest_group=True,
        )
    except OSError as error:
        raise ValueError(f"{KEY_FILE_ENV}={path}: cannot read the signing key: {error}") from None
    return secret.strip()


def signer_from_environment() -> Signer | None:
    """Returns the Signer that PJRT_POOL_CACHE_SECRET or PJRT_POOL_CACHE_KEY_FILE configure.

    None when neither is set. Raises ValueError for a secret that is too
    short, or a key file that cannot be read or that others can read.
    """
    secret = os.environ.get(SECRET_ENV)
    if secret:
        return Signer(secret.encode(), f"the environment variable {SECRET_ENV}")
    key_file = os.environ.get(KEY_FILE_ENV)
    if key_file:
        return Signer(_read_key_file(key_file), f"{KEY_FILE_ENV}={key_file}")
    return None
