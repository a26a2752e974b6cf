"""Benchmark compiling, cache loading and running the example programs against JAX.

Usage::

    python benchmarks/bench_programs.py [--repeat N] [--batches N] [--calls N]

One run measures every figure and its baseline in the same process, so that
the ratios hold on a shared, noisy machine:

(a) Compile. Every program of pool.examples, compile_program(program,
    disk_cache=False) against JAX's own in-process compile,
    ``jax.jit(fn).lower(*shapes).compile()``. Both sides are timed around the
    compile only: compile_program takes an already lowered LoweredProgram, so
    the JAX side is lowered outside the timer too, and JAX's lowering time is
    shown apart (lower+compile is what a JAX user pays). A sample is a pass
    over every program; the sides alternate (benchmarks/harness.py) for
    --repeat passes each.

    JAX must not reuse earlier work, or its baseline would be too fast: its
    persistent compilation cache is switched off (jax_enable_compilation_cache
    False and no cache directory), and every measurement wraps the function
    in a new Python function under a new jax.jit, so that JAX's in-memory
    caches (tracing, keyed on the function; lowering and compilation, keyed
    weakly on the jaxpr and the module) all miss. Before timing, both sides
    compile a tiny and a linalg program once, so that loading the plugin,
    initializing JAX's backend and registering the LAPACK kernels are not
    charged to the first program measured.

(b) Cache hit. Every program is compiled once with a fresh disk cache
    directory (publishing the executables), then loaded from it again in the
    same process, a pass over every program a sample, max(5, --repeat)
    times: the wall time of the compile_program calls and their
    CompileStatistics.load_seconds (read, verify, deserialize), against
    (a)'s compile. The target is that a load is at least 5x faster than
    compiling.

(c) Run latency. Executable.run([x]) on the tiny program (x + 1 on a float32
    (4,) array) against a jax.jit call of the same function with the same
    numpy array and ``.block_until_ready()``. A sample is the time per call
    of a batch of --calls calls; --batches samples each. The target is that
    Executable.run is within 2x of the JAX call. Two further JAX figures are
    shown for context: the call with an argument already on the device, and
    the call that also copies the result back to numpy (as Executable.run
    always does).

Every cache directoryEvery cache directory is a fresh temporary one (PJRT_POOL_CACHE_DIR is set
before pool is imported, since lowering and executable stamps memoize plugin
digests in it), removed at exit; the user's default cache is never touched.
Exit status is 0 whether or not the targets are met; the report says which.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_SCRATCH = tempfile.mkdtemp(prefix="bench-programs-")
os.environ["PJRT_POOL_CACHE_DIR"] = str(Path(_SCRATCH) / "default-cache")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from harness import Side, compare, per_call, ratio_line, report  # noqa: E402

from pool import CompileStatistics, LoweredProgram, compile_program, lower, lowering_platform  # noqa: E402
from pool.examples import example_inputs, example_programs  # noqa: E402
from worker import get_runtime  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)
jax.config.update("jax_compilation_cache_dir", None)

LOAD_TARGET = 0.2
"""(b) passes when loading takes at most this share of the time compiling takes."""
RUN_TARGET = 2.0
"""(c) passes when Executable.run takes at most this many times as long as the JAX call."""

Programs = dict[str, tuple[Callable[..., Any], list[Any], LoweredProgram]]
"""Each example by name: its function, its shapes, and the program lowered."""


def fresh(function: Callable[..., Any]) -> Callable[..., Any]:
    """Returns a new function object that calls `function`, so no JAX cache knows it."""

    def wrapper(*args: Any) -> Any:
        return function(*args)

    return wrapper


def jax_compile(function: Callable[..., Any], shapes: Sequence[Any]) -> tuple[float, float]:
    """Lowers and compiles a function with a fresh jax.jit; returns (lower, compile) seconds."""
    start = time.perf_counter()
    lowered = jax.jit(fresh(function)).lower(*shapes)
    middle = time.perf_counter()
    lowered.compile()
    return middle - start, time.perf_counter() - middle


def ours_compile(program: LoweredProgram) -> tuple[float, CompileStatistics]:
    """Compiles without the disk cache; returns (wall seconds, statistics)."""
    start = time.perf_counter()
    _, stats = compile_program(program, disk_cache=False)
    wall = time.perf_counter() - start
    assert stats.compiled == 1, stats
    return wall, stats


def warm_up(programs: Programs) -> None:
    """Loads the plugin and JAX's backend and registers LAPACK kernels, untimed."""
    for name in ("tiny_add_one", "linalg_cholesky"):
        function, shapes, program = programs[name]
        ours_compile(program)
        jax_compile(function, shapes)


def compiles(programs: Programs, repeat: int) -> Any:
    """(a): passes of JAX's compiles and of compile_program's, alternated."""

    def jax_pass() -> dict[str, float]:
        lowering = compiling = 0.0
        for function, shapes, _ in programs.values():
            gc.collect()
            lower_s, compile_s = jax_compile(function, shapes)
            lowering, compiling = lowering + lower_s, compiling + compile_s
        return {"wall": compiling, "lower": lowering}

    def ours_pass() -> dict[str, float]:
        wall = plugin = 0.0
        for _, _, program in programs.values():
            gc.collect()
            seconds, stats = ours_compile(program)
            wall, plugin = wall + seconds, plugin + stats.compile_seconds
        return {"wall": wall, "plugin": plugin}

    sides = [
        Side("jax.jit(f).lower(...).compile(): compile", jax_pass, measures=True),
        Side("compile_program, no disk cache", ours_pass, measures=True),
    ]
    return compare(sides, repeat, warmup=0)


def loads(programs: Programs, repeat: int) -> Any:
    """(b): every executable published into a fresh cache, then passes loading each."""
    cache_dir = tempfile.mkdtemp(prefix="cache-", dir=_SCRATCH)
    for _, _, program in programs.values():
        _, stats = compile_program(program, cache_dir=cache_dir)
        assert stats.compiled == 1, f"a fresh cache directory already held {program.name}"

    def load_pass() -> dict[str, float]:
        wall = load = 0.0
        for name, (_, _, program) in programs.items():
            start = time.perf_counter()
            _, stats = compile_program(program, cache_dir=cache_dir)
            wall += time.perf_counter() - start
            assert stats.loaded == 1, f"{name} was compiled, not loaded: {stats}"
            load += stats.load_seconds
        return {"wall": wall, "load": load}

    return compare([Side("compile_program, cache hits", load_pass, True)], repeat, warmup=0)


def run_latency(function: Callable[..., Any], program: LoweredProgram, batches: int,
                calls: int) -> Any:  # fmt: skip
    """(c): seconds per call of JAX calls and of Executable.run, alternated batches."""
    executable, _ = compile_program(program, disk_cache=False)
    (x,) = example_inputs([jax.ShapeDtypeStruct(t.shape, t.dtype) for t in program.input_types])
    jitted = jax.jit(fresh(function))
    on_device = jax.device_put(x)
    expected = np.asarray(jitted(x))
    np.testing.assert_array_equal(executable.run([x])[0], expected)
    contenders: dict[str, Callable[[], Any]] = {
        "jax (numpy in)": lambda: jitted(x).block_until_ready(),
        "Executable.run": lambda: executable.run([x]),
        "jax (device in)": lambda: jitted(on_device).block_until_ready(),
        "jax (numpy in, numpy out)": lambda: np.asarray(jitted(x)),
    }
    for call in contenders.values():  # warm up: first calls, allocator, branch caches
        per_call(call, max(100, calls // 10))
    gc.collect()
    sides = [
        Side(name, lambda call=call: per_call(call, calls), measures=True)
        for name, call in contenders.items()
    ]
    return compare(sides, batches, warmup=0)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark and prints the table and summary; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="compile passes (default 3)")
    parser.add_argument(
        "--batches", type=int, default=15, help="run-latency batches per contender (default 15)"
    )
    parser.add_argument(
        "--calls", type=int, default=2000, help="calls per run-latency batch (default 2000)"
    )
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.batches < 1 or args.calls < 1:
        parser.error("--repeat, --batches and --calls must be at least 1")

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPUs")
    # Load the plugin first, so that lowering asks it for its StableHLO window
    # instead of probing it in a child process (a one-time cost of ~1 s).
    get_runtime(lowering_platform([]))
    programs: Programs = {}
    times: dict[str, float] = {}
    for name, function, shapes in example_programs():
        start = time.perf_counter()
        program = lower(function, shapes)
        times[name] = time.perf_counter() - start
        programs[name] = (function, shapes, program)
    print(f"lowered {len(programs)} programs for platform {programs['tiny_add_one'][2].platform}")

    lowered = sum(times.values())
    warm_up(programs)
    compiled = compiles(programs, args.repeat)
    title = f"\n(a) compiling {len(programs)} programs, serially in this process"
    report(compiled, title, unit="s")
    jax_side, ours_side = compiled.sides
    ours, jax_lowering = compiled.median(ours_side), compiled.median(jax_side, "lower")
    ratio_line("  of compile_program: the plugin's compile", compiled.median(ours_side, "plugin"),
               compiled.median(jax_side), "s")  # fmt: skip
    with_lowering = compiled.median(jax_side) + jax_lowering
    ratio_line("jax.jit(f).lower(...).compile(): both", with_lowering, with_lowering, "s")
    ratio_line("pool.lower + compile_program", lowered + ours, with_lowering, "s")
    loaded = loads(programs, max(5, args.repeat))
    print(f"\n(b) loading the {len(programs)} programs from the disk cache, against compiling")
    ratio_line("compile_program, no disk cache", ours, ours, "s")
    hits = loaded.sides[0]
    ratio_line(hits, loaded.median(hits), ours, "s", goal=LOAD_TARGET)
    ratio_line("  of which load_seconds", loaded.median(hits, "load"), ours, "s")
    tiny_function, _, tiny_program = programs["tiny_add_one"]
    latency = run_latency(tiny_function, tiny_program, args.batches, args.calls)
    title = "\n(c) the tiny program (x + 1, float32[4]), a call"
    report(latency, title, unit="us", goals={"Executable.run": RUN_TARGET})
    return 0
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        shutil.rmtree(_SCRATCH, ignore_errors=True)
