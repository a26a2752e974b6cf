"""What warming reports: each program's outcome, and the whole run's.

A WarmReport holds a ProgramReport per program (its Outcome, key, times,
error) and the run's figures; it reads as lines for people (summary) and as
JSON (to_json, report_json), the document `pjrt-pool warm --json` prints.
WarmInterrupted carries the report of a run a Ctrl-C stopped.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from pool.errors import ProgramQuarantinedError, TaskTimeoutError, WorkerCrashedError
from worker.cache import CacheCounters
from worker.cache.remote import RemoteCounters
from worker.errors import DeviceCountError, NeverCompileError
from worker.records import CompileStatistics, ProgramSpec
from worker.words import counted


class Outcome(enum.Enum):
    """What happened to one program."""

    COMPILED = "compiled"
    LOADED = "loaded"
    LOWERING_ERROR = "lowering error"
    SETUP_ERROR = "setup error"
    """The warm was set up so that the program cannot compile: it needs more devices than
    a worker holds (its error says what to pass)."""
    COMPILE_ERROR = "compile error"
    WORKER_CRASH = "worker crash"
    TIMEOUT = "timeout"
    NOT_STORED = "not stored"
    NOT_WARMED = "not warmed"
    """Not in the cache, and never-compile mode forbade compiling it."""
    SKIPPED = "skipped"
    INTERRUPTED = "interrupted"
    """Ctrl-C stopped warming before this program was in the cache (it was waiting to be
    lowered, waiting for a worker, or compiling)."""

    @property
    def ok(self) -> bool:
        """Whether the program is in the cache now."""
        return self in (Outcome.COMPILED, Outcome.LOADED)


@dataclass
class ProgramReport:
    """One program's outcome."""

    name: str
    outcome: Outcome = Outcome.SKIPPED
    key: str | None = None
    seconds: float = 0.0
    """Seconds spent lowering plus compiling or loading it."""
    lower_seconds: float = 0.0
    error: str | None = None
    note: str | None = None
    """How it was lowered, when that was not as asked (see parallel_lowering)."""
    spec: ProgramSpec | None = None
    phases: dict[str, float] | None = None
    """Seconds per phase of its compile or load in the worker (see worker.phases)."""
    jax_key: str | None = None
    """For JAX's own cache: the key JAX files it under (the entry's own is `key`)."""

    def to_json(self) -> dict[str, Any]:
        """Returns the report as a JSON-ready dict."""
        return {
            "name": self.name,
            "outcome": self.outcome.value,
            "key": self.key,
            "jax_key": self.jax_key,
            "seconds": round(self.seconds, 6),
            "lower_seconds": round(self.lower_seconds, 6),
            "error": self.error,
            "note": self.note,
            "phases": None
            if self.phases is None
            else {phase: round(seconds, 6) for phase, seconds in self.phases.items()},
        }


@dataclass
class WarmReport:
    """The outcome of warming: per program, and summed."""

    programs: list[ProgramReport]
    statistics: CompileStatistics = field(default_factory=CompileStatistics)
    cache_counters: CacheCounters = field(default_factory=CacheCounters)
    wall_seconds: float = 0.0
    platform: str | None = None
    cache_dir: str | None = None
    remote: RemoteCounters | None = None
    """What the remote tier did, in the workers and in the prefetch (None: no remote)."""
    prefetched: dict[str, int] = field(default_factory=dict)
    """How many programs' prefetches had each outcome (worker.cache.remote.Moved)."""
    interrupted: bool = False
    """Whether a Ctrl-C stopped warming (see WarmInterrupted)."""

    @property
    def ok(self) -> bool:
        """Whether every program is in the cache."""
        return all(p.outcome.ok for p in self.programs)

    @property
    def exit_code(self) -> int:
        """0 when every program is in the cache; 2 when a program could not compile as the
        warm was set up (SETUP_ERROR: a usage error); 1 otherwise."""
        if self.ok:
            return 0
        return 2 if any(p.outcome is Outcome.SETUP_ERROR for p in self.programs) else 1

    def counts(self) -> dict[str, int]:
        """How many programs had each outcome."""
        counts: dict[str, int] = {}
        for program in self.programs:
            counts[program.outcome.value] = counts.get(program.outcome.value, 0) + 1
        return counts

    def to_json(self) -> dict[str, Any]:
        """Returns the whole report as a JSON-ready dict."""
        return {
            "ok": self.ok,
            "interrupted": self.interrupted,
            "counts": self.counts(),
            "wall_seconds": round(self.wall_seconds, 6),
            "statistics": self.statistics._asdict(),
            "cache_counters": self.cache_counters._asdict(),
            "platform": self.platform,
            "cache_dir": self.cache_dir,
            "remote": None
            if self.remote is None
            else {**self.remote._asdict(), "prefetched": self.prefetched},
            "programs": [p.to_json() for p in self.programs],
        }

    def summary(self) -> str:
        """A few lines for people: counts, statistics, and each failure."""
        counts = self.counts()
        stopped = counts.pop(Outcome.INTERRUPTED.value, 0)
        said = [f"{n} {outcome}" for outcome, n in sorted(counts.items())]
        if self.interrupted:
            said.append(f"{stopped} not compiled")
            first = f"interrupted after {self.wall_seconds:.2f} s: {', '.join(said)}"
        else:
            warmed = sum(program.outcome.ok for program in self.programs)
            total = counted(len(self.programs), "program")
            first = (
                f"warmed {total}" if warmed == len(self.programs) else f"warmed {warmed} of {total}"
            )
            first += f" in {self.wall_seconds:.2f} s: {', '.join(said)}"
        # The workers' seconds, each program's counted once where it was compiled or
        # loaded: with several workers at once, more than the wall time above.
        lines = [first, f"statistics, times summed over the workers: {self.statistics}"]
        if self.remote is not None:
            remote = self.remote
            lines.append(
                f"remote cache: {counted(remote.hits, 'entry')} fetched "
                f"({self.prefetched.get('fetched', 0)} by prefetch), "
                f"{counted(remote.waited, 'compile')} saved by waiting on another host's lease, "
                f"{remote.published} published, {remote.refused} refused, "
                f"{counted(remote.errors, 'failed request')}"
            )
        if self.statistics.compiled == 0 and self.ok:
            lines.append("nothing was compiled: every program came from the warm cache")
        for program in self.programs:
            if program.outcome is Outcome.INTERRUPTED:
                continue  # counted above: the interrupt's, not the program's
            if not program.outcome.ok:
                first = (program.error or "").strip().splitlines()
                lines.append(
                    f"  {program.name}: {program.outcome.value}: {first[0] if first else ''}"
                )
            elif program.note:
                lines.append(f"  {program.name}: {program.note}")
        return "\n".join(lines)


class WarmInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped warm(); `report` (a WarmReport, interrupted) says what was warmed.

    It is a KeyboardInterrupt, so a caller that does not look for it stops as
    on any Ctrl-C. By the time it is raised the workers are stopped and no
    program is being lowered in this process.
    """

    def __init__(self, report: WarmReport) -> None:
        super().__init__("warming was interrupted")
        self.report = report


def classify(error: BaseException) -> Outcome:
    """The outcome of a program whose compile (or load) raised `error`."""
    if isinstance(error, NeverCompileError):
        return Outcome.NOT_WARMED
    if isinstance(error, TaskTimeoutError):
        return Outcome.TIMEOUT
    if isinstance(error, (WorkerCrashedError, ProgramQuarantinedError)):
        return Outcome.WORKER_CRASH
    if isinstance(error, DeviceCountError):
        return Outcome.SETUP_ERROR
    return Outcome.COMPILE_ERROR


def error_text(error: BaseException) -> str:
    """An error as a report says it: its class and message."""
    return f"{type(error).__name__}: {error}"


def report_json(report: WarmReport) -> str:
    """The report as indented JSON."""
    return json.dumps(report.to_json(), indent=2)
