"""The cache's file locks: flock-based, with lock files that are never deleted.

A lock file is only ever created, never removed: removing one while a
process waits on its inode would let a newcomer lock a fresh file at the
same path, and two processes would hold "the" lock at once. filelock's soft
fallback (for file systems without flock) deletes its marker on release, so
it is refused; such a file system gets no locking and, since correctness
never depends on the locks, at worst duplicate compiles.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import filelock

_OPTIONS: dict[str, Any] = {"mode": 0o600, "thread_local": False}
_accepted = inspect.signature(filelock.FileLock.__init__).parameters
if "preserve_lock_file" in _accepted:
    _OPTIONS["preserve_lock_file"] = True
if "fallback_to_soft" in _accepted:
    _OPTIONS["fallback_to_soft"] = False


def try_acquire(path: Path, timeout: float, mode: int = 0o600) -> filelock.BaseFileLock | None:
    """Returns the held lock at path, or None if it was not free within timeout seconds.

    timeout 0 tries once. mode is the lock file's mode when it is created
    (0o660 for a group-shared cache). Raises OSError when the lock file cannot
    be created or opened (a read-only directory, say). The caller releases
    the lock. filelock opens lock files without following symlinks.
    """
    lock = filelock.FileLock(path, timeout=max(timeout, 0.0), **{**_OPTIONS, "mode": mode})
    try:
        lock.acquire()
    except filelock.Timeout:
        return None
    return lock
