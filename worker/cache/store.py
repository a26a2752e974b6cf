"""DiskCache: a directory of executables shared by every process on a machine.

Layout of a cache directory (created 0700)::

    entries/<key>.pjx        one verified, self-describing file per executable
    entries/.tmp.*           files being written (invisible to readers)
    locks/<key>.lock         per-key compile locks (never deleted)
    locks/trim.lock          held by whichever process is trimming
    plugins/<id>.json        memoized plugin-library digests

Reads take no lock: an entry is published by an atomic rename and verified
when read, so a reader sees a whole entry or none. Writers of one key
serialize on the key's lock so that one process compiles and the others load
(see worker.compiler); correctness never depends on that lock. Access times
are the files' mtimes, refreshed at most once per touch interval, and drive
least-recently-used eviction in trim().
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import filelock

from worker.cache import entry as entry_format
from worker.cache.atomic import TEMP_PREFIX, write_atomically
from worker.cache.location import resolve_cache_dir, resolve_max_size

logger = logging.getLogger("pjrt_pool.cache")

ENTRY_SUFFIX = ".pjx"
DEFAULT_LOCK_TIMEOUT = 600.0
"""Seconds a process waits for another's compile of the same key before compiling itself."""
TOUCH_INTERVAL = 60.0
"""An entry's access time is refreshed on a hit at most this often (seconds)."""
TEMP_GRACE = 3600.0
"""A temporary file older than this (seconds) belongs to a dead writer and is removed."""
LOW_WATER = 0.75
"""A trim brings the cache down to this fraction of its bound."""
TRIM_SHARE = 8
"""A process trims after writing 1/TRIM_SHARE of the headroom (bound minus low water)."""

_LOCK_OPTIONS: dict[str, Any] = {"mode": 0o600, "thread_local": False}
if "preserve_lock_file" in inspect.signature(filelock.FileLock.__init__).parameters:
    _LOCK_OPTIONS["preserve_lock_file"] = True  # lock files are never deleted


class CacheUnavailableWarning(UserWarning):
    """The cache directory cannot be used; compiling goes on without the cache."""


class CacheCounters(NamedTuple):
    """What a process's disk cache did: hits, misses and repairs."""

    hits: int = 0
    """Entries found and loaded."""
    misses: int = 0
    """Lookups that found no usable entry (including corrupt and rejected ones)."""
    corrupt: int = 0
    """Entries that failed verification or that the plugin rejected; removed and rebuilt."""
    evicted: int = 0
    """Entries removed by trims to keep the cache under its size bound."""
    lock_timeouts: int = 0
    """Waits for another process's compile that timed out (this process compiled anyway)."""
    write_errors: int = 0
    """Entries that could not be written (read-only or full disk)."""

    def add(self, other: CacheCounters) -> CacheCounters:
        """Returns the sum of two counters."""
        return CacheCounters(*(a + b for a, b in zip(self, other, strict=True)))


@dataclass(frozen=True)
class EntryFile:
    """An entry file as the directory lists it (not yet verified)."""

    key: str
    path: Path
    size: int
    mtime: float


@dataclass(frozen=True)
class TrimResult:
    """What a trim found and did."""

    ran: bool
    """False when another process was trimming already."""
    total_before: int
    total_after: int
    evicted: int
    temp_removed: int


class DiskCache:
    """A directory of compiled executables shared by processes, under file locks.

    directory defaults to PJRT_POOL_CACHE_DIR, else the user cache directory;
    max_size (bytes or "2G") to PJRT_POOL_CACHE_MAX_SIZE, else 4 GiB. A
    directory that cannot be created or written makes the cache degrade to
    "no cache" with one warning; compiling never fails because of the cache.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        max_size: int | str | None = None,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    ) -> None:
        self.directory = resolve_cache_dir(directory)
        self.max_size = resolve_max_size(max_size)
        self.lock_timeout = lock_timeout
        self.entries_dir = self.directory / "entries"
        self.locks_dir = self.directory / "locks"
        self.plugins_dir = self.directory / "plugins"
        self._counts = dict.fromkeys(CacheCounters._fields, 0)
        self._counts_lock = threading.Lock()
        self._written_since_trim = 0
        self._trimmed_once = False
        self._warned = False
        self.usable = self._prepare()
        self.writable = self.usable

    # -- set-up and degradation --------------------------------------------

    def _prepare(self) -> bool:
        try:
            for folder in (self.directory, self.entries_dir, self.locks_dir, self.plugins_dir):
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            return True
        except OSError as error:
            self._degrade(f"cannot create cache directory {self.directory}: {error}")
            return False

    def _degrade(self, reason: str) -> None:
        """Stops writing (and, if nothing is readable, using) the cache, warning once."""
        self.writable = False
        if not self._warned:
            self._warned = True
            message = f"pjrt-pool disk cache disabled for this process: {reason}"
            logger.warning(message)
            warnings.warn(message, CacheUnavailableWarning, stacklevel=3)

    # -- counters ---------------------------------------------------------

    def count(self, name: str, amount: int = 1) -> None:
        """Adds to one of the CacheCounters fields."""
        with self._counts_lock:
            self._counts[name] += amount

    @property
    def counters(self) -> CacheCounters:
        """What this process's use of the cache did so far."""
        with self._counts_lock:
            return CacheCounters(**self._counts)

    # -- entries ----------------------------------------------------------

    def path_of(self, key: str) -> Path:
        """Returns the file of a key's entry."""
        return self.entries_dir / f"{key}{ENTRY_SUFFIX}"

    def read(self, key: str) -> tuple[entry_format.Entry, os.stat_result] | None:
        """Returns a key's verified entry and its file's stat, or None when there is none.

        Takes no lock. Raises CorruptEntryError for a file that fails verification.
        """
        if not self.usable:
            return None
        path = self.path_of(key)
        try:
            with open(path, "rb") as file:
                stat = os.fstat(file.fileno())
                data = file.read()
        except FileNotFoundError:
            return None
        except OSError as error:
            raise entry_format.CorruptEntryError(f"unreadable: {error}") from None
        try:
            entry = entry_format.decode(data, expected_key=key)
        except entry_format.CorruptEntryError as error:
            error.stat = stat  # lets the caller remove exactly this file
            raise
        self._touch(path, stat)
        return entry, stat

    def _touch(self, path: Path, stat: os.stat_result) -> None:
        if self.writable and time.time() - stat.st_mtime > TOUCH_INTERVAL:
            with contextlib.suppress(OSError):
                os.utime(path)

    def publish(
        self, key: str, parts: dict[str, Any], metadata: dict[str, Any], payload: bytes
    ) -> bool:
        """Writes a key's entry atomically; returns False when the cache cannot take it."""
        if not self.writable:
            return False
        data = entry_format.encode(key, parts, metadata, payload)
        if len(data) > self.max_size:
            logger.debug("entry %s (%d bytes) exceeds the cache bound; not stored", key, len(data))
            return False
        try:
            write_atomically(self.path_of(key), data)
        except OSError as error:
            self.count("write_errors")
            if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
                self._degrade(f"cannot write {self.entries_dir}: {error}")
            else:
                logger.warning("could not write cache entry %s: %s", key, error)
            return False
        self._written_since_trim += len(data)
        headroom = self.max_size * (1 - LOW_WATER)
        if not self._trimmed_once or self._written_since_trim > headroom / TRIM_SHARE:
            self.trim()
        return True

    def remove_if_unchanged(self, key: str, stat: os.stat_result | None) -> bool:
        """Removes a key's entry if it is still the file that `stat` describes.

        Call with the key's lock held; a file republished in the meantime (by
        a process that gave up waiting for the lock) is left alone.
        """
        path = self.path_of(key)
        try:
            current = os.stat(path)
            # Identity by inode, not mtime: a hit's access-time touch changes mtime,
            # while a republished entry is always a new inode (atomic rename).
            if stat is not None and (current.st_dev, current.st_ino, current.st_size) != (
                stat.st_dev,
                stat.st_ino,
                stat.st_size,
            ):
                return False
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as error:
            logger.warning("could not remove bad cache entry %s: %s", path, error)
            return False

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[bool]:
        """Holds a key's compile lock; yields False if it could not be had in time.

        Whoever gets False goes on without the lock (it compiles anyway):
        a crashed or hung holder must never stall everyone else. A cache that
        cannot be written has nothing to lock, and yields False at once.
        """
        if not self.writable:
            yield False
            return
        lock = filelock.FileLock(
            self.locks_dir / f"{key}.lock",
            timeout=self.lock_timeout if timeout is None else timeout,
            **_LOCK_OPTIONS,
        )
        try:
            lock.acquire()
        except filelock.Timeout:
            self.count("lock_timeouts")
            logger.debug("timed out waiting for the compile lock of %s; compiling anyway", key)
            yield False
            return
        except OSError as error:
            self._degrade(f"cannot create lock files in {self.locks_dir}: {error}")
            yield False
            return
        try:
            yield True
        finally:
            lock.release()

    # -- listing and trimming ---------------------------------------------

    def list_entries(self) -> list[EntryFile]:
        """Returns every entry file, oldest access first, tolerating files that vanish."""
        found = []
        try:
            scan = os.scandir(self.entries_dir)
        except OSError:
            return []
        with scan:
            for item in scan:
                if not item.name.endswith(ENTRY_SUFFIX) or item.name.startswith(TEMP_PREFIX):
                    continue
                try:
                    stat = item.stat()
                except FileNotFoundError:
                    continue
                found.append(
                    EntryFile(
                        item.name[: -len(ENTRY_SUFFIX)],
                        Path(item.path),
                        stat.st_size,
                        stat.st_mtime,
                    )
                )
        found.sort(key=lambda e: e.mtime)
        return found

    def _remove_stale_temps(self) -> int:
        removed = 0
        now = time.time()
        with contextlib.suppress(OSError), os.scandir(self.entries_dir) as scan:
            for item in scan:
                if not item.name.startswith(TEMP_PREFIX):
                    continue
                try:
                    if now - item.stat().st_mtime > TEMP_GRACE:
                        os.unlink(item.path)
                        removed += 1
                except OSError:
                    continue
        return removed

    def trim(self, max_size: int | None = None) -> TrimResult:
        """Evicts least-recently-used entries until the cache fits its bound.

        Runs under a try-lock: if another process is trimming, returns at once
        with ran=False. Over the bound, it removes entries down to LOW_WATER of
        it, so that the next trim is some writes away. Also removes temporary
        files left by writers that died.
        """
        bound = self.max_size if max_size is None else max_size
        self._trimmed_once = True
        self._written_since_trim = 0
        if not self.writable:
            return TrimResult(False, 0, 0, 0, 0)
        lock = filelock.FileLock(self.locks_dir / "trim.lock", timeout=0, **_LOCK_OPTIONS)
        try:
            lock.acquire()
        except (filelock.Timeout, OSError):
            return TrimResult(False, 0, 0, 0, 0)
        try:
            temps = self._remove_stale_temps()
            entries = self.list_entries()
            total = before = sum(e.size for e in entries)
            evicted = 0
            if total > bound:
                target = bound * LOW_WATER if max_size is None else bound
                for item in entries:
                    if total <= target:
                        break
                    try:
                        os.unlink(item.path)
                    except FileNotFoundError:
                        pass  # another process removed it: it no longer counts either way
                    except OSError as error:
                        logger.warning("could not evict %s: %s", item.path, error)
                        continue
                    total -= item.size
                    evicted += 1
                    logger.debug("evicted %s (%d bytes)", item.key, item.size)
            self.count("evicted", evicted)
            return TrimResult(True, before, total, evicted, temps)
        finally:
            lock.release()

    def clear(self) -> int:
        """Removes every entry (lock files stay); returns how many were removed."""
        removed = 0
        for item in self.list_entries():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(item.path)
                removed += 1
        return removed


_caches: dict[tuple[Path, int | str | None], DiskCache] = {}
_caches_lock = threading.Lock()


def open_cache(
    directory: str | os.PathLike[str] | None = None, max_size: int | str | None = None
) -> DiskCache:
    """Returns this process's DiskCache for a directory (one instance, shared counters)."""
    resolved = resolve_cache_dir(directory).absolute()
    with _caches_lock:
        cache = _caches.get((resolved, max_size))
        if cache is None:
            cache = _caches[(resolved, max_size)] = DiskCache(resolved, max_size)
        return cache


def process_counters() -> CacheCounters:
    """Returns the counters of every cache this process opened, summed."""
    with _caches_lock:
        caches = list(_caches.values())
    total = CacheCounters()
    for cache in caches:
        total = total.add(cache.counters)
    return total
