"""Benchmark: a serving process's start, against the plainest loader of the same plugin.

Usage::

    python benchmarks/bench_start.py [--rounds N] [--program transformer|mlp_medium]

The goals of issue 33, measured in one run, fresh processes, medians of
--rounds (default 7), every kind interleaved so that the ratios hold on a
busy machine (setup, the programs and the plainest loader are those of
bench_cold_start.py):

  plain         the native module loaded by file path, the plugin, a client,
                deserialize, two executions (no pjrt-pool Python at all)
  manifest      load_manifest(manifest).run(name, inputs), twice, with the cache
  bundle        the same from the bundle, the cache directory present
  bundle-ro     the same on a host with no cache directory (HOME empty)
  primed        load_manifest(bundle, prime=True) on that host, then two runs
  cli           ``pjrt-pool run BUNDLE NAME`` on that host (one run, printed)

and prints, with their goals: each loader's wall time against plain (1.05x;
1.10x with no cache directory; also the fastest of each kind against the
fastest plain, which a busy machine disturbs less, and each one's CPU time, user and
system, against plain's, which it disturbs least), the first request after priming against
the warm run (1.2x), and what priming costs (at load) and saves (on the
first request).
"""

from __future__ import annotations

import argparse
import compileall
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_cold_start import PLAIN, RUN, _setup

Timing = tuple[float, float, list[float]]
"""A child's wall time, its CPU time (user and system, its threads' included) and figures."""


def _timed(command: list[str], env: dict[str, str], report: bool) -> Timing:
    """A child's wall time from spawn to exit, its CPU time, and (report) the figures it
    printed. The CPU time is what a busy machine disturbs least: another process's load
    stretches a child's wall time, much less the work it does."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)  # children run one at a time
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if done.returncode != 0:
        raise SystemExit(f"child failed ({command[:3]}...):\n{done.stderr[-3000:]}")
    return wall, cpu, [float(value) for value in done.stdout.split()] if report else []


PRIMED = RUN.replace("load_manifest(sys.argv[1])", "load_manifest(sys.argv[1], prime=True)")
CLI = "import sys; from pool.cli.main import main; sys.exit(main())"


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--program", default="transformer")
    args = parser.parse_args(argv)
    import os

    import pool
    import worker

    trees = [Path(package.__file__).parent for package in (pool, worker)]
    for tree in trees:
        compileall.compile_dir(str(tree), quiet=1)
    root = Path(tempfile.mkdtemp(prefix="pjrt-pool-start-"))
    try:
        made = _setup(root, args.program)
        home = root / "home"
        home.mkdir()
        unset = ("PJRT_POOL_CACHE_DIR", "PYTHONDONTWRITEBYTECODE", "XDG_CACHE_HOME")
        base = {k: v for k, v in os.environ.items() if k not in unset}
        with_cache = {**base, "PJRT_POOL_CACHE_DIR": str(made["cache"])}
        no_cache = {**base, "HOME": str(home)}
        plain_env = {**base, "XLA_FLAGS": "--xla_cpu_enable_fast_min_max=false"}
        python, name = sys.executable, args.program
        manifest, bundle = str(made["manifest"]), str(made["bundle"])
        kinds = {
            "plain": ([python, "-c", PLAIN, *made["plain"]], plain_env),
            "manifest": ([python, "-c", RUN, manifest, name], with_cache),
            "bundle": ([python, "-c", RUN, bundle, name], with_cache),
            "bundle-ro": ([python, "-c", RUN, bundle, name], no_cache),
            "primed": ([python, "-c", PRIMED, bundle, name], no_cache),
            "cli": ([python, "-c", CLI, "run", bundle, name], no_cache),
        }
        results: dict[str, list[Timing]] = {kind: [] for kind in kinds}
        for kind, (command, env) in kinds.items():  # page the plugin in, fill the OS's caches
            _timed(command, env, kind != "cli")
        for _ in range(args.rounds):
            for kind, (command, env) in kinds.items():
                results[kind].append(_timed(command, env, kind != "cli"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(results, args.program, args.rounds)
    return 0


def report(results: dict[str, list[Timing]], program: str, rounds: int) -> None:
    """Prints the medians and the ratios against their goals."""

    def median(kind: str, field: int | None = None) -> float:
        values = [wall if field is None else fields[field] for wall, _, fields in results[kind]]
        return statistics.median(values)

    def cpu(kind: str) -> float:
        return statistics.median(used for _, used, _ in results[kind])

    plain = median("plain")
    print(
        f"start of a serving process ({program}), {rounds} fresh processes per kind, medians, "
        f"python {sys.version.split()[0]}"
    )
    least_plain = min(wall for wall, _, _ in results["plain"])
    print(
        "  kind               wall ms  x plain  goal   x plain of the fastest  cpu ms  x plain  "
        "(inside: imports, load, first run, warm run ms)"
    )
    goals = {"manifest": 1.05, "bundle": 1.05, "bundle-ro": 1.10}
    for kind in results:
        wall = median(kind)
        goal = f"{goals[kind]:.2f}x" if kind in goals else "     "
        inside = (
            " ".join(f"{median(kind, field) * 1e3:6.1f}" for field in range(4))
            if results[kind][0][2]
            else ""
        )
        least = min(wall for wall, _, _ in results[kind]) / least_plain
        print(
            f"  {kind:10} {wall * 1e3:8.1f}  {wall / plain:6.3f}x  {goal}  {least:6.3f}x  "
            f"{cpu(kind) * 1e3:8.1f}  {cpu(kind) / cpu('plain'):6.3f}x  {inside}"
        )
    warm = median("bundle-ro", 3)
    first_primed = median("primed", 2)
    print(
        f"  first request after priming {first_primed * 1e3:.1f} ms = "
        f"{first_primed / median('primed', 3):.2f}x the primed process's warm run "
        f"(goal 1.2x); unprimed first run {median('bundle-ro', 2) * 1e3:.1f} ms = "
        f"{median('bundle-ro', 2) / warm:.2f}x its warm run"
    )
    print(
        f"  priming costs {(median('primed', 1) - median('bundle-ro', 1)) * 1e3:+.1f} ms at load "
        f"and saves {(median('bundle-ro', 2) - first_primed) * 1e3:.1f} ms on the first request"
    )
    print(
        f"  plain's own first run {median('plain', 2) * 1e3:.1f} ms, warm "
        f"{median('plain', 3) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    sys.exit(main())
