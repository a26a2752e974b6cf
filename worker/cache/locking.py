"""The cache's file locks: flock-based, with lock files that are never deleted.

A lock file is only ever created, never removed: removing one while a
process waits on its inode would let a newcomer lock a fresh file at the
same path, and two processes would hold "the" lock at once. filelock's soft
fallback (for file systems without flock) deletes its marker on release, so
it is refused; such a file system gets no locking and, since correctness
never depends on the locks, at worst duplicate compiles.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import filelock


@functools.cache
def _filelock() -> tuple[Any, dict[str, Any]]:
    """The filelock module and the options this version of it takes."""
    # Imported at the first lock, not with the cache: a process that only loads
    # entries (a cache hit, a manifest run) takes no lock, and filelock with
    # what it imports is most of the cache's import time (~10 ms).
    import filelock

    options: dict[str, Any] = {"mode": 0o600, "thread_local": False}
    accepted = inspect.signature(filelock.FileLock.__init__).parameters
    if "preserve_lock_file" in accepted:
        options["preserve_lock_file"] = True
    if "fallback_to_soft" in accepted:
        options["fallback_to_soft"] = False
    return filelock, options


def try_acquire(path: Path, timeout: float, mode: int = 0o600) -> filelock.BaseFileLock | None:
    """Returns the held lock at path, or None if it was not free within timeout seconds.

    timeout 0 tries once. mode is the lock file's mode when it is created
    (0o660 for a group-shared cache). Raises OSError when the lock file cannot
    be created or opened (a read-only directory, say). The caller releases
    the lock. filelock opens lock files without following symlinks.
    """
    module, options = _filelock()
    lock = module.FileLock(path, timeout=max(timeout, 0.0), **{**options, "mode": mode})
    try:
        lock.acquire()
    except module.Timeout:
        return None
    return lock
