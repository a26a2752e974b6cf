"""The manager thread's one wait point: an epoll set of descriptors and what each belongs to.

Worker sockets, worker output pipes and the pool's wake-up pipe all go in one
set, so that a single wait sees replies, deaths (end of file) and wake-ups
alike. Caller threads add and remove descriptors while the manager waits:
epoll takes such changes at once, and an event for a descriptor removed in
the meantime is dropped by ``wait``. (selectors.EpollSelector does the same
with a few microseconds more bookkeeping per change, and a caller changes the
set twice on every task it dispatches.)
"""

from __future__ import annotations

import select
from typing import Any

_MISSING = object()


class Watch:
    """Descriptors to wait on for reading, each with the value `wait` returns for it."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._what: dict[int, Any] = {}

    def add(self, fd: int, what: Any) -> None:
        """Watches a descriptor; `wait` returns `what` when it is readable or at its end."""
        self._what[fd] = what
        self._epoll.register(fd, select.EPOLLIN)

    def remove(self, fd: int) -> None:
        """Stops watching a descriptor (nothing happens if it is not watched)."""
        if self._what.pop(fd, _MISSING) is not _MISSING:
            try:  # noqa: SIM105 (not contextlib.suppress: this is on Pool.run's path)
                self._epoll.unregister(fd)
            except (OSError, ValueError):
                pass  # closed already

    def wait(self, timeout: float | None) -> list[Any]:
        """Waits up to `timeout` seconds (None: no limit); returns what became readable."""
        events = self._epoll.poll(-1 if timeout is None else timeout)
        found = []
        for fd, _ in events:
            what = self._what.get(fd, _MISSING)
            if what is not _MISSING:
                found.append(what)
        return found

    def close(self) -> None:
        """Closes the epoll descriptor."""
        self._epoll.close()
