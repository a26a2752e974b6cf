"""Where the time goes: seconds per phase of a compile and of a process's start-up.

compile_program times its phases:

    key        hashing the program text and the plugin build
    lookup     reading and deserializing a cache entry (a hit, or a miss's check)
    lock_wait  waiting for another process's compile of the same program
    slot_wait  waiting for a compile slot (see worker.compile.slots)
    compile    the plugin's compile: parsing the StableHLO, XLA's passes,
               autotuning and code generation, which PJRT does in one call
    serialize  the executable to bytes
    publish    writing the cache entry

and loading a plugin times its start-up (``preload`` of NVIDIA libraries,
``plugin_load``, ``client`` creation; a worker adds ``interpreter``, from its
spawn to its first line of Python, and ``imports``).

Each compile and start-up is logged at debug level on the ``pjrt_pool.phases``
logger, kept for last_phases() (the calling thread's last compile), summed
per process in process_phases(), and, when the environment
variable ``PJRT_POOL_PHASE_LOG`` names a file, appended to it as one JSON line
(with the process id), so that the phases of every worker of a Pool can be
read in one place. Recording never fails a compile.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from worker.log import get_logger

PHASE_LOG_ENV = "PJRT_POOL_PHASE_LOG"
"""Names a file to which every process appends one JSON line per compile and start-up."""

logger = get_logger("pjrt_pool.phases")

_totals: dict[str, float] = {}
_totals_lock = threading.Lock()
_last = threading.local()


class Phases:
    """Seconds per phase of one compile (or start-up), filled by timing blocks of code."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def time(self, phase: str) -> Iterator[None]:
        """Adds the time spent in the with-block to a phase."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)

    def add(self, phase: str, seconds: float) -> None:
        """Adds seconds to a phase."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def record(self, kind: str, **details: Any) -> None:
        """Logs the phases, adds them to the process's sums and to the phase log, if any."""
        with _totals_lock:
            for phase, seconds in self.seconds.items():
                _totals[phase] = _totals.get(phase, 0.0) + seconds
        _last.seconds = {kind: dict(self.seconds)}
        rounded = {phase: round(seconds, 6) for phase, seconds in self.seconds.items()}
        logger.debug("%s %s: %s", kind, details, rounded)
        path = os.environ.get(PHASE_LOG_ENV)
        if path:
            line = json.dumps(
                {"kind": kind, "pid": os.getpid(), "time": time.time(), **details, **rounded}
            )
            _append(path, line + "\n")


STARTUP = Phases()
"""This process's start-up phases, recorded when its plugin has loaded."""


def _append(path: str, line: str) -> None:
    # One write() of a short line to a file opened O_APPEND: lines of
    # concurrent processes do not interleave.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as error:
        logger.debug("cannot append to the phase log %s: %s", path, error)


def last_phases(kind: str = "compile") -> dict[str, float]:
    """Returns the phases of this thread's last recorded compile (or other kind); {} if none."""
    return dict(getattr(_last, "seconds", {}).get(kind, {}))


def process_phases() -> dict[str, float]:
    """Returns the seconds per phase summed over this process's compiles and start-up."""
    with _totals_lock:
        return dict(_totals)
