"""Where the remote tier lives, and how long a process gives it.

The remote comes from an argument, else ``PJRT_POOL_CACHE_REMOTE``; an empty
value (or False) turns it off. Its URL names the store and a prefix inside
it: ``s3://bucket/prefix`` (S3-compatible servers through AWS_ENDPOINT_URL),
``gs://bucket/prefix``, ``az://container/prefix``, ``file:///path`` (an NFS
mount, a local directory) and ``http(s)://host/path`` (read-only).
Credentials never come from here: each store reads its own standard
environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, AZURE_*).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from worker.cache.location import YES, flag_from_environment, number_from_environment
from worker.extras import STORE_FEATURES, Feature, require

REMOTE_ENV = "PJRT_POOL_CACHE_REMOTE"
"""The remote tier's URL; unset or empty: no remote."""
READ_ONLY_ENV = "PJRT_POOL_CACHE_REMOTE_READ_ONLY"
"""1: this process reads the remote and never writes it (serving hosts)."""
TIMEOUT_ENV = "PJRT_POOL_CACHE_REMOTE_TIMEOUT"
"""Seconds one request may take to connect, or go without a byte of its answer (default
DEFAULT_TIMEOUT): it bounds a stall, not a transfer."""
DEADLINE_ENV = "PJRT_POOL_CACHE_REMOTE_DEADLINE"
"""Seconds one whole lookup or publish may take, retries included, before its entry's bytes
(default DEFAULT_DEADLINE); Limits.deadline_for adds the time the entry may take to move."""

DEFAULT_TIMEOUT = 10.0
DEFAULT_DEADLINE = 30.0
DEFAULT_MIN_RATE = float(1 << 20)
"""Bytes per second an entry is given to move (8 Mbit/s, slower than any link a fleet shares a
cache over): a lookup or publish of n bytes may take n / DEFAULT_MIN_RATE seconds more."""
DEFAULT_RETRIES = 3
"""Retries of one request on throttling (429), 5xx answers and dropped connections."""
MAX_SECONDS = 86400.0
"""The most seconds a time setting of the tier takes (a day): every one bounds a wait, and
the clocks and the store's client those waits go through overflow long before infinity."""

Scheme = Literal["s3", "gs", "az", "file", "http", "https"]
SCHEMES: tuple[Scheme, ...] = ("s3", "gs", "az", "file", "http", "https")
READ_ONLY_SCHEMES = frozenset({"http", "https"})
"""Plain HTTP servers take no conditional writes: the tier only reads them."""


@dataclass(frozen=True)
class RemoteLocation:
    """A parsed remote URL: the store's scheme and the URL the client opens."""

    url: str
    """The URL as given (it may hold a token in its query: never print it, see shown)."""
    scheme: Scheme
    read_only: bool
    """Whether this process never writes it (explicit, or the scheme takes no writes)."""

    @property
    def shown(self) -> str:
        """The URL for messages: without user information, query or fragment."""
        return redact(self.url)

    def require_client(self) -> None:
        """Raises MissingExtraError unless the package this store's client needs is installed:
        obstore for every scheme but file:// (worker.extras names the extra of each)."""
        if self.scheme != "file":
            require(STORE_FEATURES.get(self.scheme, Feature.HTTP))


def redact(url: str) -> str:
    """Returns url without what may carry a credential (user:password@, ?query, #fragment)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def redact_text(text: str) -> str:
    """Removes query strings and user information from every URL in an error's text."""
    text = re.sub(r"(\b[a-z][a-z0-9+.-]*://)[^/\s@]*@", r"\1", text, flags=re.IGNORECASE)
    return re.sub(r"\?[^\s\"'<>]*", "?...", text)


def parse_remote(url: str, read_only: bool | None = None) -> RemoteLocation:
    """Checks a remote URL and returns its location; raises ValueError saying what is wrong.

    read_only None reads PJRT_POOL_CACHE_REMOTE_READ_ONLY.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"the remote cache URL {url!r} is empty: give s3://bucket/prefix or alike")
    url = url.strip()
    scheme = urlsplit(url).scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(
            f"the remote cache URL {redact(url)!r} has scheme {scheme!r}; use one of "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    parts = urlsplit(url)
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"{redact(url)!r}: a file URL names an absolute path, file:///dir")
    elif not parts.netloc:
        raise ValueError(f"{redact(url)!r} names no bucket, container or host")
    if "//" in parts.path:
        raise ValueError(
            f"{redact(url)!r}: its path has an empty segment (//), which the store refuses; "
            "write one slash between names"
        )
    explicit = flag_from_environment(READ_ONLY_ENV) if read_only is None else read_only
    return RemoteLocation(url, scheme, explicit or scheme in READ_ONLY_SCHEMES)  # type: ignore[arg-type]


def resolve_remote(remote: str | Literal[False] | None) -> RemoteLocation | None:
    """The remote an argument names: a URL, False (none), or None (PJRT_POOL_CACHE_REMOTE)."""
    if remote is False:
        return None
    if remote is None:
        remote = os.environ.get(REMOTE_ENV, "")
        if not remote.strip():
            return None
        try:
            return parse_remote(remote)
        except ValueError as error:
            raise ValueError(f"{REMOTE_ENV}: {error}") from None
    return parse_remote(remote)


ENDPOINT_ENV: dict[Scheme, tuple[str, ...]] = {
    "s3": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"),
    "gs": ("GOOGLE_BASE_URL",),
    "az": ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT"),
}
"""The variables each store reads its endpoint from (a MinIO, fake-gcs-server or Azurite)."""
EMULATOR_ENV = "AZURE_STORAGE_USE_EMULATOR"
"""Azure's switch to Azurite, which listens on plain http."""


def plain_http(location: RemoteLocation) -> bool:
    """Whether the store is reached over plain http, as the user configured it (an http URL,
    an http:// endpoint in the store's own variables, Azurite): the client refuses http
    unless told."""
    if location.scheme == "http":
        return True
    if location.scheme == "az" and os.environ.get(EMULATOR_ENV, "").strip().lower() in YES:
        return True
    names = ENDPOINT_ENV.get(location.scheme, ())
    endpoint = next((os.environ[name] for name in names if os.environ.get(name, "").strip()), "")
    return endpoint.strip().lower().startswith("http://")


def seconds_from_environment(name: str, default: float) -> float:
    """A number of seconds above 0 and at most MAX_SECONDS from the environment, default when
    unset or empty; raises ValueError naming the variable and the range otherwise."""
    wanted = f"give a number of seconds above 0 and at most {MAX_SECONDS:g} (a day)"
    return number_from_environment(name, float, default, _in_range, wanted)


def _in_range(seconds: float) -> bool:
    return 0 < seconds <= MAX_SECONDS  # NaN fails both


@dataclass(frozen=True)
class Limits:
    """How long the remote may take: one request's stall, and one whole lookup or publish."""

    timeout: float = DEFAULT_TIMEOUT
    """Seconds to connect, or without a byte of an answer: a hung server costs this per try."""
    deadline: float = DEFAULT_DEADLINE
    """Seconds a lookup or publish may take, retries included, besides its entry's transfer."""
    retries: int = DEFAULT_RETRIES
    min_rate: float = DEFAULT_MIN_RATE
    """Bytes per second an entry is given to move (see deadline_for)."""

    def deadline_for(self, size: int) -> float:
        """Seconds a lookup or publish of an entry of size bytes may take: deadline, plus its
        transfer at min_rate, so that a large entry over a slow but steady link arrives and a
        hung server still costs one deadline (grown by the size the record announced)."""
        return self.deadline + max(0, size) / self.min_rate

    @classmethod
    def from_environment(cls) -> Limits:
        """Reads PJRT_POOL_CACHE_REMOTE_TIMEOUT and _DEADLINE; raises ValueError if malformed."""
        timeout = seconds_from_environment(TIMEOUT_ENV, DEFAULT_TIMEOUT)
        deadline = seconds_from_environment(DEADLINE_ENV, max(DEFAULT_DEADLINE, timeout))
        return cls(timeout=min(timeout, deadline), deadline=deadline)
