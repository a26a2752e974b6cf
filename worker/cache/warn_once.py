"""WarnOnce: a warning a cache or a remote gives once per topic in a process, and
CacheUnavailableWarning, the category a cache gives it as.

A cache directory that cannot be written, a remote switched off or made
read-only, an entry refused: each is worth one warning (logged, and issued
with warnings.warn so that a caller can filter or raise it), not one per
compile. DiskCache and RemoteCache each keep one WarnOnce.
"""

from __future__ import annotations

import threading
import warnings

from worker.log import Logger, get_logger

logger = get_logger("pjrt_pool.cache")


_said_here: set[str] = set()
"""Every message a WarnOnce of this process has said."""


def said_here(message: str) -> bool:
    """Whether a WarnOnce of this process has said this message (a pool passing on its
    workers' warnings says none that the caller's process said itself)."""
    return message in _said_here


class WarnOnce:
    """Warns of each topic once: the first message of a topic is logged (on `log`, by default
    the caches' logger) and issued as `category` (attributed `stacklevel` frames up from
    warn); later ones are dropped."""

    def __init__(self, category: type[Warning], stacklevel: int, log: Logger = logger) -> None:
        self.category = category
        self.stacklevel = stacklevel
        self.log = log
        self._given: set[str] = set()
        self._lock = threading.Lock()

    def warn(self, topic: str, message: str) -> None:
        """Logs and issues message, unless a warning of this topic was given before."""
        with self._lock:
            if topic in self._given:
                return
            self._given.add(topic)
            _said_here.add(message)
        self.log.warning(message)
        warnings.warn(message, self.category, stacklevel=self.stacklevel)


class CacheUnavailableWarning(UserWarning):
    """The cache directory cannot be used; compiling goes on without the cache.

    Each is said once, as one line, through the "pjrt_pool.cache" logger
    (WarnOnce), and issued as this warning too, for programs that record it,
    filter it or make it an error. Python does not print it a second time:
    its default is to ignore it (the filter below), and a filter of the
    program's own, which comes first, decides otherwise.
    """


# Appended: any filter the program or -W sets is before it and wins.
warnings.filterwarnings("ignore", category=CacheUnavailableWarning, append=True)
