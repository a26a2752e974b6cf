"""Markers of loads in progress, so that an entry that kills its loaders kills only one.

A plugin can crash the process that deserializes an entry (an abort or a
SIGSEGV inside PJRT, which no Python code survives). Without a record,
every process that tries the entry would die the same way. So a process
creates ``loads/<key>.<host>.<pid>.<start>.<n>`` before it deserializes an
entry and removes it afterwards, whatever deserialize did. A marker whose
process no longer runs therefore names an entry whose load killed it; the
next process about to load that key finds the marker and quarantines the
entry instead (it is removed, counted in CacheCounters.crashed_loads, logged
with the dead process's pid, and the program compiled afresh).

Only markers from this host (host name, boot and PID namespace) are judged;
a process is identified by its pid and start time, so that a pid reused by
a newer process is not taken for the loader. Creating and removing a marker
costs two small file operations per load. A process killed for another
reason while it loads (a task timeout) also leaves a marker: its entry is
then compiled again, which costs time, never a wrong result. A cache that
cannot be written gets no markers.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
from collections.abc import Iterator

from worker.cache.folders import Folder
from worker.identity.keys import check_key, is_key
from worker.log import get_logger

logger = get_logger("pjrt_pool.cache")

_counter = itertools.count()
_host: str | None = None
_own_start: tuple[int, str | None] | None = None


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return ""


def host_id() -> str:
    """Names this host, boot and PID namespace: where a marker's pid means something."""
    global _host
    if _host is None:
        facts = "|".join(
            (
                os.uname().nodename,  # the host name, without importing socket
                _read("/proc/sys/kernel/random/boot_id"),
                _pid_namespace(),
            )
        )
        _host = hashlib.sha256(facts.encode()).hexdigest()[:12]
    return _host


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_start(pid: int) -> str | None:
    """Returns when a process started (clock ticks after boot), or None if it is not running.

    Where /proc does not exist, returns "" for a process that exists.
    """
    text = _read(f"/proc/{pid}/stat")
    if text:
        # The command name (field 2) may hold spaces and parentheses: split after it.
        fields = text[text.rfind(")") + 2 :].split()
        return fields[19] if len(fields) > 19 else ""
    if os.path.isdir("/proc/self"):
        return None  # /proc works, and has no such process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's process: it exists
    return ""


def _own_start_time() -> str:
    global _own_start
    pid = os.getpid()
    if _own_start is None or _own_start[0] != pid:  # forked since
        _own_start = (pid, process_start(pid))
    return _own_start[1] or ""


class LoadMarkers:
    """The loads/ directory of a cache (folder None: a cache without one gets no markers)."""

    def __init__(self, folder: Folder | None, mode: int) -> None:
        self.folder = folder
        self.mode = mode

    def _names(self) -> list[str]:
        if self.folder is None:
            return []
        try:
            with self.folder.listing() as listing:
                return [item.name for item in listing]
        except OSError:
            return []

    def dead(self, key: str) -> list[str]:
        """Returns the markers for key whose process died (on this host)."""
        prefix = f"{check_key(key)}."
        names = [name for name in self._names() if name.startswith(prefix)]
        return [name for name in names if _is_dead(name[len(prefix) :])]

    def describe(self, names: list[str]) -> str:
        """Says which processes died, for messages."""
        pids = sorted({name.split(".")[2] for name in names if name.count(".") >= 4})
        return f"process{'es' if len(pids) > 1 else ''} {', '.join(pids)}"

    def clear(self, names: list[str]) -> None:
        """Removes markers (never raises); names that are not a marker's are left alone."""
        for name in names:
            self._remove(name)

    def _remove(self, name: str) -> bool:
        key, _, rest = name.partition(".")
        if self.folder is None or not is_key(key) or len(rest.split(".")) != 4 or "/" in name:
            return False
        try:
            os.unlink(name, dir_fd=self.folder.fd)
            return True
        except OSError:
            return False

    @contextlib.contextmanager
    def loading(self, key: str) -> Iterator[None]:
        """Marks key as being loaded by this process for the duration of the block."""
        name = f"{check_key(key)}.{host_id()}.{os.getpid()}.{_own_start_time()}.{next(_counter)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        if self.folder is None:
            yield
            return
        try:
            os.close(os.open(name, flags, self.mode, dir_fd=self.folder.fd))
        except OSError as error:
            logger.debug("could not mark the load of %s: %s", key, error)
            yield
            return
        try:
            yield
        finally:
            self._remove(name)

    def sweep(self, keep: set[str]) -> int:
        """Removes markers of dead processes whose key is not in keep; returns how many."""
        removed = 0
        for name in self._names():
            key, _, rest = name.partition(".")
            if key not in keep and _is_dead(rest) and self._remove(name):
                removed += 1
        return removed


def _is_dead(rest: str) -> bool:
    """Judges a marker's "<host>.<pid>.<start>.<n>": True if its process is gone."""
    parts = rest.split(".")
    if len(parts) != 4 or parts[0] != host_id() or not parts[1].isdigit():
        return False  # another host's (or not a marker): nothing can be said here
    start = process_start(int(parts[1]))
    return start is None or start != parts[2]
