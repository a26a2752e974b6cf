"""The check's report: a summary per op family, each failure's details, and JSON."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from typing import Any

from pool.conformance.compare import Element, OutputComparison
from pool.conformance.runner import STATUSES, CaseResult, CheckReport


def family_summary(report: CheckReport) -> dict[str, dict[str, int]]:
    """Counts of each status per op family, families in battery order."""
    summary: dict[str, collections.Counter[str]] = {}
    for result in report.results:
        summary.setdefault(result.family, collections.Counter())[result.status] += 1
    return {family: {s: counts[s] for s in STATUSES} for family, counts in summary.items()}


def headline(report: CheckReport) -> str:
    """The verdict in one line: how many cases pass, fail and are skipped, and why skipped."""
    total = len(report.results)
    passed = sum(r.status == "pass" for r in report.results)
    failed = len(report.failures)
    skips = collections.Counter(
        r.reason or "see above" for r in report.results if r.status == "skipped"
    )
    if failed:
        verdict = f"{failed} case(s) FAILED, {passed} of {total} pass"
    elif skips:
        verdict = f"{passed} of {total} cases pass, none failed"
    else:
        verdict = f"all {total} cases pass"
    if skips:
        why = "; ".join(f"{count}: {reason}" for reason, count in skips.most_common())
        verdict += f"; {sum(skips.values())} skipped ({why})"
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
    head = f"{result.status.upper():8} {result.name}"
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


def format_report(report: CheckReport) -> str:
    """The report as text: plugin, every case that did not pass, the table per family."""
    plugin = report.plugin
    lines = [
        f"plugin: {plugin.get('path')} ({report.platform}, PJRT API {plugin.get('api_version')}, "
        f"StableHLO {plugin.get('stablehlo_current_version')}, sha256 {report.plugin_sha256[:12]})",
        f"reference: {report.jax_version}, jax.jit in this process",
        *_workaround_lines(report),
        "",
    ]
    for result in report.results:
        if result.status != "pass":
            lines.extend(describe_result(result))
    summary = family_summary(report)
    header = f"{'family':<12} {'cases':>5} " + " ".join(f"{s:>7}" for s in STATUSES)
    lines += ["", header]
    totals: collections.Counter[str] = collections.Counter()
    for family, counts in summary.items():
        totals.update(counts)
        row = " ".join(f"{counts[s]:>7}" for s in STATUSES)
        lines.append(f"{family:<12} {sum(counts.values()):>5} {row}")
    row = " ".join(f"{totals[s]:>7}" for s in STATUSES)
    lines.append(f"{'total':<12} {sum(totals.values()):>5} {row}")
    lines.append(
        f"\n{headline(report)}; {len(report.results)} cases in {report.seconds:.1f} s "
        f"with {report.workers} worker(s)"
    )
    return "\n".join(lines)


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
        "ok": report.ok,
        "headline": headline(report),
        "seconds": report.seconds,
        "workers": report.workers,
        "summary": family_summary(report),
        "failures": [r.name for r in report.failures],
        "cases": cases,
    }
    return json.dumps(_plain(data), indent=1)
