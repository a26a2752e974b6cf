"""Benchmark Pool.function's per-call overhead against pool.run, measured in the same run.

Usage::

    python benchmarks/bench_function.py [--workers N] [--calls N] [--batches N]

The tiny program (a + 1.0 on float32[4]) runs sequentially through one Pool,
after a warm-up, in two ways: pool.run(program, [x]) with the program lowered
beforehand, and step(x) for step = pool.function(lambda a: a + 1.0), which
also flattens the arguments, looks up the signature and rebuilds the result.
Batches of --calls calls alternate between the two; the figures are medians
of the per-call means of --batches batches, and the ratio is Pool.function
over pool.run. A second line does the same for a pytree argument (a dict of
three float32[4] arrays in, a dict out) against pool.run on its flat leaves.
Round trips on a loaded machine vary by more than the overhead, so the last
line times step.lower(x) alone (splitting, flattening and looking up the
signature: most of the parent-side work, without the worker). With
--constant-mib N (default 64; 0 skips it), a last line times warm calls of a
function that closes over an N MiB constant (its program text is about 2N
MB, as hex) against the same function under jax.jit and against the tiny
Pool.function: a call of a lowered signature never touches the text. The
cache directory is a fresh temporary one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from harness import per_call

from pool import Pool, lower


def compare(
    name: str,
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    args: argparse.Namespace,
) -> None:
    for _ in range(200):  # warm-up: compile, load, fill the segment and signature caches
        baseline()
        candidate()
    run_times, function_times = [], []
    for batch in range(args.batches):
        # Alternate which side goes first, so drifting load hits both alike.
        sides = [(baseline, run_times), (candidate, function_times)]
        for function, times in sides if batch % 2 == 0 else sides[::-1]:
            times.append(per_call(function, args.calls))
    run, function = statistics.median(run_times), statistics.median(function_times)
    print(
        f"{name}: pool.run {run * 1e6:.1f} us, Pool.function {function * 1e6:.1f} us per call: "
        f"{function / run:.3f}x ({(function - run) * 1e6:+.1f} us)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--calls", type=int, default=500, help="calls per batch")
    parser.add_argument("--batches", type=int, default=10, help="batches per side")
    parser.add_argument("--constant-mib", type=int, default=64, help="0: skip the large constant")
    args = parser.parse_args(argv)
    print(f"Pool.function overhead: {args.workers} workers, {os.cpu_count()} CPUs", flush=True)
    os.environ["PJRT_POOL_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-function-")

    x = np.ones(4, np.float32)
    tree = {"a": x, "b": x * 2, "c": x * 3}

    def add_one(a):
        return a + 1.0

    def tree_sum(t):
        return {"sum": t["a"] + t["b"] + t["c"]}

    program = lower(add_one, [jax.ShapeDtypeStruct((4,), jnp.float32)])
    tree_program = lower(tree_sum, [tree])
    leaves = jax.tree_util.tree_leaves(tree)
    with Pool(args.workers) as pool:
        step, tree_step = pool.function(add_one), pool.function(tree_sum)
        compare("tiny a + 1.0", lambda: pool.run(program, [x]), lambda: step(x), args)
        compare("dict of 3", lambda: pool.run(tree_program, leaves), lambda: tree_step(tree), args)
        lookup = statistics.median(per_call(lambda: step.lower(x), args.calls) for _ in range(9))
        print(f"signature lookup alone (step.lower(x)): {lookup * 1e6:.2f} us per call")
        if args.constant_mib:
            large_constant(pool, args.constant_mib, step, x)
    return 0


def large_constant(pool: Pool, mib: int, tiny: Callable[..., object], x: np.ndarray) -> None:
    """Warm calls of a function with a large closure constant: Pool.function vs jax.jit."""
    constant = np.random.default_rng(0).standard_normal(mib << 18).astype(np.float32)

    def with_constant(a):
        return a + jnp.asarray(constant)[:4]

    heavy, reference = pool.function(with_constant), jax.jit(with_constant)
    text = len(heavy.lower(x).text)
    for function in (heavy, reference, tiny):
        function(x)  # lowered, compiled and loaded
    times = {name: [] for name in ("heavy", "jit", "tiny")}
    for _ in range(9):
        for name, function in (("heavy", heavy), ("jit", reference), ("tiny", tiny)):
            times[name].append(per_call(lambda f=function: f(x), 5))
    heavy_s, jit_s, tiny_s = (statistics.median(times[n]) for n in ("heavy", "jit", "tiny"))
    print(
        f"{mib} MiB closure constant ({text / 1e6:.0f} MB of text): Pool.function "
        f"{heavy_s * 1e3:.2f} ms, jax.jit {jit_s * 1e3:.2f} ms per call ({heavy_s / jit_s:.2f}x); "
        f"the tiny Pool.function {tiny_s * 1e3:.3f} ms"
    )


if __name__ == "__main__":
    raise SystemExit(main())
