"""Benchmark: the cpu platform on jaxlib's own CPU client against the CPU PJRT plugin.

Usage::

    python benchmarks/bench_jaxlib_cpu.py [--rounds N] [--calls N] [--steps N] [--only NAME,...]

The ``cpu`` platform runs on the installed jaxlib's own client (jax.jit's XLA,
served from Python in the worker); ``pjrt_cpu`` on lammps-jax-pjrt-cpu
through the native module and its hot loop, the baseline. Each measure takes
both sides in turn, round by round (benchmarks/harness.py), and prints their
medians and the ratio jaxlib / plugin (below 1: jaxlib's client is faster):

  start       Pool(1) of each, from its constructor to its worker's Ready, and closed
  round trip  Pool.run of x + 1 on float32[4] (the hot path: a HotRun), per call
  in-process  Executable.run of the same program in a child process (which holds
              one runtime), per call
  zoo         compile_many of the example programs (pool.examples) into an empty
              cache, with one worker per CPU
  model       a GPT-2 train step (pool.examples.models: transformers, AdamW; 2 layers,
              width 128) through Pool.function with its state kept in the worker
              (keep=), per step; and jax.jit's step in this process, for scale

Needs the cpu extra (the plugin), flax, optax and transformers<5 (the test extra).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PJRT_POOL_CACHE_DIR", tempfile.mkdtemp(prefix="bench-jaxlib-cpu-"))

import jax
import numpy as np
from harness import Side, compare, median_per_call, report

from pool import Pool, lower

SIDES = {"pjrt_cpu (plugin)": "pjrt_cpu", "cpu (jaxlib)": "cpu"}
"""Each side's name and the platform it runs on; the plugin's is the baseline."""

MEASURES = ("start", "round trip", "in-process", "zoo", "model")


def tiny(platform: str) -> tuple[Any, np.ndarray]:
    x = np.zeros(4, np.float32)
    return lower(lambda x: x + 1, [x], platform=platform), x


def start(platform: str) -> None:
    with Pool(1, platform=platform):
        pass


def round_trip(platform: str, calls: int) -> float:
    program, x = tiny(platform)
    with Pool(1, platform=platform) as pool:
        for _ in range(calls // 10):
            pool.run(program, [x])
        return median_per_call(lambda: pool.run(program, [x]), calls)


def in_process(platform: str, calls: int) -> float:
    """In a child: a process holds one runtime, and this one holds jax.jit's."""
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from bench_jaxlib_cpu import tiny
from harness import median_per_call
from pool import compile_program
program, x = tiny({platform!r})
executable, _ = compile_program(program)
for _ in range({calls} // 10):
    executable.run([x])
print(median_per_call(lambda: executable.run([x]), {calls}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def zoo(platform: str) -> float:
    from pool.examples import example_programs

    programs = [
        (name, lower(function, shapes, platform=platform))
        for name, function, shapes in example_programs()
    ]
    with (
        tempfile.TemporaryDirectory(prefix="zoo-") as cache,
        Pool(platform=platform, cache_dir=cache) as pool,
    ):
        began = time.perf_counter()
        pool.compile_many(programs)
        return time.perf_counter() - began


def _model() -> Any:
    from pool.examples.models import gpt2

    return gpt2(layers=2, width=128, vocab=1000, seq=32, batch=4)


def _steps(run: Callable[..., Any], step: Any, steps: int) -> float:
    """The median seconds of a step of `run`, fed its own state, after a first step."""
    state = run(*step.arguments)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        state = run(*step.feed(state))
        np.asarray(state[-1])  # the loss is here: the step has run
        times.append(time.perf_counter() - began)
    return float(np.median(times))


def model(platform: str, steps: int) -> float:
    step = _model()
    with Pool(1, platform=platform) as pool:
        return _steps(pool.function(step.step, keep=tuple(range(step.state))), step, steps)


def jit_model(steps: int) -> float:
    step = _model()
    return _steps(jax.jit(step.step), step, steps)


def sides(name: str, args: argparse.Namespace) -> list[Side]:
    """Both runtimes' sides of a measure (with jax.jit's for the model)."""
    if name == "start":
        return [Side(side, lambda p=p: start(p)) for side, p in SIDES.items()]
    measures: dict[str, Callable[[str], float]] = {
        "round trip": lambda p: round_trip(p, args.calls),
        "in-process": lambda p: in_process(p, args.calls),
        "zoo": zoo,
        "model": lambda p: model(p, args.steps),
    }
    made = [Side(side, lambda p=p: measures[name](p), measures=True) for side, p in SIDES.items()]
    if name == "model":
        made.append(Side("jax.jit (this process)", lambda: jit_model(args.steps), measures=True))
    return made


UNITS = {"start": "ms", "round trip": "us", "in-process": "us", "zoo": "s", "model": "ms"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every measure")
    parser.add_argument("--calls", type=int, default=2000, help="calls per round trip")
    parser.add_argument("--steps", type=int, default=20, help="model steps per round")
    parser.add_argument("--only", default=",".join(MEASURES), help="measures to take")
    args = parser.parse_args()
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - set(MEASURES))
    if unknown:
        parser.error(f"unknown measures {unknown}; known: {', '.join(MEASURES)}")
    print(f"jax {jax.__version__}")
    for name in only:
        samples = compare(sides(name, args), args.rounds, warmup=0 if name == "zoo" else 1)
        report(samples, name, unit=UNITS[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
