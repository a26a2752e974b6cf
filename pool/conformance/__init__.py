"""Plugin conformance: does a PJRT plugin compute what JAX computes?

Runs in the parent process (``pjrt-pool check-plugin``, or a user's script),
which imports JAX; the plugin under test runs in the Pool's workers, and
jax.jit in a reference process of its own. A battery of a few hundred small
programs runs on the plugin under test in a Pool and with jax.jit, on the
same seeded inputs, and each result is compared under the case's error
budget. remember() records what a
check found per plugin build (worker.plugin.conformance_records), so that
processes that later load a build with failing cases warn about them. The
programs are those lower() writes, with its workarounds for builds known to
miscompile something. The list of those builds, their failures (each with a
reproduction) and the workarounds is worker.plugin.known_builds: on the
worker side rather than here because processes that never import JAX
(workers, manifest runs) warn from it. ``pjrt-pool check-plugin`` is the
command line (pool.cli.check).

    battery.py      every case, in a stable order, and selecting cases by name
    case.py         a case: one small JAX program, its seeded inputs, its error budget
    status.py       what became of a case, and which outcomes fail a check
    inputs.py       seeded inputs in each operation's domain, with special values
    elementwise.py, reductions.py, linear.py, structure.py, control.py, conversions.py
                    the cases, one module per group of op families
    budgets.py      the error budgets, one per kind of computation
    compare.py      a plugin's outputs against JAX's: exact, or within ULP budgets
    type_probe.py   the element types the plugin compiles at all: a tiny program per type
    runner.py       running the cases: lowered here, probed, in a Pool, against jax.jit
    references.py   jax.jit's answer for a case on JAX's device for the platform
    reference_side.py   jax.jit's side in a child process, restarted after a crash or hang
    reference_child.py  ``python -m pool.conformance.reference_child``: that child
    report.py       the report: types not compiled, failures by op family, a summary, JSON
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from pool.conformance.battery import battery, select
from pool.conformance.case import Budget, Case
from pool.conformance.report import format_report, report_json
from pool.conformance.runner import (
    CaseResult,
    CheckError,
    CheckReport,
    PluginStartError,
    run_cases,
)
from worker.plugin.conformance_records import write_memo


def remember(report: CheckReport, cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """Records a check's outcomes for its plugin build; returns the record's path.

    The record says how the build computes the programs lower() writes for
    it, so a check with the build's workarounds off (report.workarounds_off)
    is not recorded: what it finds without them is known already
    (worker.plugin.known_builds). Returns None then, and when the cache directory
    cannot be written (the check's report is unaffected).
    """
    if report.workarounds_off:
        return None
    with contextlib.suppress(OSError):
        return write_memo(
            cache_dir,
            plugin_sha256=report.plugin_sha256,
            platform=report.platform,
            path=str(report.plugin.get("path", "")),
            jax_version=report.jax_version,
            outcomes={r.name: r.status for r in report.results},
            known_cases=frozenset(case.name for case in battery()),
            workarounds=report.workarounds,
        )
    return None


__all__ = [
    "Budget",
    "Case",
    "CaseResult",
    "CheckError",
    "CheckReport",
    "PluginStartError",
    "battery",
    "format_report",
    "remember",
    "report_json",
    "run_cases",
    "select",
]
