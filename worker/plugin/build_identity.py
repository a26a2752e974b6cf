"""A plugin's build identity (its library's SHA-256): which installation vouches for it.

A default plugin (worker.plugin.locate) is a file of an installed wheel, and
the wheel's RECORD may vouch for its digest without hashing 200 MB
(worker.identity.build says when it does); otherwise the library is hashed
once and memoized there. This module ties the two to a plugin's path:
installed_sha256 asks the RECORD of the default package the library belongs
to, and plugin_build_sha256 gives the digest either way, remembered in this
process per file identity (worker.identity.build's one memo).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from worker.identity.build import dist_info_of, plugin_digest, recorded_sha256, remembered
from worker.plugin.locate import installed_default_library

if TYPE_CHECKING:
    from worker.cache.memos import MemoStore


def installed_sha256(path: str) -> str | None:
    """The digest the installed default package's RECORD vouches for a plugin library, or None."""
    installed = installed_default_library(path)
    if installed is None:
        return None
    library, site, distribution = installed
    dist_info = dist_info_of(site, distribution)
    return None if dist_info is None else recorded_sha256(library, site, dist_info)


def plugin_build_sha256(path: str, memos: Callable[[], MemoStore | None]) -> str:
    """The SHA-256 of a plugin library: from its installed RECORD when that vouches for it,
    else hashed once and memoized (in the records memos() returns, asked only then:
    opening a cache has its own cost).

    Asked on every executable a process loads or serializes, so the answer
    is remembered in memory per file identity (real path, size, mtime,
    ctime, inode).
    """
    return remembered(
        path, "build-sha256", lambda: installed_sha256(path) or plugin_digest(path, memos())
    )
