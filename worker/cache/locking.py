"""The cache's file locks: flock on lock files that are never deleted.

A lock file is only ever created, never removed: removing one while a
process waits on its inode would let a newcomer lock a fresh file at the
same path, and two processes would hold "the" lock at once.

Lock files are opened relative to the descriptor of the cache's ``locks/``
directory (see folders.py), without following a symlink, and must be regular
files: a lock directory swapped for a symlink, or a FIFO planted at a lock's
name, is never used; nor is one with another hard link (its other name may be
anyone's file). Each acquisition opens the file anew, so two threads of
one process exclude each other as two processes do (flock locks belong to an
open file). A filesystem without flock gets no locking (OSError): since
correctness never depends on the locks, at worst duplicate compiles.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time

_FLAGS = (
    os.O_RDWR
    | os.O_CREAT
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)
_FIRST_POLL = 0.001
_LAST_POLL = 0.05
"""Seconds between tries while another process holds a lock: growing from the first to
the last, so that a short hold is noticed at once and a long one costs little."""


class HeldLock:
    """A lock this process holds; release() gives it up (closing the file)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def release(self) -> None:
        """Releases the lock (calling it again does nothing)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # closing the only descriptor of the open file releases its flock


def try_acquire(
    name: str, timeout: float, mode: int = 0o600, *, dir_fd: int | None = None
) -> HeldLock | None:
    """Returns the held lock of a lock file, or None if it was not free within timeout seconds.

    name is relative to dir_fd when given. timeout 0 tries once. mode is
    the lock file's mode when it is created (0o660 for a group-shared cache,
    set exactly whatever the umask). Raises OSError when the lock file cannot
    be created or opened (a read-only directory, say), is not a regular file
    (EINVAL; ELOOP for a symlink), or cannot be locked. The caller releases
    the lock.
    """
    fd = os.open(name, _FLAGS, mode, dir_fd=dir_fd)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise OSError(errno.EINVAL, "not a regular file, so not a lock file", name)
        if found.st_nlink != 1:
            # A hard link planted at the lock's name: its other name may be anyone's file,
            # which the fchmod below would open up. Never used as a lock.
            raise OSError(errno.EMLINK, "a lock file with other hard links, so not ours", name)
        if mode & 0o077 and found.st_uid == os.geteuid() and stat.S_IMODE(found.st_mode) != mode:
            os.fchmod(fd, mode)  # group members must open it for writing too
        deadline = time.monotonic() + max(timeout, 0.0)
        poll = _FIRST_POLL
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return HeldLock(fd)
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                os.close(fd)
                return None
            time.sleep(min(poll, left))
            poll = min(poll * 2, _LAST_POLL)
    except BaseException:
        os.close(fd)
        raise
