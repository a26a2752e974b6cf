"""Benchmark Pool.function's per-call overhead against pool.run, measured in the same run.

Usage::

    python benchmarks/bench_function.py [--workers N] [--calls N] [--batches N]
                                        [--constant-mib N]

The tiny program (a + 1.0 on float32[4]) runs sequentially through one Pool,
after a warm-up, in two ways: pool.run(program, [x]) with the program lowered
beforehand (the baseline), and step(x) for step = pool.function(lambda a:
a + 1.0), which also flattens the arguments, looks up the signature and
rebuilds the result; and step.lower(x) alone (splitting, flattening and
looking up the signature: most of the parent-side work, without the
worker), since round trips on a loaded machine vary by more than the
overhead. A sample is the time per call of a batch of --calls calls; the
sides alternate (benchmarks/harness.py) for --batches samples each. A second
table does the same for a pytree argument (a dict of three float32[4] arrays
in, a dict out) against pool.run on its flat leaves. With --constant-mib N
(default 64; 0 skips it), a last table times warm calls of a function that
closes over an N MiB constant (its program text is about 2N MB, as hex)
against the same function under jax.jit and the tiny Pool.function: a call
of a lowered signature never touches the text. The cache directory is a
fresh temporary one.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from harness import Side, compare, per_call, report

from pool import Pool, lower


def batches(name: str, call: Callable[[], object], calls: int) -> Side:
    """A side whose sample is the time per call over a batch of `calls` calls."""
    return Side(name, lambda: per_call(call, calls), measures=True)


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
    calls = args.calls
    with Pool(args.workers) as pool:
        step, tree_step = pool.function(add_one), pool.function(tree_sum)
        for _ in range(200):  # compile, load, fill the segment and signature caches
            pool.run(program, [x]), step(x), pool.run(tree_program, leaves), tree_step(tree)
        tiny = [
            batches("pool.run", lambda: pool.run(program, [x]), calls),
            batches("Pool.function", lambda: step(x), calls),
            batches("its signature lookup alone (step.lower)", lambda: step.lower(x), calls),
        ]
        report(compare(tiny, args.batches), "tiny a + 1.0, per call", unit="us")
        dicts = [
            batches("pool.run of the leaves", lambda: pool.run(tree_program, leaves), calls),
            batches("Pool.function of the dict", lambda: tree_step(tree), calls),
        ]
        report(compare(dicts, args.batches), "a dict of 3 arrays, per call", unit="us")
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
    sides = [
        batches("jax.jit", lambda: reference(x), 5),
        batches("Pool.function", lambda: heavy(x), 5),
        batches("the tiny Pool.function", lambda: tiny(x), 5),
    ]
    title = f"{mib} MiB closure constant ({text / 1e6:.0f} MB of text), a warm call"
    report(compare(sides, 9), title)


if __name__ == "__main__":
    raise SystemExit(main())
