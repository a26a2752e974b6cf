"""Running the battery: each case on the plugin in a Pool, and with jax.jit in this process.

::

    this process                                   Pool workers (the plugin under test)
    case: seeded inputs ──lower()──▶ program ──submit──▶ compile, run ──▶ outputs
          jax.jit(function)(inputs) ──▶ reference         crash / hang: that case only
          compare(outputs, reference, budget) ◀──────────────────────┘
    report: pass / wrong / error / crash / timeout / skipped per case

Lowering and the reference run here while the workers compile and run the
cases submitted before, so the two sides overlap; on a device one process
at a time may hold (TPU), the reference runs after the workers let it go, in
a process of its own (references.py). A case that crashes or
hangs a worker fails alone (the pool replaces the worker); a case that the
plugin cannot run for want of a capability (LAPACK kernels, a StableHLO
version) is skipped with the reason.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import tempfile
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
from pool.conformance.references import reference, reference_device, references_elsewhere
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
from worker.errors import PluginNotFoundError
from worker.identity.build import plugin_digest
from worker.plugin.conformance_records import quiet
from worker.plugin.kernels import FfiVersionError, MissingCustomCallError
from worker.plugin.known_builds import WORKAROUNDS_ENV
from worker.plugin.locate import env_var, environment_variables, find_plugin
from worker.plugin.platforms.registry import platform_named
from worker.plugin.runtime import default_platform, loaded_runtime

DEFAULT_TIMEOUT = 60.0
"""Seconds a case may take in a worker (compile and run) before it counts as a hang."""

STATUSES = ("pass", "wrong", "error", "crash", "timeout", "skipped")
"""Every outcome of a case, in the order of the report."""


class CheckError(RuntimeError):
    """The check could not run at all (no plugin, a conflicting plugin in this process)."""


class PluginStartError(CheckError):
    """The plugin under test did not start in the workers (it failed to load, or crashed)."""


@dataclass
class CaseResult:
    """The outcome of one case."""

    name: str
    """The case's name."""

    status: str
    """One of STATUSES."""

    message: str = ""
    """Why it failed or was skipped (errors, crashes, timeouts, skips)."""

    reason: str = ""
    """For a skipped case, why in a few words, the same for every case skipped so."""

    outputs: list[OutputComparison] = field(default_factory=list)
    """How each output compared (pass and wrong)."""

    seconds: float = 0.0
    """Seconds from the start of lowering to the comparison, overlapping other cases."""

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

    @property
    def failures(self) -> list[CaseResult]:
        """The cases that did not pass and were not skipped."""
        return [r for r in self.results if r.status not in ("pass", "skipped")]

    @property
    def ok(self) -> bool:
        """True when every case passed or was skipped."""
        return not self.failures


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


def _failed(case: Case, error: BaseException, started: float) -> CaseResult:
    """The result of a case whose program did not run to completion in the worker."""
    seconds = time.perf_counter() - started
    if isinstance(error, MissingCustomCallError):
        message = f"the plugin cannot run this program's kernels: {_first_line(error)}"
        reason = (
            "their kernels are built for a newer XLA FFI than the plugin's XLA takes"
            if isinstance(error, FfiVersionError)
            else "the plugin has no handler for their custom calls"
        )
        return CaseResult(case.name, "skipped", message, reason=reason, seconds=seconds)
    if isinstance(error, TaskTimeoutError):
        return CaseResult(case.name, "timeout", str(error), seconds=seconds)
    if isinstance(error, WorkerCrashedError):
        message = f"the worker {describe_exit(error.returncode)}"
        tail = [line for line in error.stderr_tail.splitlines() if line.strip()][-3:]
        if tail:
            message += "; its output ends with: " + " | ".join(tail)
        return CaseResult(case.name, "crash", message, seconds=seconds)
    if isinstance(error, ProgramQuarantinedError):
        return CaseResult(case.name, "crash", str(error), seconds=seconds)
    return CaseResult(case.name, "error", _first_line(error), seconds=seconds)


@dataclass
class _Pending:
    case: Case
    inputs: list[np.ndarray]
    future: Future[list[np.ndarray]]
    expected: list[np.ndarray] | BaseException
    started: float


def _finish(pending: _Pending) -> CaseResult:
    case = pending.case
    try:
        outputs = pending.future.result()
    except Exception as error:
        return _failed(case, error, pending.started)
    if isinstance(pending.expected, BaseException):
        message = f"jax.jit failed on this case: {_first_line(pending.expected)}"
        return CaseResult(case.name, "error", message)
    if len(outputs) != len(pending.expected):
        message = f"the plugin returned {len(outputs)} outputs, JAX {len(pending.expected)}"
        return CaseResult(case.name, "wrong", message)
    try:
        comparisons = compare_case(case, pending.inputs, outputs, pending.expected)
    except Exception as error:  # a bug in the battery's comparison must not stop the check
        return CaseResult(case.name, "error", f"comparing the outputs: {_first_line(error)}")
    status = "pass" if all(c.ok for c in comparisons) else "wrong"
    return CaseResult(
        case.name,
        status,
        outputs=comparisons,
        seconds=time.perf_counter() - pending.started,
    )


def _start(case: Case, pool: Any, platform: str, device: Any) -> _Pending | CaseResult:
    """Lowers a case, submits it to the pool and computes JAX's result meanwhile (device
    None: later, in another process; see references.py).

    Returns the case in flight, or its result when it went no further
    (a program the plugin's StableHLO cannot express is skipped).
    """

    started = time.perf_counter()
    with jax.enable_x64(case.x64):
        try:
            inputs = case.make_inputs()
            program = lower(case.function, inputs, platform=platform)
        except StableHLOVersionError as error:
            message = f"the plugin's StableHLO cannot express it: {_first_line(error)}"
            reason = "the plugin's StableHLO cannot express them"
            return CaseResult(case.name, "skipped", message, reason=reason)
        except Exception as error:  # a bug in the battery: that case fails, the check goes on
            return CaseResult(case.name, "error", f"lowering: {_first_line(error)}")
        try:
            future = pool.submit(program, inputs, name=case.name)
        except Exception as error:
            return CaseResult(case.name, "error", f"submitting: {_first_line(error)}")
        expected: list[np.ndarray] | BaseException = []
        if device is not None:
            try:
                expected = reference(case, inputs, device)
            except Exception as error:
                expected = error
    return _Pending(case, inputs, future, expected, started)


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
) -> CheckReport:
    """Runs cases on a platform's plugin (or the plugin at `plugin`) and compares them with JAX.

    workers is the Pool's size (default: the CPU count), cache_dir its disk
    cache, timeout each case's limit in a worker. on_result is called with
    each result as it is known. The programs are those lower() writes for
    the plugin, with its workarounds for known builds unless workarounds is
    False. Raises CheckError when the check cannot run, and PluginStartError
    when the plugin's workers do not start.
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
        # let it go, in a process of its own (references.py).
        apart = platform_named(platform).references_apart
        device = None if apart else reference_device(platform)
        count = (os.cpu_count() or 1) if workers is None else workers
        try:
            with quiet():  # the memo of this very check must not warn about itself
                pool = Pool(count, platform=platform, cache_dir=cache_dir, task_timeout=timeout)
        except WorkerStartupError as error:
            raise PluginStartError(f"the plugin {location.path} did not start: {error}") from error
        results: dict[str, CaseResult] = {}
        queue: collections.deque[_Pending] = collections.deque()

        def record(result: CaseResult) -> None:
            results[result.name] = result
            if on_result is not None:
                on_result(result)

        with pool:
            described = dict(pool.worker_info[0]["plugin"])
            _check_process_plugin(described)
            for case in cases:
                started_case = _start(case, pool, platform, device)
                if isinstance(started_case, CaseResult):
                    record(started_case)
                else:
                    queue.append(started_case)
                while not apart and queue and queue[0].future.done():
                    record(_finish(queue.popleft()))
            if apart:
                concurrent.futures.wait([pending.future for pending in queue])
        if apart:
            _referenced_apart(queue, platform)
        while queue:
            record(_finish(queue.popleft()))
    return CheckReport(
        platform=platform,
        plugin=described,
        plugin_sha256=_digest(described["path"], cache_dir),
        jax_version=f"jax {jax.__version__}, jaxlib {_jaxlib_version()}",
        results=[results[case.name] for case in cases],
        seconds=time.perf_counter() - started,
        workers=count,
        workarounds=applied,
        workarounds_off=off,
    )


def _referenced_apart(queue: Sequence[_Pending], platform: str) -> None:
    """Gives the cases in flight jax.jit's outputs, computed in another process once the
    pool's workers let the device go (references.py)."""
    with tempfile.TemporaryDirectory(prefix="pjrt-pool-check-") as directory:
        found = references_elsewhere(platform, [p.case.name for p in queue], Path(directory))
    for pending, expected in zip(queue, found, strict=True):
        pending.expected = RuntimeError(expected) if isinstance(expected, str) else expected


def _digest(path: str, cache_dir: str | os.PathLike[str] | None) -> str:
    cache = open_cache(cache_dir)
    return plugin_digest(path, cache.memos if cache.usable else None)


def _jaxlib_version() -> str:
    return str(getattr(jaxlib, "__version__", "unknown"))
