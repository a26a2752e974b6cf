"""Benchmark ``pjrt-pool check-plugin``: this checkout against a baseline, alternated.

Usage::

    python benchmarks/bench_check_plugin.py --baseline PYTHON [--runs N] [--cases PATTERN]
        [--workers N] [--platform P]

Runs ``pjrt-pool check-plugin --json`` (the console script's code) with this interpreter
and with --baseline, an interpreter whose pjrt-pool is the one to compare
with (another checkout's virtual environment, or one whose site-packages
has a .pth naming that checkout first), alternately, --runs times each,
every run from an empty cache directory of its own (compiles included, as
a first check runs). Prints each run's wall time (the process's, JAX's
imports included) and its outcomes, then the medians and the ratio of this
checkout's to the baseline's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = "import sys; from pool.cli.main import main; sys.exit(main())"
"""The pjrt-pool console script's code (python -m pool.cli.main imports the module twice)."""


def _run(python: str, options: list[str]) -> tuple[float, collections.Counter[str], int]:
    """One check in a fresh cache: (wall seconds, outcomes, exit status)."""
    with tempfile.TemporaryDirectory(prefix="bench-check-") as cache:
        environment = {**os.environ, "PJRT_POOL_CACHE_DIR": cache}
        started = time.perf_counter()
        done = subprocess.run(
            [python, "-c", CLI, "check-plugin", "--json", *options],
            env=environment,
            cwd=tempfile.gettempdir(),  # neither checkout's tree on sys.path by accident
            capture_output=True,
            text=True,
            check=False,
        )
        seconds = time.perf_counter() - started
    if done.returncode not in (0, 1):
        sys.exit(f"{python}: exit {done.returncode}\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    return seconds, collections.Counter(case["status"] for case in report["cases"]), done.returncode


def main() -> None:
    """Runs the comparison (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, metavar="PYTHON")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--cases", default=None, metavar="PATTERN")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--platform", default=None)
    args = parser.parse_args()
    options = []
    for flag in ("cases", "workers", "platform"):
        value = getattr(args, flag)
        if value is not None:
            options += [f"--{flag}", str(value)]
    sides = {"this checkout": sys.executable, "baseline": args.baseline}
    times: dict[str, list[float]] = {side: [] for side in sides}
    print(f"check-plugin {' '.join(options) or '(the whole battery)'}; load {os.getloadavg()}")
    for run in range(args.runs):
        for side, python in sides.items():
            seconds, outcomes, code = _run(python, options)
            times[side].append(seconds)
            shown = ", ".join(f"{n} {status}" for status, n in sorted(outcomes.items()))
            print(f"run {run + 1} {side:<13} {seconds:7.1f} s  exit {code}  {shown}", flush=True)
    medians = {side: statistics.median(values) for side, values in times.items()}
    ratio = medians["this checkout"] / medians["baseline"]
    print(
        f"median: this checkout {medians['this checkout']:.1f} s, baseline "
        f"{medians['baseline']:.1f} s: {ratio:.2f}x ({Path(args.baseline)})"
    )


if __name__ == "__main__":
    main()
