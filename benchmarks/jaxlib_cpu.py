"""Benchmark: the cpu platform on jaxlib's own CPU client against the CPU PJRT plugin.

Usage::

    python benchmarks/jaxlib_cpu.py [--rounds N] [--calls N] [--steps N] [--only NAME,...]

The ``cpu`` platform runs on the installed jaxlib's own client (jax.jit's XLA,
served from Python in the worker); ``pjrt_cpu`` on lammps-jax-pjrt-cpu
through the native module and its hot loop. Measured in one run, the two
interleaved round by round so that a busy machine slows both alike, medians:

  start       Pool(1) of each, from its constructor to its worker's Ready, and closed
  round trip  Pool.run of x + 1 on float32[4] (the hot path: a HotRun), per call
  in-process  Executable.run of the same program in this process, per call
  zoo         compile_many of the example programs (scripts/example_spec.py) into an
              empty cache, with one worker per CPU
  model       a GPT-2 train step (transformers, AdamW; 2 layers, width 128) through
              Pool.function with its state kept in the worker (keep=), per step; and
              jax.jit's step in this process, for scale

and prints each with the ratio jaxlib / plugin (below 1: the jaxlib client is
faster). Needs the cpu extra (the plugin), flax, optax and transformers<5.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PJRT_POOL_CACHE_DIR", tempfile.mkdtemp(prefix="bench-jaxlib-cpu-"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import jax
import numpy as np

from pool import Pool, lower

RUNTIMES = {"jaxlib": "cpu", "plugin": "pjrt_cpu"}
"""Each side: the platform that runs on it."""

MEASURES = ("start", "round trip", "in-process", "zoo", "model")


def median_of(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def per_call(function: Callable[[], object], calls: int) -> float:
    """The median seconds of a call, after a tenth as many warm-up calls."""
    for _ in range(max(1, calls // 10)):
        function()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return median_of(times)


def start(platform: str) -> float:
    began = time.perf_counter()
    with Pool(1, platform=platform):
        ready = time.perf_counter() - began
    return ready


def tiny(platform: str) -> tuple[object, np.ndarray]:
    x = np.zeros(4, np.float32)
    return lower(lambda x: x + 1, [x], platform=platform), x


def round_trip(platform: str, calls: int) -> float:
    program, x = tiny(platform)
    with Pool(1, platform=platform) as pool:
        return per_call(lambda: pool.run(program, [x]), calls)


def in_process(platform: str, calls: int) -> float:
    """In a child: a process holds one runtime, and this one holds jax.jit's."""
    import subprocess

    code = f"""
import sys, time, numpy as np
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from jaxlib_cpu import per_call, tiny
from pool import compile_program
program, x = tiny({platform!r})
executable, _ = compile_program(program)
print(per_call(lambda: executable.run([x]), {calls}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def zoo(platform: str) -> float:
    from examples import example_programs

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


def model(platform: str, steps: int) -> float:
    from real_models import gpt2

    step = gpt2(layers=2, width=128, vocab=1000, seq=32, batch=4)
    with Pool(1, platform=platform) as pool:
        function = pool.function(step.step, keep=tuple(range(step.state)))
        state = function(*step.arguments)
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            state = function(*step.feed(state))
            np.asarray(state[-1])  # the loss is here: the step has run
            times.append(time.perf_counter() - began)
    return median_of(times)


def jit_model(steps: int) -> float:
    from real_models import gpt2

    step = gpt2(layers=2, width=128, vocab=1000, seq=32, batch=4)
    jitted = jax.jit(step.step)
    state = jitted(*step.arguments)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        state = jitted(*step.feed(state))
        np.asarray(state[-1])
        times.append(time.perf_counter() - began)
    return median_of(times)


def measure(name: str, platform: str, args: argparse.Namespace) -> float:
    """One round of a measure on a platform, in seconds."""
    if name == "start":
        return start(platform)
    if name == "round trip":
        return round_trip(platform, args.calls)
    if name == "in-process":
        return in_process(platform, args.calls)
    if name == "zoo":
        return zoo(platform)
    return model(platform, args.steps)


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
    taken: dict[str, dict[str, list[float]]] = {m: {r: [] for r in RUNTIMES} for m in only}
    jit_steps: list[float] = []
    for round_ in range(args.rounds):
        for runtime, platform in RUNTIMES.items():  # interleaved: one machine state for both
            for name in only:
                taken[name][runtime].append(measure(name, platform, args))
        if "model" in only:
            jit_steps.append(jit_model(args.steps))
        print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    print(f"jax {jax.__version__}; medians of {args.rounds} rounds, interleaved")
    print(f"{'measure':<12} {'jaxlib (cpu)':>14} {'plugin (pjrt_cpu)':>18} {'ratio':>7}")
    for name in only:
        jaxlib, plugin = (median_of(taken[name][r]) for r in RUNTIMES)
        unit, scale = ("us", 1e6) if jaxlib < 0.01 else ("ms", 1e3) if jaxlib < 2 else ("s", 1)
        print(
            f"{name:<12} {jaxlib * scale:>11.1f} {unit:<2} {plugin * scale:>15.1f} {unit:<2}"
            f" {jaxlib / plugin:>7.2f}"
        )
    if jit_steps:
        print(f"jax.jit's model step in this process: {median_of(jit_steps) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
