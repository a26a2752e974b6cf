"""Keeping a cache directory under its size bound.

Every byte in ``entries/`` (entries, and temporary files being written) is
accounted in a ledger, ``usage.json``, which only the holder of
``locks/space.lock`` reads or changes:

- A writer reserves its entry's size under that lock before writing: it
  creates the temporary file at full size there and adds the size to the
  ledger, then releases the lock and writes. So the lock is held for
  microseconds, not for a write and an fsync.
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
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat as stat_module
import time
from dataclasses import dataclass
from pathlib import Path

from worker.cache.atomic import TEMP_PREFIX

logger = logging.getLogger("pjrt_pool.cache")

ENTRY_SUFFIX = ".pjx"
LOW_WATER = 0.75
"""A scan forced by a full cache evicts down to this fraction of the bound, so that
the next few writes find room without scanning."""
RESCAN_INTERVAL = 600.0
"""Seconds after which a writer rescans anyway, correcting the ledger and removing debris."""
TEMP_GRACE = 3600.0
"""A temporary file older than this (seconds) belongs to a dead writer and is removed."""


@dataclass(frozen=True)
class EntryFile:
    """An entry file as the directory lists it (not yet verified)."""

    key: str
    path: Path
    size: int
    mtime: float
    """Last access (entries are touched on hits), which orders eviction."""


@dataclass(frozen=True)
class Scan:
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


def scan(entries_dir: Path, temp_grace: float | None = None) -> Scan:
    """Lists entries/ and, with temp_grace, removes older temporary files.

    Files that vanish during the scan (other processes evict and heal too)
    are left out.
    """
    entries: list[EntryFile] = []
    temp_bytes = temp_files = removed = 0
    now = time.time()
    try:
        listing = os.scandir(entries_dir)
    except OSError:
        return Scan([], 0, 0, 0)
    with listing:
        for item in listing:
            try:
                stat = item.stat(follow_symlinks=False)
            except OSError:
                continue
            if item.name.startswith(TEMP_PREFIX):
                if temp_grace is not None and now - stat.st_mtime > temp_grace:
                    try:
                        os.unlink(item.path)
                        removed += 1
                        logger.debug("removed stale temporary file %s", item.name)
                        continue
                    except OSError:
                        pass
                temp_bytes += stat.st_size
                temp_files += 1
            elif item.name.endswith(ENTRY_SUFFIX):
                key = item.name[: -len(ENTRY_SUFFIX)]
                entries.append(EntryFile(key, Path(item.path), stat.st_size, stat.st_mtime))
    entries.sort(key=lambda e: e.mtime)
    return Scan(entries, temp_bytes, temp_files, removed)


def remove_entry_file(path: Path, found: os.stat_result | None = None) -> None:
    """Removes what lies at an entry's path, never following a symlink.

    A directory named like an entry (which no writer makes, but which would
    block its key forever) is removed with its contents. Raises OSError
    (FileNotFoundError when it is gone already).
    """
    if found is None:
        found = os.lstat(path)
    if stat_module.S_ISDIR(found.st_mode):
        # Imported here: shutil brings zlib, bz2 and lzma (a few ms) into every
        # process that reads the cache, for a directory no writer ever makes.
        import shutil

        shutil.rmtree(path)  # fd-based on Linux: symlinks inside are removed, not followed
    else:
        os.unlink(path)


def evict(entries: list[EntryFile], total: int, target: float) -> tuple[int, list[EntryFile]]:
    """Removes entries, least recently used first, until total <= target.

    Returns the new total and the entries removed. An entry already gone
    (another process evicted it) is no longer counted either way.
    """
    removed = []
    for item in entries:
        if total <= target:
            break
        try:
            remove_entry_file(item.path)
            removed.append(item)
            logger.debug("evicted %s (%d bytes)", item.key, item.size)
        except FileNotFoundError:
            pass
        except OSError as error:
            logger.warning("could not evict cache entry %s: %s", item.path, error)
            continue
        total -= item.size
    return total, removed


@dataclass(frozen=True)
class Usage:
    """The ledger: bytes accounted in entries/, and when a scan last counted them."""

    bytes: int
    scanned: float


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def read_small_file(path: Path, limit: int = 1 << 20) -> bytes:
    """Reads a small regular file without following a symlink; raises OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat_module.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return os.read(fd, limit)
    finally:
        os.close(fd)


class Ledger:
    """The usage file. Read and written only under the space lock, never through a symlink."""

    def __init__(self, path: Path, mode: int = 0o600) -> None:
        self.path = path
        self.mode = mode

    def read(self) -> Usage | None:
        """Returns the recorded usage, or None when the file is missing or unreadable."""
        try:
            record = json.loads(read_small_file(self.path))
            usage = Usage(int(record["bytes"]), float(record["scanned"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return usage if usage.bytes >= 0 else None

    def write(self, usage: Usage) -> None:
        """Records usage in place (no rename or fsync: a lost update only forces a scan).

        Something other than a regular file in its place (a symlink, which is
        never followed, or a FIFO) is removed and the ledger written afresh.
        Raises OSError.
        """
        text = json.dumps({"bytes": usage.bytes, "scanned": usage.scanned}).encode()
        flags = os.O_WRONLY | os.O_CREAT | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(self.path, flags, self.mode)
        except OSError as error:
            if error.errno not in (errno.ELOOP, errno.ENXIO):  # a symlink, a FIFO
                raise
            fd = self._replace_odd_file(flags)
        try:
            found = os.fstat(fd)
            if not stat_module.S_ISREG(found.st_mode):
                os.close(fd)
                fd = self._replace_odd_file(flags)
                found = os.fstat(fd)
            if stat_module.S_IMODE(found.st_mode) != self.mode and found.st_uid == os.geteuid():
                os.fchmod(fd, self.mode)  # the umask may have taken a shared cache's group bits
            os.pwrite(fd, text, 0)
            os.ftruncate(fd, len(text))
        finally:
            os.close(fd)

    def _replace_odd_file(self, flags: int) -> int:
        logger.warning("replacing %s, which is not a regular file", self.path)
        os.unlink(self.path)  # removes the link or FIFO itself, never what it points to
        return os.open(self.path, flags | os.O_EXCL, self.mode)
