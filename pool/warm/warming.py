"""Warming the disk cache: lower, compile and record many programs, reporting each.

    spec ──load──▶ WarmPrograms ──Lowerer (thread or N processes)──▶ LoweredPrograms
                                                                     │ as each is lowered
                                                                     ▼
                     WarmReport ◀── outcome per program ◀── Pool.submit_compile (workers)

Lowering overlaps compiling: each program goes to the pool as soon as it is
lowered. With a remote cache tier, each lowered program's entry is first
prefetched from the remote into the local cache (worker.cache.remote.transfer,
bounded concurrency), so a program another host compiled is loaded, not
compiled; the workers publish what they compile. Every failure is that
program's outcome (a lowering error, a compile error, a worker crash, a
timeout) and warming carries on, unless fail_fast.

A Ctrl-C stops warming: the lowering after the program being lowered, the
workers at once (the Pool terminates). warm() then raises WarmInterrupted, a
KeyboardInterrupt that carries the report of what was warmed before it;
programs it stopped are INTERRUPTED, not failures of their own.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pool.errors import ProgramQuarantinedError, TaskTimeoutError, WorkerCrashedError
from pool.executor.compile_many import CompileResult
from pool.executor.pool import Pool
from pool.executor.programs import program_key_parts, program_text_digest
from pool.progress import ProgressDisplay
from pool.warm.lowerer import Lowered, Lowerer
from pool.warm.spec_file import Spec, WarmProgram
from worker.cache import CacheCounters, DiskCache, open_cache
from worker.cache.remote import (
    Moved,
    Prefetcher,
    RemoteCache,
    RemoteCounters,
    TransferReport,
    open_remote,
)
from worker.compile.never_compile import never_compile_on
from worker.errors import NeverCompileError
from worker.identity.keys import key_of
from worker.plugin.topology import TopologySpec
from worker.records import CompileStatistics, ProgramSpec


class Outcome(enum.Enum):
    """What happened to one program."""

    COMPILED = "compiled"
    LOADED = "loaded"
    LOWERING_ERROR = "lowering error"
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

    def to_json(self) -> dict[str, Any]:
        """Returns the report as a JSON-ready dict."""
        return {
            "name": self.name,
            "outcome": self.outcome.value,
            "key": self.key,
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
        """0 when every program is in the cache, 1 otherwise."""
        return 0 if self.ok else 1

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
            first = f"warmed {len(self.programs)} programs in {self.wall_seconds:.2f} s: "
            first += ", ".join(said)
        lines = [first, f"statistics: {self.statistics}"]
        if self.remote is not None:
            remote = self.remote
            lines.append(
                f"remote cache: {remote.hits} entries fetched "
                f"({self.prefetched.get('fetched', 0)} by prefetch), {remote.waited} compiles "
                f"saved by waiting on another host's lease, {remote.published} published, "
                f"{remote.refused} refused, {remote.errors} failed requests"
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


def _classify(error: BaseException) -> Outcome:
    if isinstance(error, NeverCompileError):
        return Outcome.NOT_WARMED
    if isinstance(error, TaskTimeoutError):
        return Outcome.TIMEOUT
    if isinstance(error, (WorkerCrashedError, ProgramQuarantinedError)):
        return Outcome.WORKER_CRASH
    return Outcome.COMPILE_ERROR


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


@contextlib.contextmanager
def _compiler(
    scheduler: str | None,
    workers: int | None,
    platform: str | None,
    cache_dir: str | os.PathLike[str] | None,
    timeout: float | None,
    initializer: Any,
    remote: str | None = None,
    topology: str | TopologySpec | None = None,
) -> Iterator[Any]:
    """A local Pool, or a ClusterPool on the Dask scheduler at `scheduler` (local:N starts one)."""
    if scheduler is None:
        with Pool(
            workers,
            platform=platform,
            cache_dir=cache_dir,
            task_timeout=timeout,
            initializer=initializer,
            remote=remote,
            topology=topology,
        ) as pool:
            yield pool
        return
    # Here, not at the top: pool.cluster needs Dask's distributed, an optional extra.
    from pool.cluster import ClusterPool, connect

    with (
        connect(scheduler) as client,
        ClusterPool(
            client,
            workers_per_node=workers,
            platform=platform,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            task_timeout=timeout,
            initializer=initializer,
            remote=remote,
            topology=topology,
        ) as cluster,
    ):
        yield cluster


def warm(
    spec: Spec | list[WarmProgram],
    *,
    workers: int | None = None,
    platform: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    fail_fast: bool = False,
    lower_workers: int = 0,
    progress: ProgressDisplay | None = None,
    scheduler: str | None = None,
    remote: str | None = None,
    topology: str | TopologySpec | None = None,
) -> WarmReport:
    """Lowers and compiles every program of a spec into the disk cache; returns the report.

    workers compile processes (default: the CPU count; per node on a
    cluster), lower_workers extra lowering processes (0: lower in a thread of
    this process, overlapped with compiling). timeout bounds each program's
    compile. With fail_fast, the first failure stops the rest, which are
    reported as skipped. scheduler is a Dask scheduler address to compile on
    that cluster instead of locally ("local:N" starts a local cluster of N
    workers); see pool.cluster. In never-compile mode (PJRT_POOL_COMPILE=never)
    nothing is compiled: warming checks that every program is in the cache,
    and stops at the first that is not (as with fail_fast). remote is the
    URL of a remote cache tier (default: PJRT_POOL_CACHE_REMOTE): entries are
    prefetched from it before their programs compile (see the module
    docstring), and the workers publish to it; with a scheduler, it is
    given to every node (ClusterPool(remote=)), whose workers fetch and
    publish themselves (no prefetch here): the report's remote counters are
    theirs, summed over the nodes. topology (a name such as "v5e:1x1", or a
    TopologySpec) compiles every program for that topology without a device
    (Pool(topology=...)): a machine without a TPU warms the cache, and makes
    the manifest, of a TPU host. A Ctrl-C raises WarmInterrupted, with the
    report of what was warmed before it, once the workers have stopped.
    """
    tier = open_remote(remote) if scheduler is None else None
    before = RemoteCounters() if tier is None else tier.counters
    moved: dict[str, Moved] = {}
    programs = spec.programs if isinstance(spec, Spec) else list(spec)
    fail_fast = fail_fast or never_compile_on()
    initializer = spec.initializer if isinstance(spec, Spec) else None
    reports = [ProgramReport(p.name) for p in programs]
    started = time.monotonic()
    finished = threading.Semaphore(0)
    stop = threading.Event()
    interrupted = threading.Event()
    submitted: list[Any] = []

    def finish(index: int, outcome: Outcome, error: BaseException | None = None) -> None:
        report = reports[index]
        if interrupted.is_set() and not outcome.ok:
            # Stopped by the Ctrl-C (a task the pool's end failed, a lowering it
            # cancelled): the interrupt's doing, not a failure of the program.
            outcome, error = Outcome.INTERRUPTED, None
        report.outcome = outcome
        report.error = None if error is None else _error_text(error)
        if progress is not None and outcome is not Outcome.INTERRUPTED:
            detail = report.error or report.note or ""
            progress.update(report.name, outcome.value, report.seconds, detail)
        if fail_fast and not outcome.ok and outcome is not Outcome.SKIPPED:
            stop.set()
        finished.release()

    # Called from the pool's, the lowering's and the prefetch's threads, once the
    # compiler, prefetcher and lowerer below exist.
    def compiled(index: int, future: Any) -> None:
        report = reports[index]
        if future.cancelled():
            finish(index, Outcome.SKIPPED)
            return
        error = future.exception()
        if error is not None:
            finish(index, _classify(error), error)
            return
        result: CompileResult = future.result()
        report.spec = result.spec
        report.key = result.spec.key
        report.phases = result.phases
        report.seconds += result.statistics.compile_seconds + result.statistics.load_seconds
        finish(index, Outcome.COMPILED if result.statistics.compiled else Outcome.LOADED)

    def lowered(index: int, future: Future[Lowered]) -> None:
        report = reports[index]
        if future.cancelled() or stop.is_set():
            finish(index, Outcome.SKIPPED)
            return
        error = future.exception()
        if error is not None:
            finish(index, Outcome.LOWERING_ERROR, error)
            return
        program, report.lower_seconds, report.note = future.result()
        report.seconds = report.lower_seconds
        if prefetcher is None:
            submit(index, program)
            return
        options = programs[index].compile_options
        key = key_of(program_key_parts(compiler.key_parts, program_text_digest(program), options))

        def fetched(done: Future[Moved]) -> None:
            try:
                moved[key] = done.result()
            except Exception:  # never expected; the worker then fetches for itself
                moved[key] = Moved.FAILED
            submit(index, program)

        prefetcher.submit(key).add_done_callback(fetched)

    def submit(index: int, program: Any) -> None:
        if stop.is_set():
            finish(index, Outcome.SKIPPED)
            return
        try:
            task = compiler.submit_compile(
                program,
                name=programs[index].name,
                timeout=timeout,
                compile_options=programs[index].compile_options,
            )
        except Exception as failure:  # quarantined, or the pool is shutting down
            finish(index, Outcome.SKIPPED if stop.is_set() else _classify(failure), failure)
            return
        submitted.append(task)
        task.add_done_callback(lambda f: compiled(index, f))

    statistics, counters, workers_remote = CompileStatistics(), CacheCounters(), RemoteCounters()
    compiling = _compiler(
        scheduler, workers, platform, cache_dir, timeout, initializer, remote, topology
    )
    try:
        with compiling as compiler, _prefetcher(tier, compiler, cache_dir) as prefetcher:
            try:
                with Lowerer(lower_workers, platform) as lowerer:
                    try:
                        lowerer.lower_all(programs, lowered)
                        for _ in programs:
                            finished.acquire()
                            if stop.is_set():
                                lowerer.close(cancel=True)
                                for task in list(submitted):
                                    task.cancel()
                    except KeyboardInterrupt:
                        # First, before the lowering is cancelled and the pool stops the
                        # tasks: what they fail with is then the interrupt's (see finish).
                        interrupted.set()
                        stop.set()
                        raise
            finally:  # what was compiled before an interrupt counts too
                statistics, counters = compiler.statistics, compiler.cache_counters
                workers_remote = compiler.remote_counters
    except KeyboardInterrupt as interrupt:
        interrupted.set()
        stopped: KeyboardInterrupt | None = interrupt
        for program in reports:
            if program.outcome is Outcome.SKIPPED:  # never finished (the default), or cancelled
                program.outcome = Outcome.INTERRUPTED
    else:
        stopped = None
    finally:
        if progress is not None:
            progress.close()  # ends a live line, however warming ended
    if scheduler is None:  # a cluster's nodes may keep caches this process cannot see
        _check_stored(reports, cache_dir)
    remote_report = None
    if tier is not None:
        prefetch = RemoteCounters(*(a - b for a, b in zip(tier.counters, before, strict=True)))
        remote_report = workers_remote.add(prefetch)
    elif scheduler is not None and (remote or workers_remote != RemoteCounters()):
        remote_report = workers_remote  # the nodes' (their own remote, when not given one)
    prefetched = TransferReport(moved).counts()
    report = WarmReport(
        reports,
        statistics,
        counters,
        time.monotonic() - started,
        platform,
        None if cache_dir is None else os.fspath(cache_dir),
        remote_report,
        prefetched,
        interrupted=stopped is not None,
    )
    if stopped is not None:
        raise WarmInterrupted(report) from stopped
    return report


@contextlib.contextmanager
def _prefetcher(
    tier: RemoteCache | None, compiler: Any, cache_dir: str | os.PathLike[str] | None
) -> Iterator[Prefetcher | None]:
    """A Prefetcher into the pool's cache, when there is a remote and the workers said their
    key parts (a Pool with a remote does); None otherwise: the workers fetch for themselves."""
    if tier is None or getattr(compiler, "key_parts", None) is None:
        yield None
        return
    cache = open_cache(cache_dir)
    if not cache.writable:
        yield None
        return
    with Prefetcher(tier, cache) as prefetcher:
        yield prefetcher


def _check_stored(reports: list[ProgramReport], cache_dir: str | os.PathLike[str] | None) -> None:
    """Marks programs that compiled or loaded but whose entry is not in the cache directory.

    A cache directory that cannot be written (a regular file, read-only, full)
    only makes the workers warn and compile without it, and a size bound
    smaller than the programs evicts some of them: either way warming has
    not put the program in the cache, and the report must not say it has.
    """
    cache = DiskCache(cache_dir, create=False)
    for report in reports:
        if report.outcome.ok and report.key is not None:
            if cache.usable and cache.path_of(report.key).is_file():
                continue
            report.outcome = Outcome.NOT_STORED
            report.error = (
                f"compiled, but no entry {report.key} is in the cache directory "
                f"{cache.directory}: the directory could not be written (not a directory, "
                "read-only or full) or its size bound evicted the entry; warm into a "
                "writable directory with room"
            )


def report_json(report: WarmReport) -> str:
    """The report as indented JSON."""
    return json.dumps(report.to_json(), indent=2)
