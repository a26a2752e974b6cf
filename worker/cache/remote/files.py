"""A file:// remote's writes: create-only, and replace-if-unchanged under an flock.

object_store's local file system writes create-only (a hard link) but has
no conditional replace, which leases and record repairs need. Here every
write to a file:// remote is made the same way, so that one version tag
serves both: a file is never changed in place (a new version is a new file,
renamed over the old one), and its tag is its inode, size and change times
(etag_of), so that each version has its own.

Guarantees: on one host, create is atomic (link(2) fails if the name
exists) and replace is a compare-and-swap (the check and the rename are made
under an exclusive flock of the remote's ``.cas.lock``, which every writer
takes). On NFS, link is atomic on the server (a retransmitted link may
report "exists" for a file it made: a lost race, costing a compile), and
Linux maps flock to the protocol's byte-range locks, so replace is a
compare-and-swap across hosts as far as the mount's locking goes (NFSv4,
or v3 with lockd); on a mount with ``nolock`` it is one only among the
processes of one host. Correctness never depends on either: a lost race
costs a second compile, never a wrong entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".cas.lock"
"""The remote's lock file, at its root (outside every folder the tier lists)."""


def etag_of(found: os.stat_result) -> str:
    """A version tag of a file: files are never rewritten in place, so each version has its
    own inode and change time."""
    return f'"{found.st_ino:x}-{found.st_size:x}-{found.st_mtime_ns:x}-{found.st_ctime_ns:x}"'


def read_versioned(path: Path, max_size: int) -> tuple[bytes | None, str] | None:
    """A file's bytes (None when over max_size: not read) and its tag; None if there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as file:
        found = os.fstat(fd)  # of the version opened: a replacement is another inode
        if found.st_size > max_size:
            return None, etag_of(found)
        return file.read(max_size + 1), etag_of(found)


def _staged(path: Path, data: bytes, mkdir: bool) -> Path:
    """data in a new file beside path, under a name no listing takes for an object."""
    if mkdir:
        path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    return staged


def create(path: Path, data: bytes, mkdir: bool) -> str | None:
    """Writes a file only if none is there; returns its tag, None if one was there."""
    staged = _staged(path, data, mkdir)
    try:
        os.link(staged, path)
    except FileExistsError:
        return None
    finally:
        os.unlink(staged)
    return etag_of(os.stat(path, follow_symlinks=False))


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def replace_if(root: Path, path: Path, data: bytes, etag: str) -> str | None:
    """Replaces a file with data if its version is still etag; returns the new version's tag,
    None if the file is gone or another version by now (see the module docstring)."""
    staged = _staged(path, data, mkdir=False)
    try:
        with _locked(root):
            try:
                current = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                return None
            if etag_of(current) != etag:
                return None
            os.rename(staged, path)
            # Under the lock: no other replace ran, and a create cannot take an existing name.
            return etag_of(os.stat(path, follow_symlinks=False))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)
