"""Benchmark what lower()'s workarounds cost: the programs they change, with and without them.

Usage::

    python benchmarks/bench_workarounds.py [--batches N] [--seconds S] [--only TEXT]

On the default CPU plugin, lower() puts the divisor of every stablehlo.atan2
that XLA might see as a constant through an optimization barrier
(worker.plugin.known_builds: the plugin miscompiles atan2(x, 1.0), which is
jnp.arctan). Each program below is lowered twice in this process, with the
workaround and with PJRT_POOL_WORKAROUNDS=off, compiled in process and run
alternately (benchmarks/harness.py) in batches of about --seconds each; the
figures are the medians over --batches batches per side, and the ratios are
against the program without the workaround. Each table's title says whether
the workaround changed the program at all. Without it, jnp.arctan's results
are wrong from about 50 elements (the title says how far each side is from
jax.jit, in ULPs), so its time is that of a wrong program. atan2(x, 2.0)
was right without the barrier, and so was the loop whose divisor is
computed from the loop's state (which the barrier keeps from fusing with
its producer); arcsin, whose divisor is computed from the input, is left
unchanged (a control). jax.jit's time is shown for scale.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from harness import Side, compare, report
from jax import lax

from pool import compile_program, lower
from pool.conformance.compare import ulp_distance
from pool.lowering.plugin_info import plugin_info
from pool.lowering.workarounds import build_workarounds
from worker.plugin.conformance_records import KnownPluginFailuresWarning
from worker.plugin.known_builds import WORKAROUNDS_ENV


def _scan_arctan(x: jax.Array) -> jax.Array:
    return lax.scan(lambda c, row: (c, jnp.arctan(row)), 0.0, x.reshape(100, -1))[1]


def _loop_divisor(x: jax.Array) -> jax.Array:
    def step(i: jax.Array, v: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        return jnp.arctan2(v[0], jnp.cos(v[1])), v[1] * 1.0001

    return lax.fori_loop(0, 10, step, (x, x))[0]


def _inputs(size: int, dtype: Any = np.float32) -> np.ndarray:
    return np.random.default_rng(0).uniform(-1e4, 1e4, size).astype(dtype)


PROGRAMS: list[tuple[str, Callable[..., Any], Callable[[], list[np.ndarray]]]] = [
    ("arctan float32[1000]", jnp.arctan, lambda: [_inputs(1000)]),
    ("arctan float32[100000]", jnp.arctan, lambda: [_inputs(100_000)]),
    ("arctan float32[1000000]", jnp.arctan, lambda: [_inputs(1_000_000)]),
    ("arctan float16[1000000]", jnp.arctan, lambda: [_inputs(1_000_000, np.float16)]),
    ("arctan in a scan, 100 x float32[1000]", _scan_arctan, lambda: [_inputs(100_000)]),
    ("atan2(x, 2.0) float32[1000000]", lambda x: jnp.arctan2(x, 2.0), lambda: [_inputs(10**6)]),
    ("loop: atan2(v, cos w), 10 x float32[1e5]", _loop_divisor, lambda: [_inputs(100_000)]),
    ("arcsin float32[1000000]", jnp.arcsin, lambda: [_inputs(1_000_000) / 1e4]),
]


def _max_ulps(got: np.ndarray, expected: np.ndarray) -> float:
    if got.dtype.kind == "c":
        return max(_max_ulps(got.real, expected.real), _max_ulps(got.imag, expected.imag))
    same = np.isnan(got) == np.isnan(expected)
    if not same.all():
        return float("inf")
    finite = ~np.isnan(expected)
    return float(ulp_distance(got[finite], expected[finite]).max()) if finite.any() else 0.0


def _per_call(function: Callable[[], object], seconds: float) -> float:
    """Seconds per call of function, called over about `seconds` seconds."""
    calls, start = 0, time.perf_counter()
    while True:
        function()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls


def _lowered(function: Callable[..., Any], inputs: list[np.ndarray], switch: str) -> Any:
    os.environ[WORKAROUNDS_ENV] = switch
    try:
        return lower(function, inputs)
    finally:
        os.environ.pop(WORKAROUNDS_ENV, None)


def _compare(
    name: str, function: Callable[..., Any], inputs: list[np.ndarray], args: argparse.Namespace
) -> None:
    """Times one program with the workaround, without it and with jax.jit; prints one row."""
    expected = [np.asarray(e) for e in jax.tree.leaves(jax.jit(function)(*inputs))]
    programs = [_lowered(function, inputs, switch) for switch in ("on", "off")]
    changed = "yes" if programs[0].text != programs[1].text else "no"
    with_it, without = (compile_program(p, disk_cache=False)[0] for p in programs)
    ulps = [
        max(_max_ulps(o, e) for o, e in zip(side.run(inputs), expected, strict=True))
        for side in (with_it, without)
    ]
    jitted = jax.jit(function)
    runs = {
        "without the workaround": lambda: without.run(inputs),
        "with it": lambda: with_it.run(inputs),
        "jax.jit": lambda: jax.block_until_ready(jitted(*inputs)),
    }
    for run in runs.values():  # warm-up: first runs of a fresh executable cost more
        _per_call(run, args.seconds / 4)
    sides = [
        Side(side, lambda run=run: _per_call(run, args.seconds), measures=True)
        for side, run in runs.items()
    ]
    title = (
        f"{name}: program changed {changed}; ULPs from jax.jit with it {ulps[0]:.3g}, "
        f"without {ulps[1]:.3g}"
    )
    report(compare(sides, args.batches, warmup=0), title, unit="us")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=7, help="batches per side")
    parser.add_argument("--seconds", type=float, default=0.2, help="seconds per batch")
    parser.add_argument(
        "--only", metavar="TEXT", default="", help="time only the programs whose name has TEXT"
    )
    args = parser.parse_args(argv)
    # The warning names the known failures, which this script runs on purpose.
    warnings.simplefilter("ignore", KnownPluginFailuresWarning)
    info = plugin_info("cpu")
    workarounds = [w.name for w in build_workarounds(info)]
    print(
        f"workarounds for {info['path'] if info else 'no plugin'}: {workarounds or 'none'}; "
        f"jax {jax.__version__}, {os.cpu_count()} CPUs",
        flush=True,
    )
    if not workarounds:
        print("this plugin build has no workarounds: there is nothing to compare")
        return 0
    for name, function, make in PROGRAMS:
        if args.only in name:
            _compare(name, function, make(), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
