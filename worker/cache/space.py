"""Keeping a cache directory under its size bound.

Every byte in ``entries/`` (entries, and temporary files being written) is
accounted in a ledger, ``usage.json``, which only the holder of
``locks/space.lock`` reads or changes:

- A writer reserves its entry's size under that lock before writing: it
  creates the temporary file at full size there and adds the size to the
  ledger, then releases the lock and writes. So the lock is held for
  microseconds, not for a write and an fsync. It takes the lock again for
  the rename that puts the written file in place: names in entries/ appear
  and change only under the lock (removals aside), so a scan, which counts
  the directory by its names, never misses a file renamed under it.
- If the reservation would pass the bound, or the ledger is missing or older
  than RESCAN_INTERVAL, the writer first scans the directory: it removes
  temporary files older than TEMP_GRACE (their writers died), evicts
  least-recently-used entries down to LOW_WATER of the bound, and sets the
  ledger to what it counted. Most writes therefore scan nothing.

The ledger never counts less than the directory holds (removals and
replacements do not subtract, a reservation adds before the file grows), so
the directory stays within its bound at every instant, whatever the number of
writers. Files copied in by hand are the exception until the next scan.
An entry larger than the bound is not stored. The bound covers entries/; lock
files (empty), plugin records and the ledger (a few hundred bytes each) are
outside it.

Only names that pjrt-pool writes count: ``<key>.pjx`` for a key of 64 hex
digits, and the temporary files of those. Eviction and clearing remove
regular files with those names only, through the directory's descriptor
(folders.py): never a directory, a symlink or what a symlink points to.
"""

from __future__ import annotations

import errno
import math
import os
import stat as stat_module
import time
from pathlib import Path
from typing import NamedTuple

from worker.cache.atomic import is_temp_name
from worker.cache.entry import ENTRY_SUFFIX
from worker.cache.folders import Folder
from worker.identity.keys import check_key, is_key
from worker.log import get_logger
from worker.untrusted import parse_json, read_file
from worker.wire.fds import close_quietly

logger = get_logger("pjrt_pool.cache")

LOW_WATER = 0.75
"""A scan forced by a full cache evicts down to this fraction of the bound, so that
the next few writes find room without scanning."""
RESCAN_INTERVAL = 600.0
"""Seconds after which a writer rescans anyway, correcting the ledger and removing debris."""
TEMP_GRACE = 3600.0
"""A temporary file older than this (seconds) belongs to a dead writer and is removed."""


def entry_name(key: str) -> str:
    """The file name of a key's entry; raises InvalidKeyError for anything but a key."""
    return check_key(key) + ENTRY_SUFFIX


def key_of_name(name: str) -> str | None:
    """The key an entry file's name holds, or None when the name is not an entry's."""
    if name.endswith(ENTRY_SUFFIX) and is_key(name[: -len(ENTRY_SUFFIX)]):
        return name[: -len(ENTRY_SUFFIX)]
    return None


def _is_entry_name(name: str) -> bool:
    return key_of_name(name) is not None


class EntryFile(NamedTuple):
    """An entry file as the directory lists it (not yet verified)."""

    key: str
    path: Path
    """Where it was listed, for messages (files are opened by name, relative to entries/)."""
    size: int
    mtime: float
    """Last access (entries are touched on hits), which orders eviction."""
    regular: bool = True
    """False for something else named like an entry (a directory, a link): listed, so that
    verification reports it, but never evicted or cleared."""

    @property
    def name(self) -> str:
        """The file's name in entries/."""
        return self.key + ENTRY_SUFFIX


class Scan(NamedTuple):
    """What a scan of entries/ found."""

    entries: list[EntryFile]
    """Entry files, least recently used first."""
    temp_bytes: int
    """Bytes in temporary files (being written, or left by a writer that died)."""
    temp_files: int
    """Temporary files counted in temp_bytes."""
    temps_removed: int
    """Temporary files removed because they were older than the grace."""

    @property
    def total(self) -> int:
        """Bytes the directory holds: entries and temporary files."""
        return sum(e.size for e in self.entries) + self.temp_bytes


class TrimResult(NamedTuple):
    """What a trim found and did (DiskCache.trim)."""

    ran: bool
    """False when another process held the space lock for longer than the wait."""
    total_before: int
    """Bytes in entries/ before the trim."""
    total_after: int
    """Bytes in entries/ after the trim."""
    evicted: int
    """Entries removed."""
    temp_removed: int
    """Temporary files of dead writers removed."""


class Cleared(NamedTuple):
    """What clearing a cache did (DiskCache.clear_entries)."""

    removed: int
    """Entries removed."""
    left: list[Path]
    """Things named like entries that are not regular files (a directory, a link): never
    removed."""
    failed: list[tuple[Path, OSError]]
    """Entries that could not be removed, and why."""


def scan(entries: Folder | None, temp_grace: float | None = None) -> Scan:
    """Lists entries/ and, with temp_grace, removes older temporary files.

    Names that are not an entry's or one of their temporary files' are left
    out, and so are files that vanish during the scan (other processes evict
    and heal too). Temporary files are removed only if they are regular files.
    """
    found: list[EntryFile] = []
    temp_bytes = temp_files = removed = 0
    now = time.time()
    if entries is None:
        return Scan([], 0, 0, 0)
    try:
        with entries.listing() as items:
            for item in items:
                try:
                    stat = item.stat(follow_symlinks=False)
                except OSError:
                    continue
                regular = stat_module.S_ISREG(stat.st_mode)
                key = key_of_name(item.name)
                if key is not None:
                    size = stat.st_size if regular else 0
                    path = entries.file(item.name)
                    found.append(EntryFile(key, path, size, stat.st_mtime, regular))
                elif regular and is_temp_name(item.name, _is_entry_name):
                    if temp_grace is not None and now - stat.st_mtime > temp_grace:
                        try:
                            os.unlink(item.name, dir_fd=entries.fd)
                            removed += 1
                            logger.debug("removed stale temporary file %s", item.name)
                            continue
                        except OSError:
                            pass
                    temp_bytes += stat.st_size
                    temp_files += 1
    except OSError:
        return Scan([], 0, 0, 0)
    found.sort(key=lambda e: e.mtime)
    return Scan(found, temp_bytes, temp_files, removed)


def remove_entry(entries: Folder, name: str, found: os.stat_result | None = None) -> None:
    """Removes what lies at an entry's name in entries/, never following a symlink.

    name must be an entry's (checked). A directory named like an entry
    (which no writer makes, but which would block its key forever) is removed
    with its contents, through descriptors (shutil.rmtree with dir_fd, which
    removes symlinks inside rather than following them). Raises OSError
    (FileNotFoundError when it is gone already).
    """
    if not _is_entry_name(name):
        raise ValueError(f"{name!r} is not the name of a cache entry")
    if found is None:
        found = os.stat(name, dir_fd=entries.fd, follow_symlinks=False)
    if stat_module.S_ISDIR(found.st_mode):
        # Imported here: shutil brings zlib, bz2 and lzma (a few ms) into every
        # process that reads the cache, for a directory no writer ever makes.
        import shutil

        shutil.rmtree(name, dir_fd=entries.fd)
    else:
        os.unlink(name, dir_fd=entries.fd)


def remove_entry_file(entries: Folder, item: EntryFile) -> bool:
    """Removes a listed entry if it is still a regular file; returns whether it did.

    For eviction and clearing: something else named like an entry is left
    alone (False). Raises OSError (FileNotFoundError when it is gone already).
    """
    if not item.regular:
        return False
    current = os.stat(item.name, dir_fd=entries.fd, follow_symlinks=False)
    if not stat_module.S_ISREG(current.st_mode):
        return False  # replaced by something else since the listing
    os.unlink(item.name, dir_fd=entries.fd)
    return True


def clear_entries(entries: Folder | None) -> Cleared:
    """Removes every regular file named like an entry (DiskCache.clear_entries); says what it
    left (not a regular file) and what it could not remove."""
    cleared = Cleared(0, [], [])
    if entries is None:
        return cleared
    for item in scan(entries).entries:
        try:
            if remove_entry_file(entries, item):
                cleared = cleared._replace(removed=cleared.removed + 1)
            else:
                cleared.left.append(item.path)
        except FileNotFoundError:
            pass
        except OSError as error:
            cleared.failed.append((item.path, error))
    return cleared


def evict(
    entries: Folder, listed: list[EntryFile], total: int, target: float
) -> tuple[int, list[EntryFile]]:
    """Removes entries, least recently used first, until total <= target.

    Returns the new total and the entries removed. An entry already gone
    (another process evicted it) is no longer counted either way; one that is
    not a regular file is skipped.
    """
    removed = []
    for item in listed:
        if total <= target:
            break
        try:
            if not remove_entry_file(entries, item):
                continue
            removed.append(item)
            logger.debug("evicted %s (%d bytes)", item.key, item.size)
        except FileNotFoundError:
            pass
        except OSError as error:
            logger.warning("could not evict cache entry %s: %s", item.path, error)
            continue
        total -= item.size
    return total, removed


class Usage(NamedTuple):
    """The ledger: bytes accounted in entries/, and when a scan last counted them."""

    bytes: int
    scanned: float


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
LEDGER_NAME = "usage.json"
_LEDGER_LIMIT = 4096
"""The ledger is a few dozen bytes; anything larger is not one."""
_MAX_BYTES = 1 << 62


class Ledger:
    """The usage file. Read and written only under the space lock, never through a symlink.

    It lies in the cache directory, opened relative to that directory's
    descriptor (folder None: a cache that cannot be used has no ledger).
    """

    def __init__(self, folder: Folder | None, mode: int = 0o600) -> None:
        self.folder = folder
        self.mode = mode

    @property
    def path(self) -> Path | None:
        """Where the ledger is, for messages and inspection."""
        return None if self.folder is None else self.folder.file(LEDGER_NAME)

    def read(self) -> Usage | None:
        """Returns the recorded usage, or None when the file is missing, unreadable or damaged.

        A damaged ledger (not JSON, a byte count that is not a non-negative
        integer, a time that is not finite) only forces a scan.
        """
        if self.folder is None:
            return None
        try:
            record = parse_json(
                read_file(LEDGER_NAME, _LEDGER_LIMIT, dir_fd=self.folder.fd, what="usage ledger")
            )
            count, scanned = record["bytes"], record["scanned"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= _MAX_BYTES:
            return None
        if isinstance(scanned, bool) or not isinstance(scanned, (int, float)):
            return None
        if not math.isfinite(scanned):
            return None
        return Usage(count, float(scanned))

    def write(self, usage: Usage) -> None:
        """Records usage in place (no rename or fsync: a lost update only forces a scan).

        Something other than a regular file of one link in its place (a
        symlink, which is never followed, a FIFO, a hard link to another file)
        is removed (the name, never what it links to) and the ledger written afresh.
        Raises OSError.
        """
        if self.folder is None:
            raise FileNotFoundError(errno.ENOENT, "the cache has no ledger", LEDGER_NAME)
        text = f'{{"bytes": {int(usage.bytes)}, "scanned": {float(usage.scanned)!r}}}'.encode()
        flags = (
            os.O_WRONLY
            | os.O_CREAT
            | _NOFOLLOW
            | getattr(os, "O_NONBLOCK", 0)
            | getattr(os, "O_CLOEXEC", 0)  # said, though os.open adds it anyway (PEP 446)
        )
        try:
            fd = os.open(LEDGER_NAME, flags, self.mode, dir_fd=self.folder.fd)
        except OSError as error:
            if error.errno not in (errno.ELOOP, errno.ENXIO):  # a symlink, a FIFO
                raise
            fd = self._replace_odd_file(flags)
        try:
            found = os.fstat(fd)
            # Not a regular file, or a hard link planted at its name (whose other name may be
            # anyone's file, which writing would overwrite): replaced, never written through.
            if not stat_module.S_ISREG(found.st_mode) or found.st_nlink != 1:
                os.close(fd)
                fd = self._replace_odd_file(flags)
                found = os.fstat(fd)
            if stat_module.S_IMODE(found.st_mode) != self.mode and found.st_uid == os.geteuid():
                os.fchmod(fd, self.mode)  # the umask may have taken a shared cache's group bits
            os.pwrite(fd, text, 0)
            os.ftruncate(fd, len(text))
        finally:
            close_quietly(fd)

    def _replace_odd_file(self, flags: int) -> int:
        assert self.folder is not None
        logger.warning("replacing %s, which is not a regular file of its own", self.path)
        found = os.stat(LEDGER_NAME, dir_fd=self.folder.fd, follow_symlinks=False)
        if stat_module.S_ISDIR(found.st_mode):
            raise IsADirectoryError(errno.EISDIR, "a directory in the ledger's place", LEDGER_NAME)
        # Removes the link or FIFO itself, never what it points to.
        os.unlink(LEDGER_NAME, dir_fd=self.folder.fd)
        return os.open(LEDGER_NAME, flags | os.O_EXCL, self.mode, dir_fd=self.folder.fd)
