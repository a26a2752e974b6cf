"""Benchmark compiling, cache loading and running the example programs against JAX.

Usage::

    python benchmarks/bench_programs.py [--repeat N] [--batches N] [--calls N]

One run measures every figure and its baseline in the same process, so that
the ratios hold on a shared, noisy machine:

(a) Compile. For each program of examples, compile_program(program,
    disk_cache=False) against JAX's own in-process compile,
    ``jax.jit(fn).lower(*shapes).compile()``. Both sides are timed around the
    compile only: compile_program takes an already lowered LoweredProgram, so
    the JAX side is lowered outside the timer too, and JAX's lowering time is
    shown in its own column (lower+compile is what a JAX user pays). Passes
    over the programs repeat --repeat times, alternating which side goes
    first for each program, and the per-program median is taken; totals are
    sums of those medians.

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
    same process, max(5, --repeat) times each: CompileStatistics.load_seconds
    (read, verify, deserialize) and the wall time of the whole compile_program
    call. The target is that a load is at least 5x faster than compiling
    (total compile time of (a) over total wall load time).

(c) Run latency. Executable.run([x]) on the tiny program (x + 1 on a float32
    (4,) array) against a jax.jit call of the same function with the same
    numpy array and ``.block_until_ready()``. Batches of --calls calls are
    timed, alternating between the two, and the per-call median over
    --batches batches is reported. The target is that Executable.run is
    within 2x of the JAX call. Two further JAX figures are shown for context:
    the call with an argument already on the device, and the call that also
    copies the result back to numpy (as Executable.run always does).

Every cache directory is a fresh temporary one (PJRT_POOL_CACHE_DIR is set
before pool is imported, since lowering and executable stamps memoize plugin
digests in it), removed at exit; the user's default cache is never touched.
Exit status is 0 whether or not the targets are met; the summary says which.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_SCRATCH = tempfile.mkdtemp(prefix="bench-programs-")
os.environ["PJRT_POOL_CACHE_DIR"] = str(Path(_SCRATCH) / "default-cache")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from harness import per_call  # noqa: E402

from pool import CompileStatistics, LoweredProgram, compile_program, lower, lowering_platform  # noqa: E402
from pool.examples import example_inputs, example_programs  # noqa: E402
from worker import get_runtime  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)
jax.config.update("jax_compilation_cache_dir", None)

LOAD_TARGET = 5.0
"""(b) passes when compiling takes at least this many times as long as loading."""
RUN_TARGET = 2.0
"""(c) passes when Executable.run takes at most this many times as long as the JAX call."""


@dataclass
class ProgramTimes:
    """What was measured for one example program, in seconds."""

    name: str
    lower_ours: float = 0.0
    ours: list[float] = field(default_factory=list)
    ours_plugin: list[float] = field(default_factory=list)
    jax_lower: list[float] = field(default_factory=list)
    jax_compile: list[float] = field(default_factory=list)
    load_stats: list[float] = field(default_factory=list)
    load_wall: list[float] = field(default_factory=list)


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


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(values) if values else float("nan")


def warm_up(programs: dict[str, tuple[Callable[..., Any], list[Any], LoweredProgram]]) -> None:
    """Loads the plugin and JAX's backend and registers LAPACK kernels, untimed."""
    for name in ("tiny_add_one", "linalg_cholesky"):
        function, shapes, program = programs[name]
        ours_compile(program)
        jax_compile(function, shapes)


def measure_compiles(
    programs: dict[str, tuple[Callable[..., Any], list[Any], LoweredProgram]],
    times: dict[str, ProgramTimes],
    repeat: int,
) -> None:
    """(a): interleaved compiles, ours and JAX's, `repeat` passes."""
    for rep in range(repeat):
        for index, (name, (function, shapes, program)) in enumerate(programs.items()):
            gc.collect()
            record = times[name]
            order = ("ours", "jax") if (rep + index) % 2 == 0 else ("jax", "ours")
            for side in order:
                if side == "ours":
                    wall, stats = ours_compile(program)
                    record.ours.append(wall)
                    record.ours_plugin.append(stats.compile_seconds)
                else:
                    lower_s, compile_s = jax_compile(function, shapes)
                    record.jax_lower.append(lower_s)
                    record.jax_compile.append(compile_s)
        print(f"  compile pass {rep + 1}/{repeat} done", flush=True)


def measure_loads(
    programs: dict[str, tuple[Callable[..., Any], list[Any], LoweredProgram]],
    times: dict[str, ProgramTimes],
    repeat: int,
) -> None:
    """(b): publish every executable into a fresh cache, then load each `repeat` times."""
    cache_dir = tempfile.mkdtemp(prefix="cache-", dir=_SCRATCH)
    for _, _, program in programs.values():
        _, stats = compile_program(program, cache_dir=cache_dir)
        assert stats.compiled == 1, f"a fresh cache directory already held {program.name}"
    for _ in range(repeat):
        for name, (_, _, program) in programs.items():
            start = time.perf_counter()
            _, stats = compile_program(program, cache_dir=cache_dir)
            wall = time.perf_counter() - start
            assert stats.loaded == 1, f"{name} was compiled, not loaded: {stats}"
            times[name].load_stats.append(stats.load_seconds)
            times[name].load_wall.append(wall)


def measure_run_latency(
    function: Callable[..., Any], program: LoweredProgram, batches: int, calls: int
) -> dict[str, float]:
    """(c): median seconds per call of Executable.run and of JAX calls, interleaved."""
    executable, _ = compile_program(program, disk_cache=False)
    (x,) = example_inputs([jax.ShapeDtypeStruct(t.shape, t.dtype) for t in program.input_types])
    jitted = jax.jit(fresh(function))
    on_device = jax.device_put(x)
    expected = np.asarray(jitted(x))
    np.testing.assert_array_equal(executable.run([x])[0], expected)
    contenders: dict[str, Callable[[], Any]] = {
        "Executable.run": lambda: executable.run([x]),
        "jax (numpy in)": lambda: jitted(x).block_until_ready(),
        "jax (device in)": lambda: jitted(on_device).block_until_ready(),
        "jax (numpy in, numpy out)": lambda: np.asarray(jitted(x)),
    }
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for call in contenders.values():  # warm up: first calls, allocator, branch caches
        per_call(call, max(100, calls // 10))
    gc.collect()
    for batch in range(batches):
        names = list(contenders)
        if batch % 2:
            names.reverse()
        for name in names:
            samples[name].append(per_call(contenders[name], calls))
    return {name: median(values) for name, values in samples.items()}


def ms(seconds: float) -> str:
    """Seconds as milliseconds with 2 decimals."""
    return f"{seconds * 1e3:9.2f}"


def report(times: dict[str, ProgramTimes], latency: dict[str, float], repeat: int) -> None:
    """Prints the per-program table and the summary with ratios and targets."""
    print()
    print(
        f"{'program':26s} {'lower':>9s} {'ours':>9s} {'jax':>9s} {'ours/':>6s} {'jax':>9s}"
        f" {'load':>9s} {'load':>9s} {'compile/':>8s}"
    )
    print(
        f"{'':26s} {'(pool)':>9s} {'compile':>9s} {'compile':>9s} {'jax':>6s} {'lower':>9s}"
        f" {'(stats)':>9s} {'(wall)':>9s} {'load':>8s}"
    )
    print(f"{'':26s} {'ms':>9s} {'ms':>9s} {'ms':>9s} {'':>6s} {'ms':>9s} {'ms':>9s} {'ms':>9s}")
    totals = dict.fromkeys(
        ("lower", "ours", "plugin", "jax", "jax_lower", "load_stats", "load_wall"), 0.0
    )
    for record in times.values():
        row = {
            "lower": record.lower_ours,
            "ours": median(record.ours),
            "plugin": median(record.ours_plugin),
            "jax": median(record.jax_compile),
            "jax_lower": median(record.jax_lower),
            "load_stats": median(record.load_stats),
            "load_wall": median(record.load_wall),
        }
        for key, value in row.items():
            totals[key] += value
        print(
            f"{record.name:26s} {ms(row['lower'])} {ms(row['ours'])} {ms(row['jax'])}"
            f" {row['ours'] / row['jax']:6.2f} {ms(row['jax_lower'])}"
            f" {ms(row['load_stats'])} {ms(row['load_wall'])}"
            f" {row['ours'] / row['load_wall']:8.1f}"
        )
    print(
        f"{'TOTAL':26s} {ms(totals['lower'])} {ms(totals['ours'])} {ms(totals['jax'])}"
        f" {totals['ours'] / totals['jax']:6.2f} {ms(totals['jax_lower'])}"
        f" {ms(totals['load_stats'])} {ms(totals['load_wall'])}"
        f" {totals['ours'] / totals['load_wall']:8.1f}"
    )

    print()
    print("Executable.run latency on tiny_add_one (median per call):")
    ours = latency["Executable.run"]
    for name, seconds in latency.items():
        print(f"  {name:28s} {seconds * 1e6:8.2f} us   ours/this {ours / seconds:5.2f}")

    compile_ratio = totals["ours"] / totals["jax"]
    load_speedup = totals["ours"] / totals["load_wall"]
    load_speedup_stats = totals["ours"] / totals["load_stats"]
    run_ratio = ours / latency["jax (numpy in)"]
    with_lowering = (totals["lower"] + totals["ours"], totals["jax_lower"] + totals["jax"])
    print()
    print(f"SUMMARY ({len(times)} programs, medians of {repeat} compile passes)")
    print(
        f"  (a) serial compile: compile_program {totals['ours']:.3f} s"
        f" (plugin compile {totals['plugin']:.3f} s) vs jax .compile() {totals['jax']:.3f} s"
        f" -> ratio ours/jax {compile_ratio:.2f}"
    )
    print(
        f"      with lowering: pool.lower+compile {with_lowering[0]:.3f} s"
        f" vs jax .lower()+.compile() {with_lowering[1]:.3f} s"
        f" -> ratio {with_lowering[0] / with_lowering[1]:.2f}"
    )
    print(
        f"  (b) cache-hit load: {totals['load_wall']:.3f} s wall"
        f" ({totals['load_stats']:.3f} s load_seconds) vs compile {totals['ours']:.3f} s"
        f" -> load is {load_speedup:.1f}x faster ({load_speedup_stats:.1f}x by load_seconds);"
        f" target >= {LOAD_TARGET:.0f}x: {'MET' if load_speedup >= LOAD_TARGET else 'NOT MET'}"
    )
    print(
        f"  (c) run latency: Executable.run {ours * 1e6:.2f} us vs jax call"
        f" {latency['jax (numpy in)'] * 1e6:.2f} us -> ratio {run_ratio:.2f};"
        f" target <= {RUN_TARGET:.0f}x: {'MET' if run_ratio <= RUN_TARGET else 'NOT MET'}"
    )


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
    programs: dict[str, tuple[Callable[..., Any], list[Any], LoweredProgram]] = {}
    times: dict[str, ProgramTimes] = {}
    for name, function, shapes in example_programs():
        start = time.perf_counter()
        program = lower(function, shapes)
        times[name] = ProgramTimes(name, lower_ours=time.perf_counter() - start)
        programs[name] = (function, shapes, program)
    print(f"lowered {len(programs)} programs for platform {programs['tiny_add_one'][2].platform}")

    warm_up(programs)
    measure_compiles(programs, times, args.repeat)
    measure_loads(programs, times, max(5, args.repeat))
    tiny_function, _, tiny_program = programs["tiny_add_one"]
    latency = measure_run_latency(tiny_function, tiny_program, args.batches, args.calls)
    report(times, latency, args.repeat)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        shutil.rmtree(_SCRATCH, ignore_errors=True)
