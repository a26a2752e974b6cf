"""Atomic publication of files in a shared directory.

Readers never see a partial file: data goes to a temporary file in the same
directory, is flushed to disk, and is renamed over the target in one step.
A writer killed midway leaves only a temporary file, which is invisible to
readers and removed later by the cache's trim (see TEMP_PREFIX).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

TEMP_PREFIX = ".tmp."
"""Temporary files start with this; anything older than a trim's grace is debris."""


def write_atomically(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Writes data to path so that readers see the old file or the whole new one."""
    temp = path.with_name(f"{TEMP_PREFIX}{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
