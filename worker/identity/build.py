"""A plugin build's identity (its library's SHA-256), and what else is computed from its library.

Every cache key and executable stamp names the plugin by its library's
SHA-256. Hashing the CPU plugin takes about 0.2 s (a CUDA plugin, hundreds
of MB, a second or so), which a process pays unless something vouches for
the digest:

1. The installed distribution's RECORD. A default plugin
   (worker.plugin.locate) is a file of a wheel, and the installer writes the
   dist-info's RECORD, with each file's SHA-256 and size, after it has
   written the files. The digest is taken from there when all of this holds
   (recorded_sha256; else the file is hashed):

   - the library is a regular file and RECORD, read from the one dist-info
     of that distribution next to the package (dist_info_of), names exactly
     this file (resolved, within that site directory) with a sha256 and a
     size;
   - the file's size is the size RECORD gives;
   - the file's mtime is not later than RECORD's: any write to the file
     after the installation (in place, truncation, or a new file moved
     over it) sets its mtime to the time of that write, later than RECORD's.

   What this assumes: that the wheel's RECORD is right (pip copies the
   wheel's rows without rehashing the files; auditwheel and the wheel
   builders compute them), and that nobody replaced the library with a file
   of the same size whose mtime was set back to before the installation
   (``cp -p``, ``touch -r`` or an archive holding another build), nor wrote
   it within the clock tick (a few ms) in which RECORD was written. Copying a
   whole environment with its timestamps (``cp -a``, a container image)
   keeps both mtimes, so the digest still comes from RECORD there, which is
   the case this serves: a read-only host with no cache directory. A wrong
   digest cannot make an executable run on another build unnoticed unless
   a RECORD claims exactly another build's digest: a mismatch shows as a
   cache miss (another key), never as a load.

2. Otherwise the file is hashed once (plugin_digest) and memoized.

Which installed package a library is belongs to plugin discovery:
worker.plugin.build_identity puts the two together for a plugin's path.

One memo serves every value computed from a library (its digest, whether it
names an XLA flag, a probe of its StableHLO window): remembered keeps a value
in this process's memory per (kind, real path, size, mtime, ctime, inode),
and memoized_by_file also in a cache's ``plugins/`` records, for later
processes (signed when entries are: see worker.cache.memos). A record is
named after the kind and (real path, size, mtime, inode), the identity
records have always had, and holds that identity; a rebuilt or replaced
file has another and is computed again.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import hashlib
import io
import os
import re
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from worker.identity.keys import is_key
from worker.untrusted import read_file


class Memos(Protocol):
    """Where values are kept for later processes: a cache's plugins/ records
    (worker.cache.memos.MemoStore)."""

    def read(self, name: str) -> dict[str, Any] | None:
        """The record of that name, if there is one to trust."""

    def write(self, name: str, record: dict[str, Any]) -> None:
        """Writes a record; raises OSError when it cannot."""


class FileIdentity(NamedTuple):
    """A file as it is now: a value computed from it holds while all of this stays."""

    real_path: str
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int

    def recorded(self) -> tuple[str, int, int, int]:
        """The identity a record in plugins/ is named by and holds (without the ctime)."""
        return (self.real_path, self.size, self.mtime_ns, self.inode)


def file_identity(path: str) -> FileIdentity:
    """The identity of the file at path now; raises OSError when it cannot be read."""
    found = os.stat(path)
    return FileIdentity(
        os.path.realpath(path), found.st_size, found.st_mtime_ns, found.st_ctime_ns, found.st_ino
    )


_file_memo: dict[tuple[str, FileIdentity], Any] = {}
"""This process's values, per (kind, identity of the file they were computed from)."""
_memo_lock = threading.Lock()


def remembered(path: str, kind: str, compute: Callable[[], Any]) -> Any:
    """Returns compute() for a file, computed once per file identity in this process."""
    return _remembered(file_identity(path), kind, compute)


def _remembered(identity: FileIdentity, kind: str, compute: Callable[[], Any]) -> Any:
    with _memo_lock:
        if (kind, identity) in _file_memo:
            return _file_memo[kind, identity]
    value = compute()
    with _memo_lock:
        _file_memo[kind, identity] = value
    return value


def memoized_by_file(
    path: str,
    memos: Memos | None,
    kind: str,
    compute: Callable[[], Any],
    valid: Callable[[Any], bool] = lambda value: True,
) -> Any:
    """Returns compute() for a file, memoized per file identity (see the module).

    The value is kept in memory and, when memos is given (a cache's
    plugins/ records), in a record there named after `kind` and the
    identity, so that later processes reuse it; a rebuilt or replaced file
    has a new identity and is computed again, and so is a record that
    cannot be trusted (see worker.cache.memos) or whose value fails
    `valid`. The value must be JSON-ready.
    """
    identity = file_identity(path)
    recorded = identity.recorded()
    name = f"{kind}-{hashlib.sha256(repr(recorded).encode()).hexdigest()[:32]}.json"

    def from_record_or_computed() -> Any:
        record = memos.read(name) if memos is not None else None
        if (
            record is not None
            and record.get("identity") == list(recorded)
            and "value" in record
            and valid(record["value"])
        ):
            return record["value"]
        value = compute()
        if memos is not None:
            # A read-only cache: the in-memory memo still serves this process.
            with contextlib.suppress(OSError):
                memos.write(name, {"identity": list(recorded), "value": value})
        return value

    return _remembered(identity, kind, from_record_or_computed)


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def plugin_digest(path: str, memos: Memos | None) -> str:
    """Returns the SHA-256 of a plugin library, hashed once and memoized (memoized_by_file)."""
    return memoized_by_file(path, memos, "sha256", lambda: _file_digest(path), is_key)


RECORD_LIMIT = 16 << 20
"""Bytes a RECORD may have (jaxlib's, thousands of files, is about 1 MB)."""

_ESCAPE = re.compile(r"[-_.]+")


def dist_info_of(site: Path, distribution: str) -> Path | None:
    """The one ``NAME-VERSION.dist-info`` of a distribution in a site directory, or None.

    None when there is none or more than one (an installation left half
    removed): then nothing says which RECORD describes the files.
    """
    prefix = _ESCAPE.sub("_", distribution).lower() + "-"
    try:
        found = [
            entry.path
            for entry in os.scandir(site)
            if entry.name.endswith(".dist-info") and entry.name.lower().startswith(prefix)
        ]
    except OSError:
        return None
    return Path(found[0]) if len(found) == 1 else None


def recorded_sha256(library: str | os.PathLike[str], site: Path, dist_info: Path) -> str | None:
    """The SHA-256 (hex) that dist_info's RECORD vouches for the library as it is now, or None.

    See the module for what must hold; None whenever any of it does not
    (and so the caller hashes the file).
    """
    real = os.path.realpath(library)
    record = dist_info / "RECORD"
    try:
        found = os.stat(real)
        record_stat = os.stat(record)
        text = read_file(record, RECORD_LIMIT, follow_symlinks=True, what="RECORD").decode()
    except (OSError, UnicodeDecodeError):
        return None
    if not stat.S_ISREG(found.st_mode) or found.st_mtime_ns > record_stat.st_mtime_ns:
        return None
    named = os.path.normpath(library)
    for row in csv.reader(io.StringIO(text)):
        if len(row) != 3 or os.path.normpath(site / row[0]) != named:
            continue
        if os.path.realpath(site / row[0]) != real:
            return None
        algorithm, _, encoded = row[1].partition("=")
        if algorithm != "sha256" or row[2] != str(found.st_size):
            return None
        try:
            digest = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        except ValueError:
            return None
        return digest.hex() if len(digest) == 32 else None
    return None
