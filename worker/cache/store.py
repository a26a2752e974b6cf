"""DiskCache: a directory of executables shared by every process on a machine.

Layout of a cache directory (created 0700, or 2770 when group-shared)::

    entries/<key>.pjx        one verified, self-describing file per executable
    entries/.tmp.*           files being written (invisible to readers)
    locks/<key>.lock         per-key compile locks (never deleted)
    locks/space.lock         held while reserving space or trimming (never deleted)
    loads/<key>.<pid>...     loads in progress (see loads.py)
    usage.json               bytes accounted in entries/ (see space.py)
    plugins/<kind>-<id>.json records about plugin builds: digests, probes (memos.py)

Nothing is read from a directory before trust.py has checked who can write
it, and no file in it is opened, written or removed through a symlink. The
directories are opened once and every file is named relative to their
descriptors (folders.py), by names the code checked (keys are 64 hex
digits: key.check_key), so a directory swapped for a symlink later is never
used. With a signing secret configured, entries and the records in
plugins/ are signed and checked (signing.py, memos.py).

Reads take no lock: an entry is published by an atomic rename and verified
when read, so a reader sees a whole entry or none. Writers of one key
serialize on the key's lock so that one process compiles and the others load
(see worker.compile.compiler); correctness never depends on that lock. Access times
are the files' mtimes, refreshed at most once per TOUCH_INTERVAL, and order
least-recently-used eviction (see space.py for the size bound).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from worker.cache import entry as entry_format
from worker.cache import space, trust
from worker.cache.atomic import PendingFile
from worker.cache.counters import CacheCounters, Tally
from worker.cache.folders import Folder
from worker.cache.loads import LoadMarkers
from worker.cache.location import (
    DEFAULT_MAX_SIZE,
    MAX_SIZE_ENV,
    SUBDIRECTORIES,
    parse_size,
    resolve_cache_dir,
    resolve_max_size,
)
from worker.cache.locking import HeldLock, try_acquire
from worker.cache.memos import MemoStore
from worker.cache.rejections import record_rejection, recorded_rejections
from worker.cache.signing import Signer, signer_from_environment
from worker.cache.space import (
    Cleared,
    EntryFile,
    Ledger,
    TrimResult,
    Usage,
    entry_name,
    remove_entry,
)
from worker.cache.warn_once import CacheUnavailableWarning, WarnOnce
from worker.identity.keys import check_key, key_of
from worker.log import get_logger

logger = get_logger("pjrt_pool.cache")

DEFAULT_LOCK_TIMEOUT = 600.0
"""Seconds a process waits for another's compile of the same key before compiling itself."""
SPACE_LOCK_TIMEOUT = 60.0
"""Seconds a writer waits for the space lock (held briefly, or for one scan) before
giving up on storing its entry."""
TOUCH_INTERVAL = 60.0
"""An entry's access time is refreshed on a hit at most this often (seconds)."""

# Errors that mean the directory cannot take writes at all (rather than one bad file).
_UNWRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT}

SPACE_LOCK = "space.lock"

_FROM_ENVIRONMENT: Any = object()


class DiskCache:
    """A directory of compiled executables shared by processes, under file locks.

    directory defaults to PJRT_POOL_CACHE_DIR, else the user cache directory;
    max_size (bytes or "2G") to PJRT_POOL_CACHE_MAX_SIZE, else 4 GiB, read
    when needed; lock_timeout is how long to wait for another process's
    compile of the same program. A directory that cannot be created or
    written makes the cache degrade to "no cache" with one warning. With
    create=False a missing directory is not created (the cache is then
    simply not usable).

    A directory that someone untrusted can write raises UntrustedCacheError
    (see trust.py; shared=True, or PJRT_POOL_CACHE_SHARED=1, trusts its
    group). signer signs and checks entries (default: the secret that
    PJRT_POOL_CACHE_SECRET or PJRT_POOL_CACHE_KEY_FILE configure, else none).

    compile_program uses one instance per directory (open_cache), whose
    counters therefore describe this process's compiles.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        max_size: int | str | None = None,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        *,
        create: bool = True,
        shared: bool | None = None,
        signer: Signer | None = _FROM_ENVIRONMENT,
    ) -> None:
        self._max_size = None if max_size is None else parse_size(max_size)
        self.lock_timeout = lock_timeout
        self.shared = trust.shared_mode(shared)
        """Whether the directory's group is trusted (a group-shared cache)."""
        if signer is _FROM_ENVIRONMENT:
            signer = signer_from_environment()
        self.signer: Signer | None = signer
        """Signs entries written and checks entries read; None when signing is off."""
        self.file_mode = trust.SHARED_FILE_MODE if self.shared else trust.PRIVATE_FILE_MODE
        self._tally = Tally()
        self._warnings = WarnOnce(CacheUnavailableWarning, stacklevel=4)
        self._locate(resolve_cache_dir(directory))
        self.usable = self._prepare(create)
        self.writable = self.usable

    # -- set-up and degradation --------------------------------------------

    def _locate(self, directory: Path) -> None:
        self.directory = directory
        self.entries_dir = directory / "entries"
        self.locks_dir = directory / "locks"
        self.plugins_dir = directory / "plugins"
        self._folders: dict[str, Folder] = {}
        self.problem: str | None = None
        """Why the cache cannot be used although it exists (a symlink or a file where a
        folder should be, a folder that cannot be opened); None otherwise."""
        self._connect()

    def _connect(self) -> None:
        """Points the ledger, load markers and records at the folders opened so far."""
        self.loads = LoadMarkers(self._folders.get("loads"), self.file_mode)
        self.ledger = Ledger(self._folders.get(""), self.file_mode)
        self.memos = MemoStore(self._folders.get("plugins"), self.signer, self.file_mode)
        """The records about plugin builds in plugins/ (see memos.py)."""

    def _prepare(self, create: bool) -> bool:
        """Creates (if asked), opens and checks the directories; False if the cache is unusable.

        Raises UntrustedCacheError for a directory others could write. The
        directory's real path replaces a symlink to it, nothing is made inside
        it before it has passed the check, and each directory is held open
        from then on (see folders.py).
        """
        if create:
            try:
                trust.make_parents(self.directory, self.shared)
                trust.make_directory(self.directory, self.shared)
            except OSError as error:  # a folder above it cannot be made (read-only, /proc)
                self._degrade(f"cannot create cache directory {self.directory}: {error.strerror}")
                self.problem = str(error)
                return False
        try:
            real = trust.check_cache_directory(self.directory, shared=self.shared)
            root = Folder.open(real, self.shared)
        except FileNotFoundError:
            if create:  # a dangling symlink, or removed meanwhile
                self._degrade(f"cannot use cache directory {self.directory}: it does not exist")
            return False
        except OSError as error:
            self._degrade(f"cannot create cache directory {self.directory}: {error}")
            self.problem = str(error)
            return False
        self._locate(real)
        self._folders[""] = root
        complete = True
        for name in SUBDIRECTORIES:
            try:
                self._folders[name] = Folder.open(
                    real / name, self.shared, parent=root, create=create
                )
            except FileNotFoundError:
                # create=False: without entries/ there is nothing to read; loads/ is
                # optional (a cache made by an older version has none).
                complete = complete and name == "loads"
            except OSError as error:
                doing = "create" if create else "use"
                self._degrade(f"cannot {doing} cache directory {real / name}: {error}")
                self.problem = f"{real / name}: {error}"
                self._connect()
                return False
        self._connect()
        return complete

    def records_made_if_missing(self) -> MemoStore | None:
        """The records about plugin builds, making plugins/ (and nothing else) if it is missing.

        For a process that only loads: it may memoize what it learned about
        its plugin in a cache that exists, and makes no other folder there.
        None when the cache directory is not open or plugins/ cannot be made.
        """
        root = self._folders.get("")
        if self.memos.folder is None and root is not None:
            try:
                self._folders["plugins"] = Folder.open(
                    self.plugins_dir, self.shared, parent=root, create=True
                )
            except (OSError, trust.UntrustedCacheError):
                return None
            self._connect()
        return self.memos if self.memos.folder is not None else None

    def close(self) -> None:
        """Closes the directories' descriptors: the cache is unusable afterwards.

        For an instance made for one job (a pool's check of its directory, an
        import, a listing): open_cache's instances stay open for the process,
        and one that is garbage closes its descriptors with it.
        """
        folders, self._folders = self._folders, {}
        for folder in folders.values():
            folder.close()
        self.usable = self.writable = False
        self._connect()

    def __enter__(self) -> DiskCache:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def folder(self, name: str) -> Folder | None:
        """The opened directory "entries", "locks", "plugins", "loads" ("": the cache itself)."""
        return self._folders.get(name)

    def _degrade(self, reason: str) -> None:
        """Stops writing the cache (entries already there are still read), warning once."""
        self.writable = False
        self._warnings.warn("degraded", f"pjrt-pool disk cache disabled for this process: {reason}")

    def _write_failed(self, what: str, error: OSError) -> None:
        self.count("write_errors")
        if error.errno in _UNWRITABLE:
            self._degrade(f"cannot write {what}: {error}")
        else:
            logger.warning("could not write %s: %s", what, error)

    @property
    def max_size(self) -> int:
        """The size bound in bytes: the argument, else PJRT_POOL_CACHE_MAX_SIZE, else 4 GiB."""
        if self._max_size is not None:
            return self._max_size
        try:
            return resolve_max_size(None)
        except ValueError as error:
            # A typo in the environment must not fail compiles; say so once.
            self._warnings.warn("max_size", f"{error}; using the default cache bound")
            return DEFAULT_MAX_SIZE

    @property
    def max_size_source(self) -> str:
        """Where max_size comes from: "argument", the environment variable, or "default"."""
        if self._max_size is not None:
            return "argument"
        return MAX_SIZE_ENV if os.environ.get(MAX_SIZE_ENV) else "default"

    def note_rejection(self, cause: str, plugin: str | None = None) -> None:
        """Records that a plugin refused to load an entry (worker.cache.rejections)."""
        record_rejection(self.memos, cause, plugin)

    def rejections(self) -> list[dict[str, Any]]:
        """The refusals note_rejection recorded, most recent first."""
        return recorded_rejections(self.memos)

    # -- counters ---------------------------------------------------------

    def count(self, name: str, amount: int = 1) -> None:
        """Adds to one of the CacheCounters fields."""
        self._tally.count(name, amount)

    @property
    def counters(self) -> CacheCounters:
        """What this instance did so far (open_cache's: this process's compiles)."""
        return self._tally.snapshot()

    # -- entries ----------------------------------------------------------

    def path_of(self, key: str) -> Path:
        """Returns the file of a key's entry (for messages: files are opened by name).

        Raises InvalidKeyError (a ValueError) for anything but a key.
        """
        return self.entries_dir / entry_name(key)

    def read(
        self, key: str, touch: bool = True
    ) -> tuple[entry_format.Entry, os.stat_result] | None:
        """Returns a key's verified entry and its file's stat, or None when there is none.

        Takes no lock. Raises CorruptEntryError (with .stat set when a file
        was read) for a file that fails verification or belongs to another
        key. touch=False leaves the access time alone (for inspection).
        """
        name = entry_name(key)
        entries = self._folders.get("entries")
        if not self.usable or entries is None:
            return None
        try:
            with entry_format.open_entry(name, dir_fd=entries.fd) as file:
                stat = os.fstat(file.fileno())
                try:
                    entry = entry_format.read_entry(
                        file, stat.st_size, key, self.signer, self.max_size
                    )
                except entry_format.CorruptEntryError as error:
                    error.stat = stat  # lets the caller remove exactly this file
                    raise
                if touch:
                    self._touch(file.fileno(), stat)
        except FileNotFoundError:
            return None
        except entry_format.CorruptEntryError:
            raise
        except (OSError, MemoryError) as error:
            # Says nothing about the entry (too many open files, a flaky disk...).
            cause = error if isinstance(error, OSError) else None
            message = f"cannot read {entries.file(name)}: {error}"
            raise entry_format.UnreadableEntryError(message, cause) from None
        if key_of(entry.parts) != key:
            error = entry_format.CorruptEntryError("the key parts do not hash to the key")
            error.stat = stat
            raise error
        return entry, stat

    def read_header(self, key: str) -> entry_format.Header:
        """Reads and verifies only the header of a key's entry (for listings).

        Raises CorruptEntryError, and OSError when the file cannot be read
        (FileNotFoundError when there is none).
        """
        name = entry_name(key)
        entries = self._folders.get("entries")
        if entries is None:
            raise FileNotFoundError(f"{self.directory} has no entries folder")
        return entry_format.read_header(name, dir_fd=entries.fd)

    def _touch(self, fd: int, stat: os.stat_result) -> None:
        # Refreshing mtime on every hit would turn every read into a metadata write.
        # Through the open file: never through a symlink put in its place meanwhile.
        if self.writable and time.time() - stat.st_mtime > TOUCH_INTERVAL:
            with contextlib.suppress(OSError):
                os.utime(fd)

    def publish(
        self,
        key: str,
        parts: dict[str, Any],
        metadata: dict[str, Any],
        payload: bytes,
        max_size: int | None = None,
    ) -> bool:
        """Writes a key's entry atomically; returns False when the cache cannot take it.

        max_size overrides the cache's bound for this write. Space is reserved
        first (see space.py), so the directory never grows past the bound.
        """
        entry_name(key)  # refuses anything but a key before any work
        if not self.writable:
            return False
        return self.publish_file(
            key, entry_format.encode(key, parts, metadata, payload, self.signer), max_size
        )

    def publish_file(self, key: str, data: bytes, max_size: int | None = None) -> bool:
        """Writes a key's entry file as given (verified by the caller); False if not stored.

        For entries that arrive whole, such as a bundle's: their bytes, and so
        their digests and signatures, stay as they were made.
        """
        entry_name(key)  # refuses anything but a key before any work
        if not self.writable:
            return False
        bound = self.max_size if max_size is None else max_size
        if len(data) > bound:
            logger.debug("entry %s (%d bytes) exceeds the cache bound; not stored", key, len(data))
            return False
        try:
            pending = self._reserve(key, len(data), bound)
        except OSError as error:
            self._write_failed(str(self.entries_dir), error)
            return False
        if pending is None:
            return False
        try:
            pending.write(data)
        except OSError as error:
            self._write_failed(f"cache entry {key}", error)
            return False
        return self._place(key, pending)

    def _place(self, key: str, pending: PendingFile) -> bool:
        """Renames a written entry into place under the space lock; False if not stored.

        Under the lock because a scan counts the directory by its names: a
        rename during a scan can move a file from a name the listing has not
        reached to one it has passed, the scan misses its bytes, and writers
        that trust that scan then overfill the directory.
        """
        try:
            lock = self._space_lock(key)
            if lock is None:
                pending.discard()
                return False
            try:
                pending.place(sync=False)
            finally:
                lock.release()
        except OSError as error:
            pending.discard()
            self._write_failed(f"cache entry {key}", error)
            return False
        pending.sync()  # after the lock: other writers need not wait for the disk
        return True

    def _space_lock(self, key: str) -> HeldLock | None:
        """The space lock for a write of key's entry; None (counted) if it stayed busy."""
        lock = self._try_lock(SPACE_LOCK, SPACE_LOCK_TIMEOUT)
        if lock is None:
            self.count("lock_timeouts")
            logger.debug("space lock busy for %.0f s; entry %s not stored", SPACE_LOCK_TIMEOUT, key)
        return lock

    def _reserve(self, key: str, size: int, bound: int) -> PendingFile | None:
        """Creates the entry's temporary file at full size if it fits; None if not."""
        lock = self._space_lock(key)
        if lock is None:
            return None
        try:
            usage = self.ledger.read()
            now = time.time()
            if (
                usage is None
                or now - usage.scanned > space.RESCAN_INTERVAL
                or (usage.bytes + size > bound)
            ):
                # Evict to the low-water mark minus this entry, so that the next
                # writes fit without scanning; or just enough, for an entry that
                # is most of the bound.
                target = bound * space.LOW_WATER - size
                if target < 0:
                    target = bound - size
                usage = Usage(self._scan_and_evict(bound - size, target).total_after, now)
            if usage.bytes + size > bound:
                logger.debug("no room for entry %s (%d bytes) within the bound", key, size)
                self.ledger.write(usage)
                return None
            # The ledger first: a ledger that cannot be written leaves no file behind
            # it, and a file that cannot be created leaves the ledger counting more
            # than the directory holds, which only brings the next scan forward.
            self.ledger.write(Usage(usage.bytes + size, usage.scanned))
            entries = self._folders["entries"]
            return PendingFile(Path(entry_name(key)), size, self.file_mode, dir_fd=entries.fd)
        finally:
            lock.release()

    def _scan_and_evict(self, limit: float, target: float) -> TrimResult:
        """With the space lock held: scans, and if over limit evicts down to target."""
        entries = self._folders.get("entries")
        found = space.scan(entries, space.TEMP_GRACE)
        self.loads.sweep({item.key for item in found.entries})
        total = found.total
        evicted: list[EntryFile] = []
        if total > limit and entries is not None:
            total, evicted = space.evict(entries, found.entries, total, target)
            self.count("evicted", len(evicted))
        return TrimResult(True, found.total, total, len(evicted), found.temps_removed)

    def remove_if_unchanged(self, key: str, stat: os.stat_result | None) -> bool:
        """Removes a key's entry if it is still the file that `stat` describes.

        Call with the key's lock held; a file republished in the meantime (by
        a process that gave up waiting for the lock) is left alone, and so is
        everything when stat is None (nothing says which file was judged).
        A directory in place of an entry is removed with what it holds.
        """
        name = entry_name(key)
        entries = self._folders.get("entries")
        if stat is None or entries is None:
            return False
        try:
            current = os.stat(name, dir_fd=entries.fd, follow_symlinks=False)
            # Identity by inode, not mtime: a hit's access-time touch changes mtime,
            # while a republished entry is always a new inode (atomic rename).
            if (current.st_dev, current.st_ino) != (stat.st_dev, stat.st_ino):
                return False
            remove_entry(entries, name, current)
            return True
        except FileNotFoundError:
            return False
        except OSError as error:
            logger.warning("could not remove bad cache entry %s: %s", entries.file(name), error)
            return False

    def _try_lock(self, name: str, timeout: float) -> HeldLock | None:
        """Takes a lock file in locks/ (through its descriptor); None if not had in time.

        Raises OSError when the lock file cannot be made or opened.
        """
        locks = self._folders.get("locks")
        if locks is None:
            raise FileNotFoundError(f"{self.locks_dir} is not open")
        return try_acquire(name, timeout, self.file_mode, dir_fd=locks.fd)

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[bool]:
        """Holds a key's compile lock; yields False if it could not be had in time.

        Whoever gets False goes on without the lock (it compiles anyway):
        a crashed or hung holder must never stall everyone else. A cache that
        cannot be written has nothing to lock, and yields False at once.
        """
        name = f"{check_key(key)}.lock"
        if not self.writable:
            yield False
            return
        wait = self.lock_timeout if timeout is None else timeout
        try:
            lock = self._try_lock(name, wait)
        except OSError as error:
            if error.errno in _UNWRITABLE:
                self._degrade(f"cannot create lock files in {self.locks_dir}: {error}")
            else:  # transient (too many open files...): this compile goes on unlocked
                logger.warning("could not take the compile lock of %s: %s", key, error)
            yield False
            return
        if lock is None:
            self.count("lock_timeouts")
            logger.debug("waited %.1f s for the compile lock of %s; compiling anyway", wait, key)
            yield False
            return
        try:
            yield True
        finally:
            lock.release()

    # -- listing and trimming ---------------------------------------------

    def list_entries(self) -> list[EntryFile]:
        """Returns every entry file, least recently used first (none are verified).

        Things named like entries that are not regular files are listed too
        (EntryFile.regular is False), so that verification reports them.
        """
        return space.scan(self._folders.get("entries")).entries

    def trim(self, max_size: int | str | None = None, wait: float = 0.0) -> TrimResult:
        """Evicts least-recently-used entries until the cache fits max_size (default: its bound).

        Waits up to `wait` seconds for the space lock (0: returns at once with
        ran=False if another process holds it). Also removes temporary files
        left by writers that died, and corrects the usage ledger. Only
        regular files named like entries and their temporary files are
        removed.
        """
        bound = self.max_size if max_size is None else parse_size(max_size)
        if not self.writable:
            return TrimResult(False, 0, 0, 0, 0)
        try:
            lock = self._try_lock(SPACE_LOCK, wait)
        except OSError as error:
            self._degrade(f"cannot create lock files in {self.locks_dir}: {error}")
            return TrimResult(False, 0, 0, 0, 0)
        if lock is None:
            return TrimResult(False, 0, 0, 0, 0)
        try:
            result = self._scan_and_evict(bound, bound)
            with contextlib.suppress(OSError):
                self.ledger.write(Usage(result.total_after, time.time()))
            return result
        finally:
            lock.release()

    def clear(self) -> int:
        """Removes every entry file, damaged ones too (lock files stay); returns how many.

        Only regular files named like entries are removed: anything else named
        like one (a directory, a symlink) is left, with a warning, as is an
        entry that cannot be removed (see clear_entries).
        """
        cleared = self.clear_entries()
        for path in cleared.left:
            logger.warning("left %s: not a regular file", path)
        for path, error in cleared.failed:
            logger.warning("could not remove cache entry %s: %s", path, error)
        return cleared.removed

    def clear_entries(self) -> Cleared:
        """clear(), saying what it could not remove instead of warning about it."""
        return space.clear_entries(self._folders.get("entries"))
