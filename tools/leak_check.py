"""Check that compiling, loading, running and dropping executables does not leak memory.

Usage::

    python tools/leak_check.py [--cycles N] [--warmup N] [--threshold-mib MiB]
                                 [--loops compile,deserialize]

Two loops run in one process, each for --cycles cycles (default 10,000):

compile
    Executable.compile(program.code, compile_options()), run it once, drop
    every reference to the executable and its outputs.
deserialize
    Executable.deserialize(serialized), run it once, drop it. The bytes come
    from one executable serialized before the loop.

The program is small (``x @ w + 1`` on float32 64x64 matrices: a dot and a
fused elementwise op, about 35 ms to compile here) so that cycles are quick
and a leak of anything made per cycle stands out. Every cycle runs on fresh
copies of the inputs, placed on 64-byte boundaries, and runs alternate
zero_copy=True and False: the first makes PJRT alias the host memory (and
wait for its done-with-host-buffer event), the second makes it copy, so a
buffer or a reference to an input that is never released shows as growth.

The resident set size (RSS, from /proc/self/statm) is printed at the start
of each loop, after --warmup cycles (default 200: allocator pools, XLA's
thread pools and caches reach their steady size by then), every tenth of
the loop, and at the end, with the growth per 1000 cycles after warm-up.

The check fails (exit status 1) when RSS grows by more than --threshold-mib
(default 20 MiB) between the end of warm-up and the end of a loop, which is
2 KiB per cycle over 10,000 cycles. Why that bound: every cycle makes an
executable (its serialized form alone is printed, about 6 KiB; the live one
with its compiled code, and in the compile loop the parsed MLIR module, is
larger), two 16 KiB inputs, their device buffers and a 16 KiB output. A
leak of any one of those adds over 6 KiB per cycle, 60 MiB or more over
10,000 cycles: three times the bound (a leaked buffer, eight times). A live
executable in fact holds far more: keeping every one alive measured about
120 KiB per cycle here. Below the bound lies what a healthy process shows
(0.2 MiB after warm-up over 10,000 compile cycles here, 0.0 MiB over
10,000 deserialize cycles): malloc arenas keeping freed memory and XLA's
lazily grown caches. The bound scales with --cycles (threshold x cycles /
10,000, at least 4 MiB), so shorter runs are judged at the same rate.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

_SCRATCH = tempfile.mkdtemp(prefix="leak-check-")
# Lowering and executable stamps memoize plugin digests in the default cache
# directory; keep them out of the user's.
os.environ["PJRT_POOL_CACHE_DIR"] = os.path.join(_SCRATCH, "cache")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pool import lower  # noqa: E402
from worker import Executable, compile_options  # noqa: E402

MIB = 1 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")
REFERENCE_CYCLES = 10_000
"""The cycle count the default threshold is stated for."""


def rss_bytes() -> int:
    """The current resident set size of this process, in bytes.

    From /proc/self/statm; where there is none, the peak RSS from getrusage
    (which only grows, so it still shows a leak).
    """
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mib(size: float) -> str:
    return f"{size / MIB:8.1f} MiB"


def _small_program() -> tuple[bytes, list[np.ndarray], np.ndarray]:
    """The program's StableHLO, inputs, and the output JAX computes for them."""

    def function(x: jax.Array, w: jax.Array) -> jax.Array:
        return x @ w + 1

    shapes = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * 2
    program = lower(function, shapes)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((64, 64)).astype(np.float32) for _ in shapes]
    expected = np.asarray(jax.jit(function)(*inputs))
    return program.code, inputs, expected


def aligned_copy(array: np.ndarray, alignment: int = 64) -> np.ndarray:
    """A fresh copy of an array whose data starts on an `alignment`-byte boundary."""
    raw = np.empty(array.nbytes + alignment, dtype=np.uint8)
    offset = -raw.ctypes.data % alignment
    copy = raw[offset : offset + array.nbytes].view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


def run_loop(
    name: str,
    make: Callable[[], Executable],
    inputs: Sequence[np.ndarray],
    expected: np.ndarray,
    cycles: int,
    warmup: int,
    threshold: float,
) -> bool:
    """Runs make/run/drop `cycles` times, printing RSS; returns True when within threshold."""
    print(f"\n[{name}] {cycles} cycles, warm-up {warmup}, threshold {threshold / MIB:.1f} MiB")
    gc.collect()
    start_rss = rss_bytes()
    print(f"  start                {_mib(start_rss)}")
    warm_rss = start_rss
    report_every = max(1, cycles // 10)
    started = time.perf_counter()
    for cycle in range(1, cycles + 1):
        executable = make()
        arguments = [aligned_copy(array) for array in inputs]
        (output,) = executable.run(arguments, zero_copy=cycle % 2 == 0)
        if cycle <= 2:
            np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
        del executable, output, arguments
        if cycle == warmup:
            gc.collect()
            warm_rss = rss_bytes()
            print(f"  after warm-up {cycle:6d} {_mib(warm_rss)}")
        elif cycle % report_every == 0 and cycle != cycles:
            print(
                f"  cycle {cycle:6d}         {_mib(rss_bytes())}"
                f"   ({(time.perf_counter() - started) / cycle * 1e3:.2f} ms/cycle)",
                flush=True,
            )
    gc.collect()
    end_rss = rss_bytes()
    growth = end_rss - warm_rss
    measured = cycles - min(warmup, cycles)
    per_1000 = growth / measured * 1000 if measured else float("nan")
    elapsed = time.perf_counter() - started
    print(f"  end   {cycles:6d}         {_mib(end_rss)}   ({elapsed:.1f} s)")
    print(
        f"  growth after warm-up {_mib(growth)}   per 1000 cycles {per_1000 / 1024:8.1f} KiB"
        f"   total since start {_mib(end_rss - start_rss)}"
    )
    passed = growth <= threshold
    print(f"  {'PASS' if passed else 'FAIL'}: growth {'<=' if passed else '>'} threshold")
    return passed


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the loops named by --loops; returns 0 when none grew past the threshold."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=REFERENCE_CYCLES)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument(
        "--threshold-mib",
        type=float,
        default=20.0,
        help="allowed growth after warm-up for 10,000 cycles (scaled to --cycles)",
    )
    parser.add_argument("--loops", default="compile,deserialize")
    args = parser.parse_args(argv)
    loops = [name.strip() for name in args.loops.split(",") if name.strip()]
    unknown = set(loops) - {"compile", "deserialize"}
    if unknown or not loops:
        parser.error(f"--loops takes compile and/or deserialize, not {sorted(unknown)}")
    if args.cycles <= args.warmup:
        parser.error("--cycles must be greater than --warmup")
    threshold = max(4.0, args.threshold_mib * args.cycles / REFERENCE_CYCLES) * MIB

    code, inputs, expected = _small_program()
    options = compile_options()
    serialized = Executable.compile(code, options).serialize()
    print(f"program: {len(code)} bytes of StableHLO, serialized executable {len(serialized)} bytes")

    makers: dict[str, Callable[[], Executable]] = {
        "compile": lambda: Executable.compile(code, options),
        "deserialize": lambda: Executable.deserialize(serialized),
    }
    results = {
        name: run_loop(name, makers[name], inputs, expected, args.cycles, args.warmup, threshold)
        for name in loops
    }
    print()
    for name, passed in results.items():
        print(f"{name}: {'PASS' if passed else 'FAIL'}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    try:
        status = main()
    finally:
        shutil.rmtree(_SCRATCH, ignore_errors=True)
    sys.exit(status)
