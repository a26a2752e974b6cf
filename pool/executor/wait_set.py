"""The manager thread's one wait point: an epoll set of descriptors and what each belongs to.

Worker sockets, worker output pipes and a wake-up pipe all go in one set, so
that a single wait sees replies, deaths (end of file) and wake-ups alike.
Caller threads add and remove descriptors while the manager waits: epoll
takes such changes at once, and an event for a descriptor removed in the
meantime is dropped by ``wait``, which never changes the set itself (a
caller may have added the descriptor back since it looked).
(selectors.EpollSelector does the same with a few microseconds more
bookkeeping per change, and callers change the set on every task they
dispatch.) Adding and removing are idempotent, and do
nothing once the set is closed, so a late hand-back can never touch a
descriptor number that has been reused since.
"""

from __future__ import annotations

import contextlib
import os
import select
from typing import Any

from worker.wire.fds import close_quietly

_MISSING = object()

MAX_WAIT_SECONDS = 3600.0
"""The longest single wait: epoll takes at most 2**31 - 1 ms, and callers simply wait again."""


class WaitSet:
    """Descriptors to wait on for reading, each with the value `wait` returns for it.

    Every registered fd has a value in the table, even when a change is
    cut short (a Ctrl-C can land between its two steps): `add` records,
    then registers (an fd registered already is fine); `remove`
    unregisters, then forgets (an fd unregistered already is fine). So an
    event for an fd with no value is one `wait` collected before a caller
    removed it: it is dropped, and the set is left alone. Unregistering
    there raced with callers: one could have added the fd back between the
    look and the unregistering, which left its socket out of the set for
    good (a reply never read, a close that waited forever). Callers change
    the set under the pool's lock; `wait` runs without it. Any thread may
    `wake` the waiting one; `wait` empties the wake-up pipe itself and
    returns only what was added.
    """

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._what: dict[int, Any] = {}
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._epoll.register(self._wake_r, select.EPOLLIN)

    def wake(self) -> None:
        """Ends the current wait, or the next one.

        Callers hold the pool's lock, under which close() closes the pipe: a
        wake after close writes nothing (never into a reused descriptor).
        """
        if self._wake_w >= 0:
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"\0")

    def add(self, fd: int, what: Any) -> None:
        """Watches a descriptor; `wait` returns `what` when it is readable or at its end."""
        if self._closed or fd < 0:
            return
        self._what[fd] = what
        try:  # noqa: SIM105 (not contextlib.suppress: this is on every task's path)
            self._epoll.register(fd, select.EPOLLIN)
        except FileExistsError:
            pass

    def remove(self, fd: int) -> None:
        """Stops watching a descriptor (nothing happens if it is not watched)."""
        if self._closed or fd < 0:
            return
        try:  # noqa: SIM105 (as in add)
            self._epoll.unregister(fd)
        except (OSError, ValueError):
            pass  # not registered, or closed already
        self._what.pop(fd, None)

    def wait(self, timeout: float | None) -> list[Any]:
        """Waits up to `timeout` seconds (None: no limit); returns what became readable."""
        limit = MAX_WAIT_SECONDS if timeout is None else min(timeout, MAX_WAIT_SECONDS)
        found = []
        for fd, _ in self._epoll.poll(limit):
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError, OSError):
                    while os.read(fd, 4096):
                        pass
                continue
            what = self._what.get(fd, _MISSING)
            if what is not _MISSING:  # else removed since the poll: dropped (see the class)
                found.append(what)
        return found

    def close(self) -> None:
        """Closes the epoll descriptor and the wake-up pipe; later adds, removes and wakes do
        nothing. Called under the pool's lock (see wake)."""
        self._closed = True
        self._what.clear()
        self._epoll.close()
        close_quietly(self._wake_r)
        close_quietly(self._wake_w)
        self._wake_r = self._wake_w = -1
