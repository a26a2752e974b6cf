"""A file:// remote: create-only writes, and replace-if-unchanged under an flock.

FileBackend is the file:// kind of store behind ObjectClient. object_store's
local file system writes create-only (a hard link) but has no conditional
replace, which leases and record repairs need. Here every write to a file://
remote is made the same way, so that one version tag serves both: a file is
never changed in place (a new version is a new file, renamed over the old
one), and its tag is its inode, size and change times (etag_of), so that
each version has its own. Versioned reads and deletes are made here too (no
link followed); listings and ranged reads go through the store's local file
system (object_store.py), as for any store.

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

Links: whoever can write the remote's directory could put a symlink in
place of ``blobs/`` (or any folder below the root) and have every host
write, or gc delete, wherever it points. So each operation opens the
folders below the root one at a time, without following a link, and works
relative to the last one's descriptor (as the local cache's folders.py
does); a link or a file where a folder belongs is refused as the local
cache refuses one (trust.not_a_directory), and so is a link in place of an
object. The root itself is the
path the user named, and may be a link.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from worker.cache.folders import open_directory
from worker.cache.remote.location import Limits, RemoteLocation
from worker.cache.remote.object_store import ObstoreBackend
from worker.cache.remote.objects import Versioned, Written

LOCK_NAME = ".cas.lock"
"""The remote's lock file, at its root (outside every folder the tier lists)."""


def etag_of(found: os.stat_result) -> str:
    """A version tag of a file: files are never rewritten in place, so each version has its
    own inode and change time."""
    return f'"{found.st_ino:x}-{found.st_size:x}-{found.st_mtime_ns:x}-{found.st_ctime_ns:x}"'


@contextlib.contextmanager
def _folder(root: Path, path: Path, mkdir: bool) -> Iterator[int]:
    """A descriptor of the folder holding path (below root), opened from the root one folder
    at a time without following a link (made where missing, with mkdir).

    Raises FileNotFoundError for a missing folder, NotADirectoryError naming
    a link or a file where a folder belongs.
    """
    if mkdir:
        root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root may be a link
    try:
        where = root
        for name in path.parent.relative_to(root).parts:
            where = where / name
            if mkdir:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, dir_fd=fd)
            inner = open_directory(name, fd, where)
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def read_versioned(root: Path, path: Path, max_size: int) -> tuple[bytes | None, str] | None:
    """A file's bytes (None when over max_size: not read) and its tag; None if there is none."""
    try:
        with _folder(root, path, mkdir=False) as folder:
            fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as file:
        found = os.fstat(fd)  # of the version opened: a replacement is another inode
        if found.st_size > max_size:
            return None, etag_of(found)
        return file.read(max_size + 1), etag_of(found)


def _staged(folder: int, path: Path, data: bytes) -> str:
    """data in a new file beside path (in folder), under a name no listing takes for an object."""
    staged = f".{path.name}.{os.urandom(6).hex()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(staged, flags, 0o644, dir_fd=folder)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    return staged


def create(root: Path, path: Path, data: bytes, mkdir: bool) -> str | None:
    """Writes a file only if none is there; returns its tag, None if one was there."""
    with _folder(root, path, mkdir) as folder:
        staged = _staged(folder, path, data)
        try:
            os.link(staged, path.name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
        except FileExistsError:
            return None
        finally:
            os.unlink(staged, dir_fd=folder)
        return etag_of(os.stat(path.name, dir_fd=folder, follow_symlinks=False))


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root / LOCK_NAME, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def replace_if(root: Path, path: Path, data: bytes, etag: str) -> str | None:
    """Replaces a file with data if its version is still etag; returns the new version's tag,
    None if the file is gone or another version by now (see the module docstring)."""
    try:
        with _folder(root, path, mkdir=False) as folder:
            staged = _staged(folder, path, data)
            try:
                with _locked(root):
                    current = os.stat(path.name, dir_fd=folder, follow_symlinks=False)
                    if etag_of(current) != etag:
                        return None
                    os.rename(staged, path.name, src_dir_fd=folder, dst_dir_fd=folder)
                    # Under the lock: no other replace ran, and a create cannot take an
                    # existing name.
                    return etag_of(os.stat(path.name, dir_fd=folder, follow_symlinks=False))
            finally:
                with contextlib.suppress(FileNotFoundError):  # renamed: it is the file now
                    os.unlink(staged, dir_fd=folder)
    except FileNotFoundError:  # the file, or its folder, is gone
        return None


def delete(root: Path, path: Path) -> None:
    """Removes a file (none there is no error); a link in its place is removed, not followed."""
    try:
        with _folder(root, path, mkdir=False) as folder:
            os.unlink(path.name, dir_fd=folder)
    except FileNotFoundError:
        pass


class FileBackend(ObstoreBackend):
    """A file:// remote: its writes, versioned reads and deletes made here (see the module
    docstring); listings and ranged reads through obstore's local file system."""

    def __init__(self, location: RemoteLocation, limits: Limits) -> None:
        super().__init__(location, limits)
        self.root = Path(unquote(urlsplit(location.url).path))

    def _store_options(self, writing: bool) -> dict[str, Any]:
        return {"mkdir": not self.location.read_only}

    def _file(self, path: str) -> Path:
        """Where the remote keeps an object."""
        return self.root / path

    def get_versioned(self, path: str, max_size: int, deadline: float) -> Versioned | None:
        """See Backend.get_versioned."""
        found = read_versioned(self.root, self._file(path), max_size)
        return None if found is None else Versioned(*found)

    def put_new(self, path: str, data: bytes) -> Written:
        """See Backend.put_new."""
        etag = create(self.root, self._file(path), data, mkdir=not self.location.read_only)
        return Written(etag is not None, etag)

    def put_if_match(self, path: str, data: bytes, etag: str) -> Written:
        """See Backend.put_if_match."""
        new = replace_if(self.root, self._file(path), data, etag)
        return Written(new is not None, new)

    def delete(self, path: str) -> None:
        """See Backend.delete: the store's own would follow a link."""
        delete(self.root, self._file(path))
