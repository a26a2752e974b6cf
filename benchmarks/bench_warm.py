"""Benchmark `pjrt-pool warm` against lowering and compiling serially with JAX.

Usage::

    python benchmarks/bench_warm.py [--workers N] [--lower-workers N] [--repeat N]

On the example programs (examples), one run measures:

- baseline: lowering and compiling every program one after another in this
  process with JAX (``jax.jit(f).lower(*shapes).compile()``, each on a fresh
  function so that no JAX cache helps, and JAX's persistent cache off);
- pool.warm.warming with --workers compile workers, lowering in this process
  (overlapped with compiling), into a fresh cache directory;
- pool.warm.warming with --lower-workers extra lowering processes as well;
- pool.warm.warming again over the warm cache (what a second run costs).

Walls include everything a user waits for: for warm, starting the workers
(and lowering processes) and lowering. Medians over --repeat rounds, sides
alternating. Cache directories are fresh temporary ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_SCRATCH = tempfile.mkdtemp(prefix="bench-warm-")
os.environ["PJRT_POOL_CACHE_DIR"] = str(Path(_SCRATCH) / "default-cache")

import jax  # noqa: E402

from pool.examples import example_programs  # noqa: E402
from pool.warm.spec_file import entry_to_program  # noqa: E402
from pool.warm.warming import warm  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)


def serial_jax(examples: list[Any]) -> float:
    start = time.perf_counter()
    for _, function, shapes in examples:

        def fresh(*args: Any, _f: Any = function) -> Any:
            return _f(*args)

        jax.jit(fresh).lower(*shapes).compile()
    return time.perf_counter() - start


def warm_once(programs: list[Any], workers: int, lower_workers: int, cache_dir: str) -> Any:
    start = time.perf_counter()
    report = warm(programs, workers=workers, lower_workers=lower_workers, cache_dir=cache_dir)
    wall = time.perf_counter() - start
    assert report.ok, report.summary()
    return wall, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--lower-workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    examples = example_programs()
    programs = [entry_to_program(i, e) for i, e in enumerate(examples)]
    print(
        f"warming {len(programs)} programs: {args.workers} workers, "
        f"{args.lower_workers} lowering processes, {os.cpu_count()} CPUs",
        flush=True,
    )
    serial_jax(examples[:2])  # JAX's backend and LAPACK kernels, untimed

    baseline, plain, parallel, rewarm = [], [], [], []
    for rep in range(args.repeat):
        order = ["jax", "warm", "warm+lower"]
        if rep % 2:
            order.reverse()
        for side in order:
            if side == "jax":
                baseline.append(serial_jax(examples))
            elif side == "warm":
                cache = tempfile.mkdtemp(prefix="w-", dir=_SCRATCH)
                wall, report = warm_once(programs, args.workers, 0, cache)
                assert report.statistics.compiled == len(programs)
                plain.append(wall)
                wall, report = warm_once(programs, args.workers, 0, cache)
                assert report.statistics.compiled == 0
                rewarm.append(wall)
            else:
                cache = tempfile.mkdtemp(prefix="l-", dir=_SCRATCH)
                wall, report = warm_once(programs, args.workers, args.lower_workers, cache)
                assert report.statistics.compiled == len(programs)
                parallel.append(wall)
        print(f"  round {rep + 1}/{args.repeat} done", flush=True)

    base = statistics.median(baseline)
    rows = [
        ("serial JAX lower+compile (baseline)", base),
        (f"warm, {args.workers} workers, lowering overlapped", statistics.median(plain)),
        (f"warm, + {args.lower_workers} lowering processes", statistics.median(parallel)),
        ("warm again over the warm cache", statistics.median(rewarm)),
    ]
    print(f"\n{'':<44} {'wall s':>8} {'x baseline':>11}")
    for label, value in rows:
        print(f"{label:<44} {value:8.2f} {value / base:11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
