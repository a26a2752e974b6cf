"""A file of JAX's persistent cache directory.

JAX (jax._src.compilation_cache, every checked version) files a value under
``<key>-cache`` in its cache directory; the value's format is
worker.cache.jax_values'.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

SUFFIX = "-cache"
"""What JAX appends to a key to name its file."""


def entry_file(directory: str | os.PathLike[str], key: str) -> Path:
    """The file JAX reads a key's value from in a cache directory; raises ValueError for a
    key that would name another place."""
    if not key or "/" in key or "\\" in key or key.startswith(".") or "\0" in key:
        raise ValueError(f"not a JAX cache key: {key!r}")
    return Path(directory) / f"{key}{SUFFIX}"


def write_entry(directory: str | os.PathLike[str], key: str, value: bytes) -> Path:
    """Writes a value into a JAX cache directory atomically (made if missing); returns its
    file. An existing entry of the key is replaced, as JAX itself does."""
    path = entry_file(directory, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=".pjrt-pool-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(value)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
