"""Running the battery: each case on the plugin in a Pool, and with jax.jit in a process of its own.

::

    this process                                Pool workers (the plugin under test)
    case ─lower()─▶ program ─types─▶ probed? ──submit──▶ compile, run ──▶ outputs
                                     (type_probe)       crash / hang: that case only
         ─▶ reference process (reference_side.py): jax.jit(function)(inputs) ─▶ reference
                                     crash / hang: that case only, the process restarted
    compare(outputs, reference, budget) ─▶ a Status per case (status.py)

Lowering runs here while the workers compile and run the cases submitted
before and the reference process computes jax.jit's answers, so the three
overlap. On a device one process at a time may hold (TPU), jax.jit's side
runs after the workers let the device go. A case whose program needs an
element type the plugin does not compile at all is not run (unless asked:
run_unsupported); one that the plugin cannot run for want of a capability
(LAPACK kernels, a StableHLO version) is skipped with the reason; a case the
plugin failed needs no reference.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np

from pool.conformance.case import Case
from pool.conformance.compare import OutputComparison, compare_case
from pool.conformance.reference_side import JaxSideError, ReferenceSide
from pool.conformance.status import NOT_RUN, STATUSES, Status
from pool.conformance.type_probe import TypeProbe, TypeSupport, element_types
from pool.errors import (
    ProgramQuarantinedError,
    TaskTimeoutError,
    WorkerCrashedError,
    WorkerStartupError,
    describe_exit,
)
from pool.face import Pool
from pool.lowering.lower import lower
from pool.lowering.plugin_info import PluginProbeError, plugin_info
from pool.lowering.stablehlo import StableHLOVersionError
from pool.lowering.workarounds import active_workarounds, build_workarounds
from worker.cache import open_cache
from worker.errors import DeviceUnavailableError, PjrtPoolError, PluginNotFoundError
from worker.identity.build import plugin_digest
from worker.plugin.conformance_records import quiet
from worker.plugin.kernels import FfiVersionError, MissingCustomCallError
from worker.plugin.known_builds import WORKAROUNDS_ENV
from worker.plugin.locate import (
    PluginLocation,
    env_var,
    environment_variables,
    find_plugin,
    jit_xla_note,
)
from worker.plugin.platforms.registry import platform_named
from worker.plugin.runtime import default_platform, loaded_runtime

DEFAULT_TIMEOUT = 60.0
"""Seconds a case may take in a worker (compile and run) before it counts as a hang."""

DEFAULT_TIMEOUT = 60.0
"""Seconds a case may take in a worker (compile and run), and jax.jit on it, before it counts
as a hang."""

REFERENCE_MIN_TIMEOUT = 10.0
"""The least jax.jit's side gets per case: a timeout set low to find the plugin's hangs fast
must not fail the yardstick's ordinary compiles."""

__all__ = ["STATUSES"]  # re-exported: the report's order of outcomes (status.py)


class CheckError(PjrtPoolError, RuntimeError):
    """The check could not run at all (no plugin, a conflicting plugin in this process)."""


class PluginStartError(CheckError):
    """The plugin under test did not start in the workers (it failed to load, or crashed)."""


@dataclass
class CaseResult:
    """The outcome of one case."""

    name: str
    """The case's name."""

    status: Status
    """What became of it (a str: "pass", "wrong", ...)."""

    message: str = ""
    """Why it failed, was skipped or not run (errors, crashes, timeouts, skips)."""

    reason: str = ""
    """For a skipped or unsupported case, why in a few words, the same for every case so."""

    outputs: list[OutputComparison] = field(default_factory=list)
    """How each output compared (pass and wrong)."""

    seconds: float = 0.0
    """Seconds from the start of lowering to the comparison, overlapping other cases."""

    unsupported_types: tuple[str, ...] = ()
    """The element types it needs that the plugin does not compile (type_probe.py)."""

    @property
    def family(self) -> str:
        """The op family: the first part of the name."""
        return self.name.split("/", 1)[0]

    @property
    def budget(self) -> float:
        """The largest budget its outputs were held to, in ULPs."""
        return max((o.budget for o in self.outputs), default=0.0)

    @property
    def max_error(self) -> float:
        """The largest error over the outputs (ULPs, or absolute for integers)."""
        return max((o.max_error for o in self.outputs), default=0.0)

    @property
    def compared(self) -> bool:
        """Whether its outputs were compared with jax.jit's (it passed or was wrong)."""
        return self.status in (Status.PASS, Status.WRONG) and bool(self.outputs)

    @property
    def identical(self) -> bool:
        """Whether its outputs were compared and are jax.jit's bit for bit."""
        return self.compared and all(o.identical for o in self.outputs)


@dataclass
class CheckReport:
    """Everything one check found."""

    platform: str
    """The platform checked."""

    plugin: dict[str, Any]
    """The plugin as the workers describe it (path, API version, StableHLO window)."""

    plugin_sha256: str
    """The plugin build's SHA-256 (results are memoized by it)."""

    jax_version: str
    """The JAX (and jaxlib) that computed the reference results."""

    results: list[CaseResult]
    """One result per case, in battery order."""

    seconds: float
    """Wall time of the whole check."""

    workers: int
    """Worker processes used."""

    workarounds: tuple[str, ...] = ()
    """The workarounds lower() applied to the programs for this plugin build."""

    workarounds_off: tuple[str, ...] = ()
    """The workarounds for this build that were off (--no-workarounds): the raw plugin."""

    types: list[TypeSupport] = field(default_factory=list)
    """Every element type the cases needed, probed: whether the plugin compiles it."""

    ran_unsupported: bool = False
    """Whether cases of unsupported types were run anyway (run_unsupported)."""

    reference_device: str = ""
    """The JAX device jax.jit's side ran on ("" when it never started)."""

    reference_processes: int = 0
    """Reference processes started: one, and one more after each crash or hang."""

    exact: bool = False
    """Whether a compared case that is not jax.jit's bit for bit fails the check (--exact)."""

    xla_note: str | None = None
    """Where the plugin is another build of XLA than the one jax.jit uses here: which each
    side is (worker.plugin.locate.jit_xla_note); None where it is jax.jit's."""

    @property
    def inexact(self) -> list[CaseResult]:
        """The compared cases whose outputs are not jax.jit's bit for bit (within their
        budgets or not)."""
        return [r for r in self.results if r.compared and not r.identical]

    @property
    def failures(self) -> list[CaseResult]:
        """The cases that did not pass and were run: the plugin's failures and the cases
        whose reference failed (unsupported and skipped ones do not fail a check)."""
        return [r for r in self.results if r.status != Status.PASS and r.status not in NOT_RUN]

    @property
    def ok(self) -> bool:
        """True when every case passed, was skipped or was not supported here, and with exact
        every compared case is jax.jit's bit for bit."""
        return not self.failures and not (self.exact and self.inexact)

    @property
    def unsupported(self) -> list[TypeSupport]:
        """The element types the plugin does not compile."""
        return [t for t in self.types if not t.supported]


@contextlib.contextmanager
def workarounds_switched(enabled: bool) -> Iterator[None]:
    """Turns lower()'s workarounds off (PJRT_POOL_WORKAROUNDS=off) for the block, or leaves them.

    With them on, the check runs the programs as lower() writes them for the
    plugin, workarounds for known builds included; off, as JAX writes them,
    which shows the plugin's own bugs.
    """
    if enabled:
        yield
        return
    with environment_variables({WORKAROUNDS_ENV: "off"}):
        yield


@contextlib.contextmanager
def plugin_selected(platform: str, plugin: str | os.PathLike[str] | None) -> Iterator[None]:
    """Points PJRT_POOL_PLUGIN_<PLATFORM> at `plugin` in this process for the block.

    Pool workers inherit this process's environment when they start (also
    the replacements of crashed ones, hence the whole block), and lower()
    asks the same plugin for its StableHLO window.
    """
    if plugin is None:
        yield
        return
    path = Path(plugin).expanduser()
    if not path.is_file():
        raise CheckError(f"--plugin {plugin}: no such file; give the path of a PJRT plugin library")
    with environment_variables({env_var(platform): str(path.resolve())}):
        yield


def _check_process_plugin(described: dict[str, Any]) -> None:
    """Refuses to go on when lower() would serialize for another plugin's StableHLO window.

    lower() asks this process's plugin, when one is loaded, which StableHLO
    versions to write; that must be what the plugin under test reads.
    """
    runtime = loaded_runtime()
    if runtime is None or runtime.platform != described["platform"]:
        return
    window = ("stablehlo_minimum_version", "stablehlo_current_version")
    here = runtime.describe()
    if any(here[key] != described[key] for key in window):
        raise CheckError(
            f"this process has the {runtime.platform} plugin {runtime.location.path} loaded, "
            f"so lower() would write StableHLO for it rather than for {described['path']}; "
            "check that plugin from a fresh process (the pjrt-pool check-plugin command)"
        )


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return f"{type(error).__name__}: {text.splitlines()[0][:500]}"


def describe_failure(error: BaseException) -> tuple[Status, str, str]:
    """What a program's failure in a worker means: (status, message, reason for a skip)."""
    if isinstance(error, MissingCustomCallError):
        message = f"the plugin cannot run this program's kernels: {_first_line(error)}"
        reason = (
            "their kernels are built for a newer XLA FFI than the plugin's XLA takes"
            if isinstance(error, FfiVersionError)
            else "the plugin has no handler for their custom calls"
        )
        return Status.SKIPPED, message, reason
    if isinstance(error, StableHLOVersionError):
        message = f"the plugin's StableHLO cannot express it: {_first_line(error)}"
        return Status.SKIPPED, message, "the plugin's StableHLO cannot express them"
    if isinstance(error, TaskTimeoutError):
        return Status.TIMEOUT, str(error), ""
    if isinstance(error, WorkerCrashedError):
        message = f"the worker {describe_exit(error.returncode)}"
        tail = [line for line in error.stderr_tail.splitlines() if line.strip()][-3:]
        if tail:
            message += "; its output ends with: " + " | ".join(tail)
        return Status.CRASH, message, ""
    if isinstance(error, ProgramQuarantinedError):
        return Status.CRASH, str(error), ""
    return Status.ERROR, _first_line(error), ""


def _failed(case: Case, error: BaseException, started: float) -> CaseResult:
    """The result of a case whose program did not run to completion in the worker."""
    status, message, reason = describe_failure(error)
    return CaseResult(case.name, status, message, reason, seconds=time.perf_counter() - started)


def _probe_failure(error: BaseException) -> str:
    """How a type's probe failed, in words (type_probe.py)."""
    return describe_failure(error)[1]


@dataclass
class _Lowered:
    """A case lowered for the plugin, waiting for its element types' probes."""

    case: Case
    inputs: list[np.ndarray]
    program: Any
    types: frozenset[np.dtype]
    started: float


@dataclass
class _Pending:
    """A case on its way through the plugin and jax.jit."""

    case: Case
    inputs: list[np.ndarray]
    future: Future[list[np.ndarray]]
    started: float
    refused: tuple[str, ...]
    """The unsupported types it needs (run anyway: run_unsupported)."""
    reference: Future[list[np.ndarray]] | None = None

    def plugin_failed(self) -> bool:
        """Whether the plugin's side is done and failed (then no reference is needed)."""
        return self.future.done() and (self.future.cancelled() or bool(self.future.exception()))

    def finished(self) -> bool:
        """Whether its result can be known now."""
        if not self.future.done():
            return False
        return self.plugin_failed() or (self.reference is not None and self.reference.done())


def _finish(pending: _Pending) -> CaseResult:
    case = pending.case
    try:
        outputs = pending.future.result()
    except Exception as error:
        if pending.reference is not None:
            pending.reference.cancel()  # not needed: there is nothing to compare
        return _failed(case, error, pending.started)
    assert pending.reference is not None
    try:
        expected = pending.reference.result()
    except JaxSideError as failure:
        return CaseResult(case.name, failure.status, failure.message)
    except concurrent.futures.CancelledError:
        return CaseResult(case.name, Status.REFERENCE_ERROR, "jax.jit's side was not computed")
    if len(outputs) != len(expected):
        message = f"the plugin returned {len(outputs)} outputs, JAX {len(expected)}"
        return CaseResult(case.name, Status.WRONG, message)
    try:
        comparisons = compare_case(case, pending.inputs, outputs, expected)
    except Exception as error:  # a bug in the battery's comparison must not stop the check
        return CaseResult(case.name, Status.ERROR, f"comparing the outputs: {_first_line(error)}")
    status = Status.PASS if all(c.ok for c in comparisons) else Status.WRONG
    return CaseResult(
        case.name,
        status,
        outputs=comparisons,
        seconds=time.perf_counter() - pending.started,
    )


def _lower(case: Case, platform: str) -> _Lowered | CaseResult:
    """Lowers a case for the plugin; its result instead when it goes no further (a program
    the plugin's StableHLO cannot express is skipped; a bug in the battery is an error)."""
    started = time.perf_counter()
    with jax.enable_x64(case.x64):
        try:
            inputs = case.make_inputs()
            program = lower(case.function, inputs, platform=platform)
        except StableHLOVersionError as error:
            return _failed(case, error, started)
        except Exception as error:  # a bug in the battery: that case fails, the check goes on
            return CaseResult(case.name, Status.ERROR, f"lowering: {_first_line(error)}")
    return _Lowered(case, inputs, program, element_types(program.text), started)


def _unsupported(lowered: _Lowered, refused: tuple[str, ...]) -> CaseResult:
    names = " and ".join(refused)
    message = f"needs {names}, which the plugin does not compile here (see the types above)"
    return CaseResult(
        lowered.case.name, Status.UNSUPPORTED, message, f"needs {names}", unsupported_types=refused
    )


class _Run:
    """One check's cases in flight: lowered and waiting for their types' probes, then on the
    plugin's side and on jax.jit's, until each has its result."""

    def __init__(
        self,
        pool: Any,
        references: ReferenceSide,
        probe: TypeProbe,
        platform: str,
        run_unsupported: bool,
        on_result: Callable[[CaseResult], None] | None,
    ) -> None:
        self.pool = pool
        self.references = references
        self.probe = probe
        self.platform = platform
        self.run_unsupported = run_unsupported
        self.on_result = on_result
        self.results: dict[str, CaseResult] = {}
        self.held: collections.deque[_Lowered] = collections.deque()
        self.flight: collections.deque[_Pending] = collections.deque()
        self.referenced = False
        """Whether cases get their reference as they are submitted (else reference_all)."""

    def record(self, result: CaseResult) -> None:
        self.results[result.name] = result
        if self.on_result is not None:
            self.on_result(result)

    def add(self, case: Case) -> None:
        """Lowers a case, asks for its types' probes and submits what can be submitted."""
        lowered = _lower(case, self.platform)
        if isinstance(lowered, CaseResult):
            self.record(lowered)
        else:
            self.probe.ask(lowered.types)
            self.held.append(lowered)
        self.release()
        self.collect()

    def release(self) -> None:
        """Submits the held cases whose types are probed, in order (or records them as
        unsupported)."""
        while self.held:
            refused = self.probe.verdict(self.held[0].types)
            if refused is None:
                return
            lowered = self.held.popleft()
            names = tuple(support.name for support in refused)
            if names and not self.run_unsupported:
                self.record(_unsupported(lowered, names))
            else:
                self._submit(lowered, names)

    def release_all(self) -> None:
        """Waits for the probes still compiling and submits the cases held for them."""
        while self.held:
            concurrent.futures.wait(self.probe.pending(), return_when="FIRST_COMPLETED")
            self.release()

    def _submit(self, lowered: _Lowered, refused: tuple[str, ...]) -> None:
        case = lowered.case
        try:
            future = self.pool.submit(lowered.program, lowered.inputs, name=case.name)
        except Exception as error:
            self.record(CaseResult(case.name, Status.ERROR, f"submitting: {_first_line(error)}"))
            return
        pending = _Pending(case, lowered.inputs, future, lowered.started, refused)
        if self.referenced:
            pending.reference = self.references.submit(case, lambda: not pending.plugin_failed())
        self.flight.append(pending)

    def reference_all(self) -> None:
        """Gives every case in flight its reference (for an exclusive device: after the
        plugin's side), but those the plugin failed."""
        for pending in self.flight:
            if pending.reference is None and not pending.plugin_failed():
                pending.reference = self.references.submit(pending.case)

    def collect(self) -> None:
        """Records the cases at the head of the flight whose results are known."""
        while self.flight and self.flight[0].finished():
            self._finished(self.flight.popleft())

    def finish_all(self) -> None:
        """Waits for every case in flight and records it."""
        while self.flight:
            pending = self.flight.popleft()
            concurrent.futures.wait([pending.future])
            if pending.reference is not None and not pending.plugin_failed():
                concurrent.futures.wait([pending.reference])
            self._finished(pending)

    def _finished(self, pending: _Pending) -> None:
        result = _finish(pending)
        result.unsupported_types = pending.refused
        self.record(result)


def _workarounds(platform: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The workarounds lower() applies for the platform's plugin build, and those of the
    build that are switched off (PJRT_POOL_WORKAROUNDS); CheckError for a bad setting."""
    try:
        info = plugin_info(platform)  # what lower() asks: the workarounds it applies follow
    except PluginProbeError:
        info = None  # the workers will say why the plugin does not start
    try:
        applied = tuple(w.name for w in active_workarounds(info))
    except ValueError as error:  # a PJRT_POOL_WORKAROUNDS that is neither on nor off
        raise CheckError(str(error)) from None
    return applied, tuple(w.name for w in build_workarounds(info) if w.name not in applied)


def reference_threads(apart: bool) -> int:
    """Cases jax.jit's process compiles at once: one beside the pool's workers, which have
    the cores; apart from them (an exclusive device, after the pool), half the cores."""
    return max(1, min(8, (os.cpu_count() or 1) // 2)) if apart else 1


def run_cases(
    cases: Sequence[Case],
    *,
    platform: str | None = None,
    plugin: str | os.PathLike[str] | None = None,
    workers: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    on_result: Callable[[CaseResult], None] | None = None,
    workarounds: bool = True,
    run_unsupported: bool = False,
    exact: bool = False,
) -> CheckReport:
    """Runs cases on a platform's plugin (or the plugin at `plugin`) and compares them with JAX.

    workers is the Pool's size (default: the CPU count), cache_dir its disk
    cache, timeout each case's limit in a worker and in jax.jit's process
    (there at least REFERENCE_MIN_TIMEOUT).
    on_result is called with each result as it is known. The programs are
    those lower() writes for the plugin, with its workarounds for known
    builds unless workarounds is False. Each element type the cases use is
    probed first (type_probe.py); cases that need a type the plugin does not
    compile are reported unsupported, or run anyway with run_unsupported.
    Every compared case says whether its outputs are jax.jit's bit for bit;
    with exact, one that is not fails the check (CheckReport.ok).
    Raises CheckError when the check cannot run, and PluginStartError when
    the plugin's workers do not start.
    """

    platform = platform or default_platform()
    started = time.perf_counter()
    with plugin_selected(platform, plugin), workarounds_switched(workarounds):
        try:
            location = find_plugin(platform)
        except PluginNotFoundError as error:
            raise CheckError(str(error)) from None
        applied, off = _workarounds(platform)
        # On a device one process at a time may hold, JAX's side runs after the workers
        # let it go.
        apart = platform_named(platform).references_apart
        count = (os.cpu_count() or 1) if workers is None else workers
        pool = _started_pool(platform, location, count, cache_dir, timeout)
        limit = max(timeout, REFERENCE_MIN_TIMEOUT)
        with ReferenceSide(platform, limit, reference_threads(apart)) as references:
            probe = TypeProbe(pool, platform, timeout, _probe_failure)
            run = _Run(pool, references, probe, platform, run_unsupported, on_result)
            with pool:
                described = dict(pool.worker_info[0]["plugin"])
                _check_process_plugin(described)
                if not apart:
                    run.referenced = True
                    references.start()
                for case in cases:
                    run.add(case)
                run.release_all()
                if apart:
                    concurrent.futures.wait([pending.future for pending in run.flight])
                    run.collect()
            if apart:
                run.reference_all()
                references.start()
            run.finish_all()
            types = probe.outcomes()
    return CheckReport(
        platform=platform,
        plugin=described,
        plugin_sha256=_digest(described["path"], cache_dir),
        jax_version=f"jax {jax.__version__}, jaxlib {_jaxlib_version()}",
        results=_ordered(run.results, cases),
        seconds=time.perf_counter() - started,
        workers=count,
        workarounds=applied,
        workarounds_off=off,
        types=types,
        ran_unsupported=run_unsupported,
        reference_device=references.device,
        reference_processes=references.processes_started,
        exact=exact,
        xla_note=jit_xla_note(location),
    )


def _started_pool(
    platform: str,
    location: PluginLocation,
    count: int,
    cache_dir: str | os.PathLike[str] | None,
    timeout: float,
) -> Pool:
    """The Pool of `count` workers the plugin's side runs in; PluginStartError where its
    workers do not start, CheckError where the platform has no device here."""
    try:
        with quiet():  # the memo of this very check must not warn about itself
            return Pool(count, platform=platform, cache_dir=cache_dir, task_timeout=timeout)
    except WorkerStartupError as error:
        raise PluginStartError(f"the plugin {location.path} did not start: {error}") from error
    except DeviceUnavailableError:  # the pool found none to plan a device worker for
        raise CheckError(
            f"no {platform} device is attached to this machine, and check-plugin runs every "
            f"case on one (the plugin's side, then jax.jit's): run it on a {platform} host"
        ) from None


def _ordered(results: dict[str, CaseResult], cases: Sequence[Case]) -> list[CaseResult]:
    return [results[case.name] for case in cases]


def _digest(path: str, cache_dir: str | os.PathLike[str] | None) -> str:
    cache = open_cache(cache_dir)
    return plugin_digest(path, cache.memos if cache.usable else None)


def _jaxlib_version() -> str:
    return str(getattr(jaxlib, "__version__", "unknown"))
