"""Where JAX cache entries go: a JAX cache directory's files, or pjrt-pool's own stores.

JAX (jax._src.compilation_cache, every checked version) files a value under
``<key>-cache`` in its cache directory; the value's format is
worker.cache.jax_values'. A warm for JAX's cache (JaxCacheDestination) files
each value in pjrt-pool's disk cache and remote tier (worker.compile.for_jax),
where a script that called install() reads it, and, for a directory, copies
it there as JAX's file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Literal, NamedTuple

from pool.jax_cache.target import JaxTarget
from worker.cache.blobs import BlobStore
from worker.cache.open_caches import open_cache
from worker.cache.remote import open_remote
from worker.compile.for_jax import entry_parts

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


class JaxCacheDestination(NamedTuple):
    """Where a warm puts JAX cache entries, and the target they are made for."""

    target: JaxTarget
    """The machine whose JAX reads them."""

    directory: str | None = None
    """A JAX cache directory to write each entry's file into (the target's
    jax_compilation_cache_dir, or a copy of it); None: pjrt-pool's stores only, for scripts
    that call install()."""


class JaxFiles:
    """Copies values filed in pjrt-pool's stores into a JAX cache directory, as JAX's files."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        cache_dir: str | os.PathLike[str] | None,
        remote: str | Literal[False] | None,
    ) -> None:
        self.directory = Path(directory)
        self._store = BlobStore(open_cache(cache_dir), open_remote(remote))

    def write(self, jax_key: str) -> Path:
        """Writes JAX's file of a key whose value a worker filed; raises ValueError when the
        value is in none of the stores (the disk cache could not keep it)."""
        value = self._store.get(entry_parts(jax_key), claim=False)
        if value is None:
            raise ValueError(
                f"the value of {jax_key} is in neither the disk cache nor the remote tier: "
                "warm into a writable cache directory with room (or with a remote tier)"
            )
        return write_entry(self.directory, jax_key, value)
