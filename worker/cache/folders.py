"""The directories of a cache, opened once and used through their descriptors.

Checking a directory and then going on by its path leaves a gap: whoever can
write the cache directory can rename ``entries/`` away and put a symlink to
another directory in its place, and a process that goes on by path then
publishes, evicts and clears there. So a DiskCache opens each of its
directories once, without following a symlink, checks the descriptor it got
(trust.py), and from then on names every file relative to that descriptor
(``dir_fd``): a directory swapped afterwards is never used. The names
themselves are checked before they are used (cache keys by
worker.identity.keys.check_key, the rest are fixed by the code), so no path
under the cache is built from anything a file or a caller supplied.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from worker.cache import trust
from worker.wire.fds import close_quietly

_DIRECTORY_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_DIRECTORY", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


def open_directory(name: str | Path, dir_fd: int | None, path: Path) -> int:
    """A descriptor of directory `name` (relative to dir_fd, if given), opened without
    following a link; NotADirectoryError naming path (trust.not_a_directory) for a link or a
    file in its place."""
    try:
        return os.open(name, _DIRECTORY_FLAGS, dir_fd=dir_fd)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise trust.not_a_directory(path) from None
        raise


class Folder:
    """One checked directory of a cache, held open: files in it are named relative to fd.

    path is where the directory was when it was opened, for messages only.
    The descriptor is closed with the object (or by close()).
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def open(
        cls, path: Path, shared: bool, *, parent: Folder | None = None, create: bool = False
    ) -> Folder:
        """Opens (with create, first makes) a directory and checks who may write it.

        With parent, path's last component is opened relative to the parent's
        descriptor. Raises FileNotFoundError when it does not exist,
        NotADirectoryError for a symlink or a file in its place, and
        UntrustedCacheError when others could write it. A directory made here
        gets the sharing mode's permissions exactly, whatever the umask.
        """
        name: str | Path = path.name if parent is not None else path
        dir_fd = parent.fd if parent is not None else None
        mode = trust.SHARED_DIR_MODE if shared else trust.PRIVATE_DIR_MODE
        made = False
        if create:
            try:
                os.mkdir(name, mode & 0o777, dir_fd=dir_fd)
                made = True
            except FileExistsError:
                pass
        fd = open_directory(name, dir_fd, path)
        try:
            if made:
                os.fchmod(fd, mode)  # exactly: the umask may have taken bits a shared cache needs
            trust.check_directory(path, os.fstat(fd), shared, fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def file(self, name: str) -> Path:
        """The path of a file in the directory, for messages (never opened by it)."""
        return self.path / name

    @contextlib.contextmanager
    def listing(self) -> Iterator[Iterator[os.DirEntry[str]]]:
        """Lists the directory (entries' paths are bare names: use them with fd).

        Through a descriptor of its own, since a directory descriptor's
        position is shared by every listing made from it, and threads may list
        at the same time.
        """
        fd = os.open(".", _DIRECTORY_FLAGS, dir_fd=self.fd)
        try:
            with os.scandir(fd) as entries:
                yield entries
        finally:
            os.close(fd)

    def close(self) -> None:
        """Closes the descriptor (the object is unusable afterwards)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            close_quietly(fd)

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Folder {self.path} fd={self.fd}>"
