"""Benchmark the worker pool against in-process baselines measured in the same run.

Usage::

    python scripts/bench_pool.py [--workers N] [--calls N] [--repeat N] [--parts abcd]

(a) Parallel compile. The example programs (examples, lowered first and
    outside every timer) are compiled with a Pool of --workers workers
    (default: the CPU count) into a fresh cache directory, against compiling
    them one after another in this process (compile_program, disk_cache=False).
    Pool start-up is timed apart. Target: pool wall time <= 0.65x serial.
    Passes alternate which side goes first; medians over --repeat passes.

(b) Round trip. pool.run on the tiny program (x + 1, float32[4]), sequential
    calls after a warm-up, against Executable.run of the same program in this
    process; and pool.submit(...).result(), whose reply the manager thread
    reads. Per-call medians over batches. Target: pool median < 150 us.

(c) 64 MiB output. A program that returns a 64 MiB float32 array, run through
    the pool, against Executable.run in this process (target: <= 1.5x), and
    against a concurrent.futures.ProcessPoolExecutor whose worker runs the
    same executable in-process and returns the array pickled, as plain
    process pools do (target: the pool >= 3x faster).

(d) Worker start-up: spawn to Ready (plugin loaded, handshake done) for each
    worker of a fresh pool, and the whole Pool() construction. Target < 0.5 s.

Cache directories are fresh temporary ones; the user's cache is untouched.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_SCRATCH = tempfile.mkdtemp(prefix="bench-pool-")
os.environ["PJRT_POOL_CACHE_DIR"] = str(Path(_SCRATCH) / "default-cache")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from examples import example_programs  # noqa: E402

from pool import Pool, compile_program, lower  # noqa: E402
from worker import LoweredProgram  # noqa: E402

BIG = 1 << 24  # float32 elements: 64 MiB


def median(values: list[float]) -> float:
    return statistics.median(values)


def fresh_dir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix, dir=_SCRATCH)


# -- (a) ---------------------------------------------------------------------


def serial_compile(programs: list[LoweredProgram]) -> tuple[float, float]:
    """Compiles one after another in this process; returns (wall, CPU) seconds."""
    cpu = time.process_time()
    start = time.perf_counter()
    for program in programs:
        _, stats = compile_program(program, disk_cache=False)
        assert stats.compiled == 1
    return time.perf_counter() - start, time.process_time() - cpu


def pool_compile(programs: list[LoweredProgram], workers: int) -> tuple[float, float]:
    start = time.perf_counter()
    with Pool(workers, cache_dir=fresh_dir("a-")) as pool:
        ready = time.perf_counter()
        pool.compile_many(programs)
        done = time.perf_counter()
        assert pool.statistics.compiled == len(programs)
    return ready - start, done - ready


# -- (b) ---------------------------------------------------------------------


def round_trips(
    pool: Pool, program: LoweredProgram, x: np.ndarray, calls: int, submit: bool = False
) -> list[float]:
    """Seconds per call of pool.run (or of pool.submit(...).result(), with submit)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        if submit:
            pool.submit(program, [x]).result()
        else:
            pool.run(program, [x])
        times.append(time.perf_counter() - start)
    return times


def in_process_runs(executable: Any, x: np.ndarray, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        executable.run([x])
        times.append(time.perf_counter() - start)
    return times


# -- (c) ---------------------------------------------------------------------

_executor_executable: Any = None


def _executor_init(program: LoweredProgram, cache_dir: str) -> None:
    global _executor_executable
    _executor_executable, _ = compile_program(program, cache_dir=cache_dir)


def _executor_run(x: np.ndarray) -> np.ndarray:
    return _executor_executable.run([x])[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--calls", type=int, default=2000, help="round trips per side in (b)")
    parser.add_argument("--repeat", type=int, default=3, help="passes in (a), runs in (c)")
    parser.add_argument(
        "--parts", default="abcd", help="which parts to run, e.g. b for the round trip only"
    )
    args = parser.parse_args(argv)
    print(f"pjrt-pool pool benchmark: {args.workers} workers, {os.cpu_count()} CPUs", flush=True)

    examples = example_programs()
    programs = [lower(function, shapes) for _, function, shapes in examples]
    compile_program(programs[0], disk_cache=False)  # load the plugin here, untimed
    for program in programs:
        if "lapack" in program.text:
            compile_program(program, disk_cache=False)  # register LAPACK here, untimed
            break

    if "a" in args.parts:
        serial, serial_cpu, parallel, startups = [], [], [], []
        for rep in range(args.repeat):
            if rep % 2 == 0:
                wall_s, cpu_s = serial_compile(programs)
                startup, wall = pool_compile(programs, args.workers)
            else:
                startup, wall = pool_compile(programs, args.workers)
                wall_s, cpu_s = serial_compile(programs)
            serial.append(wall_s)
            serial_cpu.append(cpu_s)
            parallel.append(wall)
            startups.append(startup)
        ratio_a = median(parallel) / median(serial)
        cores = os.cpu_count() or 1
        floor = median(serial_cpu) / cores
        print(f"\n(a) compiling {len(programs)} programs:")
        print(
            f"    serial in-process   {median(serial):7.2f} s  "
            f"({median(serial_cpu):.2f} CPU-s: XLA itself uses "
            f"{median(serial_cpu) / median(serial):.2f} cores, so {cores} cores cannot "
            f"beat {floor:.2f} s = {floor / median(serial):.2f}x)"
        )
        print(
            f"    pool of {args.workers} workers   {median(parallel):7.2f} s  "
            f"(+ {median(startups):.2f} s pool start-up)"
        )
        print(
            f"    ratio pool/serial   {ratio_a:7.2f}   target <= 0.65: "
            f"{'met' if ratio_a <= 0.65 else 'NOT met'}"
        )

    if "b" in args.parts:
        tiny = lower(lambda x: x + 1, [jax.ShapeDtypeStruct((4,), jnp.float32)])
        x = np.ones(4, np.float32)
        executable, _ = compile_program(tiny, disk_cache=False)
        with Pool(1, cache_dir=fresh_dir("b-")) as pool:
            round_trips(pool, tiny, x, 200)
            round_trips(pool, tiny, x, 200, submit=True)
            in_process_runs(executable, x, 200)
            pool_times, submit_times, local_times = [], [], []
            for _ in range(4):
                pool_times += round_trips(pool, tiny, x, args.calls // 4)
                submit_times += round_trips(pool, tiny, x, args.calls // 4, submit=True)
                local_times += in_process_runs(executable, x, args.calls // 4)
        rt = median(pool_times) * 1e6
        local = median(local_times) * 1e6
        print("\n(b) tiny program, sequential calls (median):")
        print(
            f"    pool round trip     {rt:7.1f} us   "
            f"(p90 {np.percentile(pool_times, 90) * 1e6:.1f} us)"
        )
        print(f"    submit + result     {median(submit_times) * 1e6:7.1f} us   (manager reads)")
        print(f"    in-process run      {local:7.1f} us")
        print(
            f"    ratio               {rt / local:7.1f}   target median < 150 us: "
            f"{'met' if rt < 150 else 'NOT met'}"
        )

    if "c" in args.parts:
        big = lower(
            lambda s: jnp.full((BIG,), 1.0, jnp.float32) * s,
            [jax.ShapeDtypeStruct((), jnp.float32)],
        )
        cache_c = fresh_dir("c-")
        big_exe, _ = compile_program(big, cache_dir=cache_c)
        scalar = np.float32(3.0)
        with (
            Pool(1, cache_dir=cache_c) as pool,
            concurrent.futures.ProcessPoolExecutor(
                1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_executor_init,
                initargs=(big, cache_c),
            ) as executor,
        ):
            for _ in range(2):  # warm up all three
                assert pool.run(big, [scalar])[0][-1] == 3.0
                assert big_exe.run([scalar])[0][-1] == 3.0
                assert executor.submit(_executor_run, scalar).result()[-1] == 3.0
            timings: dict[str, list[float]] = {}
            sides = {
                "pool": lambda: pool.run(big, [scalar])[0],
                "in-process": lambda: big_exe.run([scalar])[0],
                "executor": lambda: executor.submit(_executor_run, scalar).result(),
            }
            for _ in range(max(args.repeat, 5)):
                for side, call in sides.items():
                    start = time.perf_counter()
                    out = call()
                    returned = time.perf_counter()
                    # Reading every element: the pool's array maps its pages lazily,
                    # so "returned" alone would hide that cost.
                    total = float(out.sum(dtype=np.float64))
                    read = time.perf_counter()
                    assert total == 3.0 * BIG
                    timings.setdefault(side, []).append(returned - start)
                    timings.setdefault(side + " read", []).append(read - start)
                    del out
        print("\n(c) 64 MiB output (median ms):          returned   returned and read")
        for side in sides:
            print(
                f"    {side:<20} {median(timings[side]) * 1e3:12.1f} "
                f"{median(timings[side + ' read']) * 1e3:14.1f}"
            )
        for suffix in ("", " read"):
            p = median(timings["pool" + suffix])
            loc = median(timings["in-process" + suffix])
            ex = median(timings["executor" + suffix])
            label = "returned and read" if suffix else "returned"
            print(
                f"    {label}: pool/in-process {p / loc:.2f} (target <= 1.5: "
                f"{'met' if p / loc <= 1.5 else 'NOT met'}); pool {ex / p:.2f}x faster than "
                f"ProcessPoolExecutor (target >= 3: {'met' if ex / p >= 3 else 'NOT met'})"
            )

    if "d" in args.parts:
        ready, constructions = [], []
        for _ in range(max(args.repeat, 3)):
            start = time.perf_counter()
            with Pool(args.workers, cache_dir=fresh_dir("d-")) as pool:
                constructions.append(time.perf_counter() - start)
                ready += [w["startup_seconds"] for w in pool.worker_info]
        print("\n(d) worker start to ready:")
        print(
            f"    per worker median   {median(ready):7.3f} s   max {max(ready):.3f} s   "
            f"target < 0.5 s: {'met' if median(ready) < 0.5 else 'NOT met'}"
        )
        print(f"    Pool({args.workers}) ready     {median(constructions):7.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
