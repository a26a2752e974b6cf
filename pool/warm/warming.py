"""Warming the disk cache: lower, compile and record many programs, reporting each.

    spec ──load──▶ WarmPrograms
      lower     _Lower      a Lowerer (a thread, or N processes) ──▶ each LoweredProgram,
                            handed on as soon as it is lowered
      prefetch  _Prefetch   with a remote tier: its entry fetched into the local cache
      compile   _Compile    Pool.submit_compile (workers; a ClusterPool's nodes)
      report    _report     the ProgramReports, checked against the cache directory,
                            and the pool's figures ──▶ WarmReport (report.py)

Each stage is an object (or, for the report, a function) with its own state;
each tells the _Ledger how a program went, and the _Ledger is the one writer
of the ProgramReports, of the progress display, and of the stop that
fail-fast and a Ctrl-C set.

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
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, NamedTuple

from pool.executor.compile_many import CompileResult
from pool.executor.programs import program_key_parts, program_text_digest
from pool.face import Pool, PoolFace
from pool.jax_cache.entries import JaxCacheDestination, JaxFiles
from pool.jax_cache.target import JaxTarget
from pool.lowering.sharding import declared_devices
from pool.progress import ProgressDisplay
from pool.warm.lowerer import Lowered, Lowerer
from pool.warm.report import (
    Outcome,
    ProgramReport,
    WarmInterrupted,
    WarmReport,
    classify,
    error_text,
)
from pool.warm.spec_file import Spec, WarmProgram
from worker.cache import CacheCounters, DiskCache
from worker.cache.remote import (
    Moved,
    Prefetcher,
    RemoteCache,
    RemoteCounters,
    TransferReport,
    open_remote,
)
from worker.compile.never_compile import never_compile_on
from worker.identity.keys import key_of
from worker.partitioning import compile_options_for, devices_needed
from worker.plugin.platforms.registry import platform_named
from worker.plugin.runtime import default_platform
from worker.plugin.topology import TopologySpec
from worker.records import CompileStatistics, JaxCompile, LoweredProgram


class _Ledger:
    """The programs' reports, and what warm() waits on: the one writer of every ProgramReport.

    Each stage tells it how a program went (lowered, compiled, or finished
    with an outcome), from whatever thread the stage runs on: the lowering's,
    a prefetch's, the pool's. It counts the programs finished, shows each on
    the progress display, and sets `stop` at the first failure under
    fail-fast; after a Ctrl-C (interrupt) what the interrupt stopped is
    INTERRUPTED, not a failure of its own.
    """

    def __init__(
        self, programs: list[WarmProgram], progress: ProgressDisplay | None, fail_fast: bool
    ) -> None:
        self.reports = [ProgramReport(p.name) for p in programs]
        self.stop = threading.Event()
        """Set at the first failure under fail-fast, and by a Ctrl-C: no stage starts more."""
        self._interrupted = threading.Event()
        self._progress = progress
        self._fail_fast = fail_fast
        self._finished = threading.Semaphore(0)

    def lowered(self, index: int, lowered: Lowered) -> None:
        """Records a program's lowering (its seconds so far are the lowering's)."""
        report = self.reports[index]
        report.lower_seconds, report.note = lowered.seconds, lowered.note
        report.seconds = lowered.seconds

    def compiled(self, index: int, result: CompileResult, jax_key: str | None = None) -> None:
        """Records a program's compile (or load) in a worker, which finishes it (jax_key: the
        key JAX's cache files it under, for JAX's own cache)."""
        report = self.reports[index]
        report.spec = result.spec
        report.key = result.spec.key
        report.jax_key = jax_key
        report.phases = result.phases
        report.seconds += result.statistics.compile_seconds + result.statistics.load_seconds
        self.finish(index, Outcome.COMPILED if result.statistics.compiled else Outcome.LOADED)

    def finish(self, index: int, outcome: Outcome, error: BaseException | None = None) -> None:
        """Ends a program with its outcome: shown, counted, and under fail-fast a failure
        stops the rest."""
        report = self.reports[index]
        if self._interrupted.is_set() and not outcome.ok:
            # Stopped by the Ctrl-C (a task the pool's end failed, a lowering it
            # cancelled): the interrupt's doing, not a failure of the program.
            outcome, error = Outcome.INTERRUPTED, None
        report.outcome = outcome
        report.error = None if error is None else error_text(error)
        if self._progress is not None and outcome is not Outcome.INTERRUPTED:
            detail = report.error or report.note or ""
            self._progress.update(report.name, outcome.value, report.seconds, detail)
        if self._fail_fast and not outcome.ok and outcome is not Outcome.SKIPPED:
            self.stop.set()
        self._finished.release()

    def wait_one(self) -> None:
        """Waits until one more program has finished."""
        self._finished.acquire()

    def interrupt(self) -> None:
        """A Ctrl-C: no stage starts more, and what it stops is INTERRUPTED (see finish)."""
        self._interrupted.set()
        self.stop.set()

    def interrupted_the_rest(self) -> None:
        """After a Ctrl-C: the programs never finished (or cancelled) are INTERRUPTED."""
        self.interrupt()
        for report in self.reports:
            if report.outcome is Outcome.SKIPPED:  # never finished (the default), or cancelled
                report.outcome = Outcome.INTERRUPTED

    def check_stored(self, cache_dir: str | os.PathLike[str] | None) -> None:
        """Marks programs that compiled or loaded but whose entry is not in the cache directory.

        A cache directory that cannot be written (a regular file, read-only, full)
        only makes the workers warn and compile without it, and a size bound
        smaller than the programs evicts some of them: either way warming has
        not put the program in the cache, and the report must not say it has.
        """
        with DiskCache(cache_dir, create=False) as cache:
            self._check_stored(cache)

    def _check_stored(self, cache: DiskCache) -> None:
        for report in self.reports:
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

    def end_progress(self) -> None:
        """Ends the progress display's live line, however warming ended."""
        if self._progress is not None:
            self._progress.close()


class _Compile:
    """The compile stage: each program, once lowered (and prefetched), submitted to the pool
    (a Pool or a ClusterPool); its CompileResult, or what failed it, goes to the ledger."""

    def __init__(
        self,
        compiler: PoolFace,
        programs: list[WarmProgram],
        timeout: float | None,
        ledger: _Ledger,
        jax_files: JaxFiles | None = None,
    ) -> None:
        self._compiler = compiler
        self._programs = programs
        self._timeout = timeout
        self._ledger = ledger
        self._jax_files = jax_files
        self._submitted: list[Future[CompileResult]] = []

    def submit(self, index: int, program: LoweredProgram, jax: JaxCompile | None = None) -> None:
        """Submits a lowered program's compile (nothing, once warming stops); with jax, its
        compile for JAX's own cache."""
        ledger = self._ledger
        if ledger.stop.is_set():
            ledger.finish(index, Outcome.SKIPPED)
            return
        try:
            task = self._compiler.submit_compile(
                program,
                name=self._programs[index].name,
                timeout=self._timeout,
                compile_options=None if jax else self._programs[index].compile_options,
                jax=jax,
            )
        except Exception as failure:  # quarantined, too many devices, or shutting down
            outcome = Outcome.SKIPPED if ledger.stop.is_set() else classify(failure)
            ledger.finish(index, outcome, failure)
            return
        self._submitted.append(task)
        task.add_done_callback(functools.partial(self._compiled, index, jax))

    def _compiled(self, index: int, jax: JaxCompile | None, future: Future[CompileResult]) -> None:
        if future.cancelled():
            self._ledger.finish(index, Outcome.SKIPPED)
            return
        error = future.exception()
        if error is not None:
            self._ledger.finish(index, classify(error), error)
            return
        if jax is not None and self._jax_files is not None:
            try:
                self._jax_files.write(jax.key)
            except (OSError, ValueError) as failure:
                self._ledger.finish(index, Outcome.NOT_STORED, failure)
                return
        self._ledger.compiled(index, future.result(), None if jax is None else jax.key)

    def cancel(self) -> None:
        """Cancels the compiles submitted that have not begun (fail-fast's stop)."""
        for task in list(self._submitted):
            task.cancel()


class _Prefetch:
    """The prefetch stage: with a remote tier, each lowered program's entry fetched into the
    pool's cache before it goes to compile, a bounded number at a time (see
    worker.cache.remote.transfer), so that what another host compiled is loaded, not
    compiled. Without a remote, on a cluster (whose nodes fetch for themselves), or when
    the workers did not say their key parts, a program goes straight on."""

    def __init__(self, tier: RemoteCache | None) -> None:
        self._tier = tier
        self._before = RemoteCounters() if tier is None else tier.counters
        self._prefetcher: Prefetcher | None = None
        self._key_parts: dict[str, Any] | None = None
        self._moved: dict[str, Moved] = {}

    @contextlib.contextmanager
    def into(self, compiler: PoolFace, cache_dir: str | os.PathLike[str] | None) -> Iterator[None]:
        """Prefetches into the pool's cache while the with block runs (its fetches end with
        it), when there is a remote and the workers said their key parts (a Pool with a
        remote does)."""
        tier = self._tier
        key_parts = None if tier is None else getattr(compiler, "key_parts", None)
        if tier is None or key_parts is None:
            yield
            return
        # Its own instance, closed after: a process that warms many directories keeps none.
        with DiskCache(cache_dir) as cache:
            if not cache.writable:
                yield
                return
            with Prefetcher(tier, cache) as prefetcher:
                self._prefetcher, self._key_parts = prefetcher, key_parts
                yield

    def then(
        self,
        index: int,
        program: LoweredProgram,
        compile_options: bytes | None,
        submit: Callable[[int, LoweredProgram], None],
    ) -> None:
        """Fetches a program's entry, then calls submit(index, program) (at once without a
        prefetcher)."""
        prefetcher = self._prefetcher
        if prefetcher is None:
            submit(index, program)
            return
        digest = program_text_digest(program)
        options = compile_options_for(program, compile_options)
        key = key_of(program_key_parts(self._key_parts, digest, options))

        def fetched(done: Future[Moved]) -> None:
            try:
                self._moved[key] = done.result()
            except Exception:  # never expected; the worker then fetches for itself
                self._moved[key] = Moved.FAILED
            submit(index, program)

        prefetcher.submit(key).add_done_callback(fetched)

    def remote_report(self, workers: RemoteCounters) -> RemoteCounters | None:
        """What the remote tier did: the workers' counters and this process's prefetch
        (None without a remote here)."""
        if self._tier is None:
            return None
        counters = zip(self._tier.counters, self._before, strict=True)
        return workers.add(RemoteCounters(*(a - b for a, b in counters)))

    def counts(self) -> dict[str, int]:
        """How many programs' prefetches had each outcome (worker.cache.remote.Moved)."""
        return TransferReport(self._moved).counts()


class _Lower:
    """The lower stage: a Lowerer (a thread here, or lowering processes) lowers every
    program and hands each on, to prefetch and then compile, as soon as it is lowered, so
    that lowering overlaps compiling. run() waits until every program has finished."""

    def __init__(
        self, programs: list[WarmProgram], ledger: _Ledger, prefetch: _Prefetch, compiles: _Compile
    ) -> None:
        self._programs = programs
        self._ledger = ledger
        self._prefetch = prefetch
        self._compiles = compiles

    def run(self, processes: int, platform: str | None, jax_target: JaxTarget | None) -> None:
        """Lowers every program and waits for each to finish; at a stop (fail-fast), the
        lowering and the compiles not begun are cancelled. A Ctrl-C stops everything (see
        _Ledger.interrupt) before the lowering is cancelled and the pool stops the tasks."""
        ledger = self._ledger
        with Lowerer(processes, platform, jax_target) as lowerer:
            try:
                lowerer.lower_all(self._programs, self._lowered)
                for _ in self._programs:
                    ledger.wait_one()
                    if ledger.stop.is_set():
                        lowerer.close(cancel=True)
                        self._compiles.cancel()
            except KeyboardInterrupt:
                # First, before the lowering is cancelled and the pool stops the
                # tasks: what they fail with is then the interrupt's (see finish).
                ledger.interrupt()
                raise

    def _lowered(self, index: int, future: Future[Lowered]) -> None:
        ledger = self._ledger
        if future.cancelled() or ledger.stop.is_set():
            ledger.finish(index, Outcome.SKIPPED)
            return
        error = future.exception()
        if error is not None:
            ledger.finish(index, Outcome.LOWERING_ERROR, error)
            return
        lowered = future.result()
        ledger.lowered(index, lowered)
        if lowered.jax is not None:  # the worker looks in the remote tier for JAX's value
            self._compiles.submit(index, lowered.program, lowered.jax)
            return
        options = self._programs[index].compile_options
        self._prefetch.then(index, lowered.program, options, self._compiles.submit)


class _Figures(NamedTuple):
    """What the pool counted: its compile statistics, cache counters and remote counters."""

    statistics: CompileStatistics = CompileStatistics()
    cache_counters: CacheCounters = CacheCounters()
    remote_counters: RemoteCounters = RemoteCounters()

    @classmethod
    def of(cls, compiler: PoolFace) -> _Figures:
        """The figures a pool (a Pool, or a ClusterPool's nodes) has counted so far."""
        return cls(compiler.statistics, compiler.cache_counters, compiler.remote_counters)


def _devices_declared(
    programs: list[WarmProgram], platform: str | None, topology: str | TopologySpec | None
) -> int:
    """The devices each worker gets when warm() is not told: where a worker has as many as
    it is given (the CPU), those of the largest mesh the programs declare; else 1."""
    if topology is not None or not platform_named(platform or default_platform()).devices_on_demand:
        return 1
    return max(map(_declared, programs), default=1)


def _declared(program: WarmProgram) -> int:
    """The devices a spec's program says it needs before it is lowered (see declared_devices)."""
    if program.lowered is not None:
        return devices_needed(program.lowered.partitioning)
    return declared_devices(program.shapes, program.in_shardings, program.out_shardings)


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
    devices_per_worker: int = 1,
    ray: str | None = None,
) -> Iterator[PoolFace]:
    """A local Pool, or a ClusterPool on the Dask scheduler at `scheduler`, or a
    RayClusterPool on the Ray cluster at `ray` (local:N starts one)."""
    # The options both take alike (a ClusterPool's apply on every node).
    options: dict[str, Any] = {
        "platform": platform,
        "cache_dir": cache_dir,
        "task_timeout": timeout,
        "initializer": initializer,
        "remote": remote,
        "topology": topology,
        "devices_per_worker": devices_per_worker,
    }
    if ray is not None:
        # Here, not at the top: pool.cluster.ray needs ray, an optional extra.
        from pool.cluster.ray.connect import connect_ray
        from pool.cluster.ray.pool import RayClusterPool

        with connect_ray(ray), RayClusterPool(workers_per_node=workers, **options) as cluster:
            yield cluster
        return
    if scheduler is None:
        with Pool(workers, **options) as pool:
            yield pool
        return
    # Here, not at the top: pool.cluster needs Dask's distributed, an optional extra.
    from pool.cluster import ClusterPool, connect

    with (
        connect(scheduler) as client,
        ClusterPool(client, workers_per_node=workers, **options) as cluster,
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
    devices_per_worker: int | None = None,
    ray: str | None = None,
    jax_cache: JaxCacheDestination | None = None,
) -> WarmReport:
    """Lowers and compiles every program of a spec into the disk cache; returns the report.

    workers compile processes (default: the CPU count; per node on a cluster), lower_workers
    extra lowering processes (0: lower in a thread of this process, overlapped with
    compiling); timeout bounds each program's compile; with fail_fast, the first failure
    stops the rest, which are reported as skipped. scheduler is a Dask scheduler address to
    compile on that cluster instead of locally ("local:N" starts a local cluster of N
    workers; see pool.cluster), ray a Ray cluster's (HOST:PORT of its head, or "local:N";
    pool.cluster.ray). In never-compile mode (PJRT_POOL_COMPILE=never) nothing is compiled:
    warming checks that every program is in the cache, and stops at the first that is not
    (as with fail_fast). remote is the URL of a remote cache tier (default:
    PJRT_POOL_CACHE_REMOTE): entries are prefetched from it before their programs compile
    (see the module docstring), and the workers publish to it; on a cluster, it is given to
    every node (ClusterPool(remote=)), whose workers fetch and publish themselves (no
    prefetch here): the report's remote counters are theirs, summed over the nodes. topology
    (a name such as "v5e:1x1", or a TopologySpec) compiles every program for that topology
    without a device (Pool(topology=...)): a machine without a TPU warms the cache, and
    makes the manifest, of a TPU host. devices_per_worker is the devices each compiling
    worker holds, as for Pool: a CPU or GPU program over several devices compiles on that
    many (a topology's programs compile without any); None: on the CPU (whose workers have
    as many devices as they are given), as many as the largest mesh the spec's programs name
    with their shardings (an AbstractMesh of 2 x 4: 8), else 1. A program over more devices
    than a worker holds is a SETUP_ERROR, whose error says what to pass. With jax_cache,
    each program is made for JAX's own persistent cache instead (pool.jax_cache): lowered as
    jax.jit does on the destination's target (whose platform and topology warming takes),
    compiled in the form JAX keeps, filed in the disk cache and remote tier under JAX's key,
    and written into the destination's directory as JAX's file. A Ctrl-C raises
    WarmInterrupted, with the report of what was warmed before it, once the workers have
    stopped.
    """
    if ray is not None and scheduler is not None:
        raise ValueError("warm compiles on one cluster: give scheduler (Dask) or ray, not both")
    cluster = scheduler if ray is None else ray  # the cluster's address, or None: here
    jax_target = None if jax_cache is None else jax_cache.target
    if jax_target is not None:  # JAX's target says where the programs run
        platform, topology = jax_target.platform, jax_target.topology
    jax_files = _jax_files(jax_cache, cache_dir, remote)
    prefetch = _Prefetch(open_remote(remote) if cluster is None else None)
    programs = spec.programs if isinstance(spec, Spec) else list(spec)
    ledger = _Ledger(programs, progress, fail_fast or never_compile_on())
    initializer = spec.initializer if isinstance(spec, Spec) else None
    started, figures, stopped = time.monotonic(), _Figures(), None
    held = devices_per_worker or _devices_declared(programs, platform, topology)  # None: meshes'
    compiling = _compiler(scheduler, workers, platform, cache_dir, timeout, initializer,
                          remote, topology, held, ray)  # fmt: skip
    try:
        with compiling as compiler, prefetch.into(compiler, cache_dir):
            try:
                compiles = _Compile(compiler, programs, timeout, ledger, jax_files)
                lowering = _Lower(programs, ledger, prefetch, compiles)
                lowering.run(lower_workers, platform, jax_target)
            finally:  # what was compiled before an interrupt counts too
                figures = _Figures.of(compiler)
    except KeyboardInterrupt as interrupt:
        ledger.interrupted_the_rest()
        stopped = interrupt
    finally:
        ledger.end_progress()
    report = _report(ledger, figures, prefetch, started, platform, cache_dir, cluster, remote,
                     interrupted=stopped is not None)  # fmt: skip
    if stopped is not None:
        raise WarmInterrupted(report) from stopped
    return report


def _jax_files(
    jax_cache: JaxCacheDestination | None,
    cache_dir: str | os.PathLike[str] | None,
    remote: str | None,
) -> JaxFiles | None:
    """Where a warm for JAX's cache writes JAX's files: its destination's directory, if any."""
    if jax_cache is None or jax_cache.directory is None:
        return None
    return JaxFiles(jax_cache.directory, cache_dir, remote)


def _report(
    ledger: _Ledger,
    figures: _Figures,
    prefetch: _Prefetch,
    started: float,
    platform: str | None,
    cache_dir: str | os.PathLike[str] | None,
    scheduler: str | None,
    remote: str | None,
    *,
    interrupted: bool,
) -> WarmReport:
    """The report stage: the ledger's reports, checked against the cache directory, and the
    pool's and the prefetch's figures."""
    if scheduler is None:  # a cluster's nodes may keep caches this process cannot see
        ledger.check_stored(cache_dir)
    remote_report = prefetch.remote_report(figures.remote_counters)
    if scheduler is not None and (remote or figures.remote_counters != RemoteCounters()):
        remote_report = figures.remote_counters  # the nodes' (their own, when not given one)
    return WarmReport(
        ledger.reports,
        figures.statistics,
        figures.cache_counters,
        time.monotonic() - started,
        platform,
        None if cache_dir is None else os.fspath(cache_dir),
        remote_report,
        prefetch.counts(),
        interrupted=interrupted,
    )
