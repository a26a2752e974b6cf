"""The check's report: the types the plugin does not compile, each failure's details by op
family, a summary per family, and JSON."""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import json
import math
from typing import Any

from pool.conformance.compare import Element, OutputComparison
from pool.conformance.runner import CaseResult, CheckReport
from pool.conformance.status import REFERENCE_FAILURES, STATUSES, Status

COLUMNS = (*(s for s in STATUSES if s not in REFERENCE_FAILURES), "reference")
"""The text table's columns: the outcomes, jax.jit's side's failures summed as "reference"."""


def family_summary(report: CheckReport) -> dict[str, dict[str, int]]:
    """Counts of each status per op family, families in battery order."""
    summary: dict[str, collections.Counter[str]] = {}
    for result in report.results:
        summary.setdefault(result.family, collections.Counter())[result.status] += 1
    return {family: {str(s): counts[s] for s in STATUSES} for family, counts in summary.items()}


def headline(report: CheckReport) -> str:
    """The verdict in one line: how many cases pass and fail, and which were not run, why."""
    total = len(report.results)
    passed = sum(r.status == Status.PASS for r in report.results)
    failed = len(report.failures)
    unchecked = sum(r.status in REFERENCE_FAILURES for r in report.results)
    not_run = collections.Counter(
        (r.status, r.reason or "see above")
        for r in report.results
        if r.status in (Status.SKIPPED, Status.UNSUPPORTED)
    )
    inexact = len(report.inexact) if report.exact else 0
    if inexact:
        verdict = f"{inexact} case(s) NOT BIT FOR BIT (--exact)"
        verdict += f", {failed} case(s) failed" if failed else ""
        verdict += f", {passed} of {total} pass"
    elif failed:
        verdict = f"{failed} case(s) FAILED"
        if unchecked:
            verdict += f" ({unchecked} unchecked: jax.jit's side failed)"
        verdict += f", {passed} of {total} pass"
    elif not_run:
        verdict = f"{passed} of {total} cases pass, none failed"
    else:
        verdict = f"all {total} cases pass"
    for status, label in ((Status.UNSUPPORTED, "unsupported here"), (Status.SKIPPED, "skipped")):
        counts = [(why, n) for (kind, why), n in not_run.most_common() if kind == status]
        if counts:
            why = "; ".join(f"{n}: {reason}" for reason, n in counts)
            verdict += f"; {sum(n for _, n in counts)} {label} ({why})"
    return verdict


def _number(value: float) -> str:
    if math.isinf(value):
        return "inf"
    return f"{value:.3g}" if value >= 1000 or value != int(value) else str(int(value))


def _describe_element(label: str, element: Element) -> str:
    inputs = f"input {', '.join(element.inputs)} -> " if element.inputs else ""
    return f"{label} {element.index}: {inputs}plugin {element.got}, JAX {element.expected}"


def describe_output(output: OutputComparison) -> str:
    """One line on an output outside its budget."""
    if output.problem:
        return (
            f"output {output.output}: {output.problem} {output.got_type}, "
            f"JAX {output.expected_type}"
        )
    parts = [f"{output.bad} element(s) off"]
    if output.nan_mismatches:
        parts.append(f"{output.nan_mismatches} NaN on one side only")
    if output.inf_mismatches:
        parts.append(f"{output.inf_mismatches} infinities differ")
    if output.bad > output.nan_mismatches + output.inf_mismatches:
        parts.append(
            f"max error {_number(output.max_error)} ULP (budget {_number(output.budget)}), "
            f"max |difference| {output.max_abs_error:.3g}"
        )
    if output.first is not None:
        parts.append(_describe_element("first at", output.first))
    if output.worst is not None and output.worst != output.first:
        parts.append(_describe_element("worst at", output.worst))
    return f"output {output.output}: " + "; ".join(parts)


def describe_result(result: CaseResult) -> list[str]:
    """The lines the text report shows for a case that did not pass."""
    head = f"{str(result.status).upper():8} {result.name}"
    if result.unsupported_types:
        head += f" (needs {' and '.join(result.unsupported_types)}: unsupported here)"
    if result.status != "wrong" or not result.outputs:
        return [f"{head}: {result.message}"]
    return [head] + ["         " + describe_output(o) for o in result.outputs if not o.ok]


def _workaround_lines(report: CheckReport) -> list[str]:
    """What the header says about lower()'s workarounds for the build (nothing if it has none)."""
    if report.workarounds:
        names = ", ".join(report.workarounds)
        return [f"workarounds: {names}, as lower() applies them (--no-workarounds: without)"]
    if report.workarounds_off:
        names = ", ".join(report.workarounds_off)
        return [f"workarounds: off; programs as JAX writes them, without {names}"]
    return []


def _reference_line(report: CheckReport) -> str:
    """Where jax.jit's side ran, and how often its process was started."""
    where = f" on {report.reference_device}" if report.reference_device else ""
    line = f"reference: {report.jax_version}, jax.jit in a process of its own{where}"
    restarts = report.reference_processes - 1
    if restarts > 0:
        line += f" (started again {restarts} time(s), after a crash or a hang)"
    return line


def type_lines(report: CheckReport) -> list[str]:
    """What the probes found: one line, and one per type the plugin does not compile."""
    if not report.types:
        return []
    refused = report.unsupported
    if not refused:
        return [f"types: all {len(report.types)} element types the cases use compile here"]
    lines = [
        f"types: {len(report.types) - len(refused)} of the {len(report.types)} element types "
        "the cases use compile here"
    ]
    for support in refused:
        needing = sum(support.name in r.unsupported_types for r in report.results)
        said = (
            f"{needing} case(s) need it, run anyway as --cases asked"
            if report.ran_unsupported
            else f"{needing} case(s) need it, not run (--cases runs them anyway)"
        )
        lines.append(f"unsupported here: {support.name}: {said}; its probe: {support.why}")
    return lines


def exact_lines(report: CheckReport) -> list[str]:
    """Which XLA each side is, where the plugin is not jax.jit's (a line), and how many compared
    cases give jax.jit's outputs bit for bit; with --exact, every case that does not, by name
    with its largest error."""
    compared = [r for r in report.results if r.compared]
    inexact = report.inexact
    lines = [] if report.xla_note is None else [f"XLA: {report.xla_note}"]
    line = f"bit for bit: {len(compared) - len(inexact)} of {len(compared)} compared cases"
    line += " give jax.jit's outputs exactly"
    if inexact and not report.exact:
        line += f" ({len(inexact)} do not: --exact lists them and fails the check on them)"
    lines.append(line)
    if report.exact:
        lines += [
            f"  not bit for bit: {r.name} (largest error {_number(r.max_error)} "
            f"{'ULP' if r.budget else 'apart'})"
            for r in inexact
        ]
    return lines


def failure_lines(report: CheckReport) -> list[str]:
    """Every case that was run and did not pass, by op family (families in battery order), a
    header per family counting its outcomes; unsupported cases are said once, per type."""
    families: dict[str, list[CaseResult]] = {}
    for result in report.results:
        if result.status not in (Status.PASS, Status.UNSUPPORTED):
            families.setdefault(result.family, []).append(result)
    lines: list[str] = []
    for family, results in families.items():
        counts = collections.Counter(str(r.status) for r in results)
        shown = ", ".join(f"{n} {status}" for status, n in counts.most_common())
        lines.append(f"-- {family}: {shown}")
        for result in results:
            lines.extend(describe_result(result))
    return lines


def format_report(report: CheckReport) -> str:
    """The report as text: plugin, types, every case that did not pass by family, the table
    per family, the verdict."""
    plugin = report.plugin
    if plugin.get("runtime") == "jaxlib":  # jaxlib's own client: no PJRT plugin, jax.jit's XLA
        checked = f"runtime: {plugin.get('source')}, the XLA jax.jit uses ({report.platform}, "
    else:
        checked = f"plugin: {plugin.get('path')} ({report.platform}, PJRT API "
        checked += f"{plugin.get('api_version')}, "
    lines = [
        f"{checked}StableHLO {plugin.get('stablehlo_current_version')}, "
        f"sha256 {report.plugin_sha256[:12]})",
        _reference_line(report),
        *type_lines(report),
        *_workaround_lines(report),
        *exact_lines(report),
    ]
    failures = failure_lines(report)
    if failures:
        lines += ["", *failures]
    summary = family_summary(report)
    header = f"{'family':<12} {'cases':>5} " + " ".join(f"{c:>{_width(c)}}" for c in COLUMNS)
    lines += ["", header]
    totals: collections.Counter[str] = collections.Counter()
    for family, counts in summary.items():
        totals.update(counts)
        lines.append(_table_row(family, counts))
    lines.append(_table_row("total", totals))
    lines.append(
        f"\n{headline(report)}; {len(report.results)} cases in {report.seconds:.1f} s "
        f"with {report.workers} worker(s)"
    )
    return "\n".join(lines)


def _width(column: str) -> int:
    return max(7, len(column))


def _table_row(family: str, counts: collections.abc.Mapping[str, int]) -> str:
    values = {status: counts.get(status, 0) for status in STATUSES}
    values["reference"] = sum(counts.get(status, 0) for status in REFERENCE_FAILURES)
    row = " ".join(f"{values[c]:>{_width(c)}}" for c in COLUMNS)
    return f"{family:<12} {sum(counts.get(s, 0) for s in STATUSES):>5} {row}"


def _plain(value: Any) -> Any:
    """JSON-ready data: infinities and NaN as strings (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def report_json(report: CheckReport) -> str:
    """The report as JSON: plugin, summary per family and every case with its details."""
    cases = []
    for result in report.results:
        entry: dict[str, Any] = {
            "name": result.name,
            "family": result.family,
            "status": result.status,
            "budget_ulps": result.budget,
            "max_error": result.max_error,
        }
        if result.compared:
            entry["bit_identical"] = result.identical
        if result.message:
            entry["message"] = result.message
        if result.reason:
            entry["reason"] = result.reason
        if result.status == "wrong":
            entry["outputs"] = [dataclasses.asdict(o) for o in result.outputs if not o.ok]
        cases.append(entry)
    data = {
        "platform": report.platform,
        "plugin": report.plugin,
        "plugin_sha256": report.plugin_sha256,
        "reference": report.jax_version,
        "workarounds": {"applied": list(report.workarounds), "off": list(report.workarounds_off)},
        "types": {t.name: t.why or "supported" for t in report.types},
        "reference_device": report.reference_device,
        "reference_processes": report.reference_processes,
        "ok": report.ok,
        "headline": headline(report),
        "seconds": report.seconds,
        "workers": report.workers,
        "summary": family_summary(report),
        "failures": [r.name for r in report.failures],
        "exact": report.exact,
        "xla": report.xla_note,
        "not_bit_identical": [r.name for r in report.inexact],
        "cases": cases,
    }
    return json.dumps(_plain(data), indent=1)
