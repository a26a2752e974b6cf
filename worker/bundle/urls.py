"""Whether a bundle is named by a URL, and how a URL is shown, without the remote's modules.

Kept apart from remote.py so that opening a bundle file, or a manifest,
imports nothing of the remote tier (its package imports its whole client
side, about 20 ms): remote.py is imported when a URL is opened.
"""

from __future__ import annotations

import os
import re
from typing import TypeGuard

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: object) -> TypeGuard[str]:
    """Whether a bundle path is a URL (scheme://...) rather than a file name."""
    return isinstance(path, str) and _URL.match(path) is not None


def shown(path: str | os.PathLike[str]) -> str:
    """A bundle's path for messages: a URL without what may carry a credential."""
    if not is_url(path):
        return os.fspath(path)
    from worker.cache.remote.location import redact

    return redact(path)


def bundle_source(path: object) -> str | None:
    """Where another process opens a bundle again: a URL as given, a file's absolute path;
    None for None. Raises TypeError for what is neither a path nor a URL."""
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"bundle must be a path or a URL, not {type(path).__name__} {path!r:.80}")
    return os.fspath(path) if is_url(path) else os.path.abspath(path)
