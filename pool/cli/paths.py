"""The files a user names on the command line: regular files only, checked before use.

A FIFO given as a manifest, bundle or inputs file would block its reader
forever, and a device or directory is never what a command means; an output
path that exists must be a regular file, since writing renames over it (a
device node or FIFO there would be replaced). Each is refused with one line
(UsageError) before anything is read or written.
"""

from __future__ import annotations

import os
import stat

from pool.cli.main import UsageError

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def input_file(path: str | os.PathLike[str], what: str) -> None:
    """Raises UsageError if path exists and is not a regular file (a missing one passes:
    its reader says it does not exist)."""
    try:
        found = os.stat(path)  # stat never blocks, whatever lies there
    except OSError:
        return
    if not stat.S_ISREG(found.st_mode):
        raise UsageError(f"{what} {os.fspath(path)} is {_kind(found.st_mode)}, not a regular file")


def output_file(path: str | os.PathLike[str], what: str) -> None:
    """Raises UsageError if path exists and is not a regular file (a link included)."""
    try:
        found = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISREG(found.st_mode):
        raise UsageError(
            f"{what} {os.fspath(path)} is {_kind(found.st_mode)}: name a new file, or a "
            "regular file to replace"
        )
