"""Atomic publication of files in a shared directory.

Readers never see a partial file: data goes to a temporary file in the same
directory, is flushed to disk, and is renamed over the target in one step;
then the directory is flushed, so that the rename survives a power loss.
A writer killed midway leaves only a temporary file, which is invisible to
readers and removed later by the cache's trim (see TEMP_PREFIX).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path

from worker.wire.fds import close_quietly

TEMP_PREFIX = ".tmp."
"""Temporary files start with this; anything older than a trim's grace is debris."""

# posix_fallocate errors that mean "this file system cannot preallocate", not "full".
_NO_PREALLOCATION = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}


class PendingFile:
    """A temporary file beside `path`, created now and renamed over `path` by commit().

    With `size`, the file takes its full size at once (preallocated where the
    file system can), so that whoever measures the directory from then on
    counts the bytes about to be written, and a full disk fails here rather
    than halfway through the write. With dir_fd, path is a bare file name in
    the directory that descriptor holds, and every step goes through it.
    """

    def __init__(
        self, path: Path, size: int = 0, mode: int = 0o600, *, dir_fd: int | None = None
    ) -> None:
        if dir_fd is not None and len(path.parts) != 1:
            raise ValueError(f"with dir_fd, the path must be a bare file name, not {path}")
        self.path = path
        self.dir_fd = dir_fd
        self.temp = path.with_name(temp_name(path.name))
        self._written = False
        # O_EXCL: never opens an existing file, nor follows a symlink planted at the name.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self._fd: int | None = os.open(self.temp, flags, mode, dir_fd=dir_fd)
        try:
            if mode & 0o077:
                os.fchmod(self._fd, mode)  # a shared cache's group bits, whatever the umask
            if size:
                try:
                    os.posix_fallocate(self._fd, 0, size)
                except OSError as error:
                    if error.errno not in _NO_PREALLOCATION:
                        raise
                    os.ftruncate(self._fd, size)
        except BaseException:
            self.discard()
            raise

    def commit(self, data: bytes) -> None:
        """Writes data, flushes it to disk and renames the file into place."""
        self.write(data)
        self.place()

    def write(self, data: bytes) -> None:
        """Writes data and flushes it to disk; place() then renames the file into place.

        Two steps, so that a caller can make the rename, the only step that
        changes what the directory's names show, under a lock of its own.
        """
        if self._fd is None:
            raise ValueError(f"{self.temp} was written or discarded already")
        try:
            view = memoryview(data)
            written = 0
            while written < len(view):
                written += os.pwrite(self._fd, view[written:], written)
            os.ftruncate(self._fd, len(data))  # in case more was preallocated than written
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            self._written = True
        except BaseException:
            self.discard()
            raise

    def place(self, *, sync: bool = True) -> None:
        """Renames the written file over path (once; discards it if the rename fails).

        Then, with sync, flushes the directory (sync_directory); sync=False
        leaves that to the caller (who may rename under a lock and flush after).
        """
        if not self._written:
            raise ValueError(f"{self.temp} was not written, or was placed or discarded already")
        self._written = False
        try:
            os.replace(self.temp, self.path, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except BaseException:
            self.discard()
            raise
        if sync:
            self.sync()

    def sync(self) -> None:
        """Flushes the directory that holds path, so that a placed file survives a power loss."""
        sync_directory(self.path.parent, dir_fd=self.dir_fd)

    def discard(self) -> None:
        """Closes and removes the temporary file (never raises)."""
        self._written = False
        if self._fd is not None:
            close_quietly(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            os.unlink(self.temp, dir_fd=self.dir_fd)


def sync_directory(directory: Path, *, dir_fd: int | None = None) -> None:
    """fsyncs a directory (the one dir_fd holds, when given), making renames in it durable.

    A rename is atomic but lives in the directory's own data: until that is
    flushed, a power loss can undo it (the file then is lost, never torn).
    Never raises: the rename is done and visible either way, and some file
    systems refuse to sync a directory.
    """
    with contextlib.suppress(OSError):
        if dir_fd is not None:
            os.fsync(dir_fd)
            return
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def temp_name(name: str) -> str:
    """The name of a temporary file for `name`: TEMP_PREFIX, name, pid and random digits."""
    # os.urandom, not secrets: every process that loads an entry imports this
    # module, and secrets brings random and base64 (a few ms) for one name.
    return f"{TEMP_PREFIX}{name}.{os.getpid()}.{os.urandom(4).hex()}"


def is_temp_name(name: str, target: Callable[[str], bool]) -> bool:
    """Whether name is one temp_name made for a file whose name passes target."""
    if not name.startswith(TEMP_PREFIX):
        return False
    stem, _, token = name[len(TEMP_PREFIX) :].rpartition(".")
    stem, _, pid = stem.rpartition(".")
    return (
        len(token) == 8
        and all(c in "0123456789abcdef" for c in token)
        and pid.isdigit()
        and target(stem)
    )


def write_atomically(
    path: Path, data: bytes, mode: int = 0o600, *, dir_fd: int | None = None
) -> None:
    """Writes data to path so that readers see the old file or the whole new one."""
    PendingFile(path, mode=mode, dir_fd=dir_fd).commit(data)
