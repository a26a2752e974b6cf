"""Benchmark `pjrt-pool warm` against lowering and compiling serially with JAX.

Usage::

    python benchmarks/bench_warm.py [--workers N] [--lower-workers N] [--repeat N]

On the example programs (pool.examples), one run measures:

- baseline: lowering and compiling every program one after another in this
  process with JAX (``jax.jit(f).lower(*shapes).compile()``, each on a fresh
  function so that no JAX cache helps, and JAX's persistent cache off);
- pool.warm.warming with --workers compile workers, lowering in this process
  (overlapped with compiling), into a fresh cache directory;
- pool.warm.warming with --lower-workers extra lowering processes as well;
- pool.warm.warming again over the warm cache (what a second run costs).

Walls include everything a user waits for: for warm, starting the workers
(and lowering processes) and lowering. Medians over --repeat rounds, sides
alternating (benchmarks/harness.py). Cache directories are fresh temporary ones.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

_SCRATCH = tempfile.mkdtemp(prefix="bench-warm-")
os.environ["PJRT_POOL_CACHE_DIR"] = str(Path(_SCRATCH) / "default-cache")

import jax  # noqa: E402
from harness import Side, compare, report  # noqa: E402

from pool.examples import example_programs  # noqa: E402
from pool.warm.spec_file import entry_to_program  # noqa: E402
from pool.warm.warming import warm  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)


def serial_jax(examples: list[Any]) -> None:
    """Lowers and compiles every example with JAX, one after another, each a fresh function
    (so that no JAX cache helps)."""
    for _, function, shapes in examples:

        def fresh(*args: Any, _f: Any = function) -> Any:
            return _f(*args)

        jax.jit(fresh).lower(*shapes).compile()


def warming(programs: list[Any], workers: int, lower_workers: int, cache: str | None) -> Any:
    """A side's call: warm() of the programs into `cache` (None: a fresh directory each
    time, where every program compiles), timed by the harness."""

    def measure() -> None:
        directory = cache or tempfile.mkdtemp(prefix="w-", dir=_SCRATCH)
        report = warm(programs, workers=workers, lower_workers=lower_workers, cache_dir=directory)
        assert report.ok, report.summary()
        assert report.statistics.compiled == (0 if cache else len(programs)), report.statistics

    return measure


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
    warmed = tempfile.mkdtemp(prefix="warmed-", dir=_SCRATCH)
    warm(programs, workers=args.workers, cache_dir=warmed)
    sides = [
        Side("serial JAX lower+compile", lambda: serial_jax(examples)),
        Side(f"warm, {args.workers} workers, lowering overlapped",
             warming(programs, args.workers, 0, None)),
        Side(f"warm, + {args.lower_workers} lowering processes",
             warming(programs, args.workers, args.lower_workers, None)),
        Side("warm again, over a warm cache", warming(programs, args.workers, 0, warmed)),
    ]  # fmt: skip
    samples = compare(sides, args.repeat, warmup=0)
    report(samples, f"warming the {len(programs)} example programs", unit="s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
