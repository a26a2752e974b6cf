"""Where a kept training step's time goes: the parent's own time a step, its profile, and
the same figures of another tree measured alternately.

Usage::

    python scripts/profile_kept_loop.py [--platform tpu] [--width 1024] [--steps 300]
    python scripts/profile_kept_loop.py --width 16 --steps 1000 --against OTHER_PYTHON
    python scripts/profile_kept_loop.py --width 16 --steps 1000 --against-ahead 0

A step is `params, loss = kept(params, x, y)` of an MLP's SGD step through
`pool.function(step, keep=True)`: every output stays in the worker. The figures
(medians over --rounds loops):

    step        wall time a step
    wait        the time a step's caller waits for the worker's reply (in
                protocol.spin_until_readable, which the script wraps to time it, and
                which then blocks in poll until the reply is there)
    own         step - wait: the parent's own time (its Python, and the system calls
                that send the request and read the reply)
    own cpu     the calling thread's CPU time a step, less its CPU time in the wait:
                the parent's own time as it spends the CPU (less sensitive to other
                processes on the machine than wall times)
    tiny        a non-kept Pool.run of a tiny program (x + 1 on 4 floats): the tiny
                round trip (and its own time and CPU time, as above)

Without --against it prints them, then the parent's cProfile of one more loop sorted by
cumulative and by own time (the time in `select.poll` is the wait; the rest is the
parent's own), and the time a call of a chain of `pool.run(tiny, [value], keep=0)`. With
--against PYTHON (the interpreter of another tree, for example a venv whose path holds
main's checkout), it runs --json figures alternately with this interpreter and that one,
--alternations times each, and prints each side's medians and the ratios this/that. On a
TPU host it needs the chip (one process at a time); on a CPU it runs as is.

A kept step is sent ahead of its reply (Pool's dispatch_ahead, default 3): the loop reads
its last loss at the end, so that a step's time covers the runs still in flight, and the
wait then includes the caller's waits for earlier replies (CallerPath._drain's, in
protocol.wait_until_readable). --dispatch-ahead N gives the pool that option (a tree
without it refuses it); --against-ahead N alternates this tree as it is with this tree
given --dispatch-ahead N, as --against alternates two trees (ratios default/N).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_arrays import loop_seconds, mlp_problem

from pool import Pool, lower
from worker.wire import protocol

FIGURES = ("step", "wait", "own", "own cpu", "tiny", "tiny own", "tiny own cpu")


class WaitClock:
    """Times the caller's waits for replies: wraps protocol.spin_until_readable (Pool.run's
    wait, looked up on the module at each call) so that it returns only once the reply is
    there, and protocol.wait_until_readable (the wait for a reply of a run sent ahead),
    summing the wall and thread CPU time spent in them."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self.nested = False  # in the wrapped wait_until_readable
        spin = protocol.spin_until_readable

        def timed(poller: Any, seconds: float) -> bool:
            if self.nested:  # wait_until_readable's own spin: timed there
                return spin(poller, seconds)
            wall, cpu = time.perf_counter(), time.thread_time()
            if not spin(poller, seconds):
                poller.poll()  # the rest of the wait, asleep (run_directly would block in recv)
            self.wall += time.perf_counter() - wall
            self.cpu += time.thread_time() - cpu
            return True

        protocol.spin_until_readable = timed  # type: ignore[assignment]
        wait = protocol.wait_until_readable

        def timed_wait(poller: Any, seconds: float, timeout: float | None) -> bool:
            wall, cpu = time.perf_counter(), time.thread_time()
            self.nested = True
            try:
                return wait(poller, seconds, timeout)
            finally:
                self.nested = False
                self.wall += time.perf_counter() - wall
                self.cpu += time.thread_time() - cpu

        protocol.wait_until_readable = timed_wait  # type: ignore[assignment]

    def measure(self, loop: Callable[[], object], calls: int) -> dict[str, float]:
        """Seconds a call of `calls` calls of loop(): wall, waited, own wall and own CPU."""
        self.wall = self.cpu = 0.0
        wall, cpu = time.perf_counter(), time.thread_time()
        loop()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        return {
            "step": wall / calls,
            "wait": self.wall / calls,
            "own": (wall - self.wall) / calls,
            "own cpu": (cpu - self.cpu) / calls,
        }


def pool_of(platform: str | None, ahead: int | None) -> Pool:
    """Pool(1) for the platform, given dispatch_ahead when `ahead` is not None."""
    return Pool(1, platform=platform, **({} if ahead is None else {"dispatch_ahead": ahead}))


def figures(
    width: int, steps: int, rounds: int, platform: str | None, ahead: int | None
) -> dict[str, float]:
    """The medians of each figure (FIGURES) over `rounds` loops of `steps` steps."""
    params, x, y, step = mlp_problem(width)
    clock = WaitClock()
    found: dict[str, list[float]] = {name: [] for name in FIGURES}
    tiny = lower(lambda a: a + 1, [jax.ShapeDtypeStruct((4,), jnp.float32)], platform=platform)
    small = np.ones(4, np.float32)
    with pool_of(platform, ahead) as pool:
        kept = pool.function(step, keep=True)
        loop_seconds(kept, params, x, y, steps)  # compiled, warm
        pool.run(tiny, [small])

        def steps_loop() -> None:
            p, value = kept(params, x, y)
            for _ in range(steps - 1):
                p, value = kept(p, x, y)
            float(np.asarray(value))  # the runs still in flight (sent ahead) end too

        def tiny_loop() -> None:
            for _ in range(steps):
                pool.run(tiny, [small])

        for _ in range(rounds):
            for name, value in clock.measure(steps_loop, steps).items():
                found[name].append(value)
            timed = clock.measure(tiny_loop, steps)
            found["tiny"].append(timed["step"])
            found["tiny own"].append(timed["own"])
            found["tiny own cpu"].append(timed["own cpu"])
    return {name: statistics.median(values) for name, values in found.items()}


def show(values: dict[str, float]) -> str:
    return "  ".join(f"{name} {values[name] * 1e3:.4f} ms" for name in FIGURES)


def profile(width: int, steps: int, platform: str | None, ahead: int | None) -> None:
    """The loop's times, the parent's cProfile of one loop, and a chain of kept tiny runs."""
    params, x, y, step = mlp_problem(width)
    with pool_of(platform, ahead) as pool:
        kept = pool.function(step, keep=True)
        for _ in range(2):
            each, p = loop_seconds(kept, params, x, y, steps)
            print(f"everything kept: {each * 1e3:.3f} ms a step")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            p, value = kept(p, x, y)
        float(np.asarray(value))
        profiler.disable()
        for order in ("cumulative", "tottime"):
            pstats.Stats(profiler).sort_stats(order).print_stats(30)
        tiny = lower(lambda a: a + 1, [jax.ShapeDtypeStruct((4,), jnp.float32)], platform=platform)
        [chained] = pool.run(tiny, [np.ones(4, np.float32)], keep=0)
        started = time.perf_counter()
        for _ in range(steps):
            [chained] = pool.run(tiny, [chained], keep=0)
        chained.fetch()
        each = (time.perf_counter() - started) / steps
        print(f"a chain of kept tiny runs: {each * 1e3:.3f} ms a call")


def against(this: list[str], other: list[str], alternations: int, arguments: list[str]) -> None:
    """Runs --json figures with the command `this` and the command `other` (an interpreter,
    and options of this script) alternately; prints the medians of each side and the
    ratios this/other."""
    sides: dict[str, list[dict[str, float]]] = {" ".join(this): [], " ".join(other): []}
    commands = {" ".join(this): this, " ".join(other): other}
    for _ in range(alternations):
        for side, runs in sides.items():
            python, *options = commands[side]
            command = [python, __file__, "--json", *arguments, *options]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
            print(f"{side}: {show(runs[-1])}", flush=True)
    medians = {
        side: {name: statistics.median(run[name] for run in runs) for name in FIGURES}
        for side, runs in sides.items()
    }
    for side, values in medians.items():
        print(f"median {side}: {show(values)}")
    mine, theirs = medians[" ".join(this)], medians[" ".join(other)]
    print("this / other: " + "  ".join(f"{n} {mine[n] / theirs[n]:.3f}" for n in FIGURES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", default=None, help="the pool's platform (default: cpu)")
    parser.add_argument("--width", type=int, default=1024, help="the MLP's hidden width")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5, help="loops the figures are the median of")
    parser.add_argument("--json", action="store_true", help="print only the figures, as JSON")
    parser.add_argument("--against", metavar="PYTHON", help="another tree's interpreter")
    parser.add_argument("--alternations", type=int, default=4)
    parser.add_argument("--dispatch-ahead", type=int, help="the pool's dispatch_ahead")
    parser.add_argument(
        "--against-ahead", type=int, metavar="N", help="against this tree with dispatch_ahead=N"
    )
    args = parser.parse_args()
    common = ["--width", str(args.width), "--steps", str(args.steps), "--rounds", str(args.rounds)]
    if args.platform:
        common += ["--platform", args.platform]
    this = [sys.executable]
    if args.dispatch_ahead is not None:
        this += ["--dispatch-ahead", str(args.dispatch_ahead)]
    if args.against:
        against(this, [args.against], args.alternations, common)
        return
    if args.against_ahead is not None:
        other = [sys.executable, "--dispatch-ahead", str(args.against_ahead)]
        against(this, other, args.alternations, common)
        return
    values = figures(args.width, args.steps, args.rounds, args.platform, args.dispatch_ahead)
    if args.json:
        print(json.dumps(values))
        return
    print(show(values))
    profile(args.width, args.steps, args.platform, args.dispatch_ahead)


if __name__ == "__main__":
    main()
