"""A plugin build's identity (its library's SHA-256), without hashing 200 MB in every process.

Every cache key and executable stamp names the plugin by its library's
SHA-256. Hashing the CPU plugin takes about 0.2 s, which a process pays
unless something vouches for the digest:

1. The installed distribution's RECORD. A default plugin
   (worker.plugin.locate) is a file of a wheel, and the installer writes the
   dist-info's RECORD, with each file's SHA-256 and size, after it has
   written the files. The digest is taken from there when all of this holds
   (else the file is hashed):

   - the library is a regular file and RECORD, read from the one dist-info
     of that distribution next to the package, names exactly this file
     (resolved, within that site directory) with a sha256 and a size;
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

2. Otherwise the file is hashed once and memoized by (real path, size,
   mtime, inode) in memory and in a cache's plugins/ records when there is
   a cache (worker.cache.key.plugin_digest).
"""

from __future__ import annotations

import base64
import csv
import io
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from worker.cache.key import plugin_digest
from worker.plugin.locate import installed_default_library
from worker.untrusted import read_file

if TYPE_CHECKING:
    from worker.cache.memos import MemoStore

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


def installed_sha256(path: str) -> str | None:
    """The digest the installed default package's RECORD vouches for a plugin library, or None."""
    installed = installed_default_library(path)
    if installed is None:
        return None
    library, site, distribution = installed
    dist_info = dist_info_of(site, distribution)
    return None if dist_info is None else recorded_sha256(library, site, dist_info)


_memo: dict[tuple[str, int, int, int, int], str] = {}


def plugin_build_sha256(path: str, memos: Callable[[], MemoStore | None]) -> str:
    """The SHA-256 of a plugin library: from its installed RECORD when that vouches for it
    (see the module), else hashed once and memoized (in the records memos() returns,
    asked only then: opening a cache has its own cost).

    Asked on every executable a process loads or serializes, so the answer
    is kept in memory per (real path, size, mtime, ctime, inode).
    """
    found = os.stat(path)
    identity = (
        os.path.realpath(path),
        found.st_size,
        found.st_mtime_ns,
        found.st_ctime_ns,
        found.st_ino,
    )
    digest = _memo.get(identity)
    if digest is None:
        digest = installed_sha256(path) or plugin_digest(path, memos())
        _memo[identity] = digest
    return digest
