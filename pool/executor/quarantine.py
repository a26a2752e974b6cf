"""Programs that crash workers: counted, and quarantined once they crashed max_crashes.

A quarantined program is refused when it is submitted and fails if it was
queued already (ProgramQuarantinedError), so that a program that kills
workers cannot kill worker after worker.
"""

from __future__ import annotations

import collections
import threading

from pool.errors import ProgramQuarantinedError
from pool.executor.tasks import Kind, Request


class Quarantine:
    """Crash counts per program (by program id) and the programs quarantined for them."""

    def __init__(self, lock: threading.Lock, max_crashes: int) -> None:
        self._lock = lock  # the pool's: the queue's dispatch reads the quarantine under it
        self._max_crashes = max_crashes
        self._crashes: collections.Counter[str] = collections.Counter()
        self._quarantined: dict[str, str] = {}  # program id -> why, for the error

    def refusal_locked(self, program_id: str) -> ProgramQuarantinedError | None:
        """The error for a task of a quarantined program, else None."""
        reason = self._quarantined.get(program_id)
        return None if reason is None else ProgramQuarantinedError(reason)

    def count_crash(self, program_id: str, name: str) -> str:
        """Counts a crash of a program; returns what to add to the crash's message."""
        with self._lock:
            self._crashes[program_id] += 1
            crashes = self._crashes[program_id]
            if crashes < self._max_crashes:
                return ""
            self._quarantined[program_id] = (
                f"program {name!r} crashed {crashes} workers and is quarantined: "
                "this pool will not run it again"
            )
        return f" It has now crashed {crashes} workers and is quarantined."


def count_crash(quarantine: Quarantine, request: Request) -> str:
    """Counts a crash against the program a task ran; returns what to add to the crash's
    message. A VALUE task (a put or a fetch) runs no program of the caller's: a worker that
    died during one (killed for its memory, say) counts against nothing, so that Pool.put is
    never quarantined."""
    if request.kind is Kind.VALUE:
        return ""
    return quarantine.count_crash(request.program_id, request.name)
