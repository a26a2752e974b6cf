"""Where a kept training step's time goes: the parent's profile over a loop of steps whose
outputs all stay in the worker, and the bare round trip of a placed run that moves nothing.

Usage::

    python scripts/profile_kept_loop.py [--platform tpu] [--width 1024] [--steps 300]

Prints the loop's time a step (twice), the parent's cProfile of one more loop (the time in
`select.poll` is the wait for the worker's answers; the rest is the parent's own Python),
and the time a call of a chain of `pool.run(tiny, [value], keep=0)`. On a TPU host it needs
the chip (one process at a time); on a CPU it runs as is.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_arrays import loop_seconds, mlp_problem

from pool import Pool, lower


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", default=None, help="the pool's platform (default: cpu)")
    parser.add_argument("--width", type=int, default=1024, help="the MLP's hidden width")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    params, x, y, step = mlp_problem(args.width)
    with Pool(1, platform=args.platform) as pool:
        kept = pool.function(step, keep=True)
        for _ in range(2):
            each, p = loop_seconds(kept, params, x, y, args.steps)
            print(f"everything kept: {each * 1e3:.3f} ms a step")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            p, value = kept(p, x, y)
        float(np.asarray(value))
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)
        tiny = lower(
            lambda a: a + 1, [jax.ShapeDtypeStruct((4,), jnp.float32)], platform=args.platform
        )
        [chained] = pool.run(tiny, [np.ones(4, np.float32)], keep=0)
        started = time.perf_counter()
        for _ in range(args.steps):
            [chained] = pool.run(tiny, [chained], keep=0)
        chained.fetch()
        each = (time.perf_counter() - started) / args.steps
        print(f"a chain of kept tiny runs: {each * 1e3:.3f} ms a call")


if __name__ == "__main__":
    main()
