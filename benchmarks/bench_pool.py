"""Benchmark the worker pool against in-process baselines measured in the same run.

Usage::

    python benchmarks/bench_pool.py [--workers N] [--calls N] [--repeat N] [--tasks N]
                                    [--parts abcde]

Every part alternates its sides and prints medians and ratios against its
baseline (benchmarks/harness.py).

(a) Parallel compile. The example programs (pool.examples, lowered first and
    outside every timer) are compiled with a Pool of --workers workers
    (default: the CPU count) into a fresh cache directory, against compiling
    them one after another in this process (compile_program, disk_cache=False).
    Pool start-up is timed apart. Target: pool wall time <= 0.65x serial;
    --repeat rounds.

(b) Round trip. pool.run on the tiny program (x + 1, float32[4]), sequential
    calls after a warm-up, and pool.submit(...).result(), whose reply the
    waiting thread reads (as run does; the manager reads it when the reply
    comes first), against the floor of any design that runs the
    program in another process and wakes both sides: a bare round trip of one
    byte between two Python processes over a Unix socketpair (the other side
    echoes it) plus Executable.run of the same program in this process. The
    round trip is measured two ways: both sides spinning on a non-blocking
    recv (the fair floor: the pool and its workers poll before they sleep,
    so neither pays a wake-up) and both blocking in recv (on a VM a wake-up
    can cost more than the pool's whole call). A sample is the median of a
    batch of --calls / 8 calls; eight rounds. Targets: run <= 2x the
    spinning floor (1.5x the ambition), submit + result <= 3x.

(c) 64 MiB output. A program that returns a 64 MiB float32 array, run through
    the pool, against Executable.run in this process (target: <= 1.5x), and
    against a concurrent.futures.ProcessPoolExecutor whose worker runs the
    same executable in-process and returns the array pickled, as plain
    process pools do (target: the pool >= 3x faster).

(d) Worker start-up: spawn to Ready (plugin loaded, handshake done) for each
    worker of a fresh pool, and the whole Pool() construction, against a
    fresh interpreter that imports numpy. Target < 0.5 s.

(e) Throughput. --tasks submits of the tiny program on a Pool(2), from one
    thread and from 8 threads at once, then every result: the time per task
    against the floor's (one bare round trip plus one in-process run per
    task, as in (b)).

Cache directories are fresh temporary ones; the user's cache is untouched.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_SCRATCH = tempfile.mkdtemp(prefix="bench-pool-")
os.environ["PJRT_POOL_CACHE_DIR"] = str(Path(_SCRATCH) / "default-cache")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from harness import Samples, Side, compare, median_per_call, ratio_line, report  # noqa: E402

from pool import Pool, compile_program, lower  # noqa: E402
from pool.examples import example_programs  # noqa: E402
from pool.spawn import HUGE_PAGES_TUNABLE  # noqa: E402
from worker import LoweredProgram  # noqa: E402

BIG = 1 << 24  # float32 elements: 64 MiB


def fresh_dir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix, dir=_SCRATCH)


# -- (a) ---------------------------------------------------------------------


def serial_compile(programs: list[LoweredProgram]) -> dict[str, float]:
    """Compiles one after another in this process: wall and CPU seconds."""
    cpu = time.process_time()
    start = time.perf_counter()
    for program in programs:
        _, stats = compile_program(program, disk_cache=False)
        assert stats.compiled == 1
    return {"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu}


def pool_compile(programs: list[LoweredProgram], workers: int) -> dict[str, float]:
    """compile_many on a fresh Pool: its wall seconds, and the pool's start apart."""
    start = time.perf_counter()
    with Pool(workers, cache_dir=fresh_dir("a-")) as pool:
        ready = time.perf_counter()
        pool.compile_many(programs)
        done = time.perf_counter()
        assert pool.statistics.compiled == len(programs)
    return {"wall": done - ready, "start": ready - start}


# -- (b) ---------------------------------------------------------------------


def round_trip(
    pool: Pool, program: LoweredProgram, x: np.ndarray, calls: int, submit: bool = False
) -> float:
    """The median seconds of `calls` pool.run calls (pool.submit(...).result(), with submit)."""
    if submit:
        return median_per_call(lambda: pool.submit(program, [x]).result(), calls)
    return median_per_call(lambda: pool.run(program, [x]), calls)


_ECHO = """
import socket, sys
peer = socket.socket(fileno=int(sys.argv[1]))
if sys.argv[2] == "spin":
    peer.setblocking(False)
    while True:
        try:
            byte = peer.recv(1)
        except BlockingIOError:
            continue
        if not byte:
            break
        peer.send(byte)
else:
    while (byte := peer.recv(1)):
        peer.sendall(byte)
"""


class Echo:
    """Another Python process that echoes each byte sent to it over a socketpair.

    With spin, both sides poll a non-blocking socket instead of sleeping in
    recv: what is left is the cost of the two system calls and the hops
    between the processes, with no wake-up of a sleeping thread.
    """

    def __init__(self, spin: bool) -> None:
        self.spin = spin
        self.sock, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _ECHO, str(theirs.fileno()), "spin" if spin else "block"],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.sock.setblocking(not spin)

    def round_trips(self, calls: int) -> float:
        """The median seconds of `calls` bare round trips of one byte (spinning or blocking
        in recv)."""
        times = []
        sock = self.sock
        spin = self.spin
        for _ in range(calls):
            start = time.perf_counter()
            sock.send(b"x")
            if spin:
                while True:
                    try:
                        if sock.recv(1):
                            break
                    except BlockingIOError:
                        continue
                    raise EOFError("the echo process ended")
            else:
                sock.recv(1)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def close(self) -> None:
        self.sock.close()
        self.process.wait()


def throughput(
    pool: Pool, program: LoweredProgram, x: np.ndarray, tasks: int, threads: int
) -> float:
    """Tasks per second: `tasks` submits split over `threads` threads, then every result."""

    def submit_share(count: int, futures: list[Any]) -> None:
        futures.extend(pool.submit(program, [x]) for _ in range(count))

    shares: list[list[Any]] = [[] for _ in range(threads)]
    start = time.perf_counter()
    if threads == 1:
        submit_share(tasks, shares[0])
    else:
        runners = [
            threading.Thread(target=submit_share, args=(tasks // threads, share))
            for share in shares
        ]
        for runner in runners:
            runner.start()
        for runner in runners:
            runner.join()
    for share in shares:
        for future in share:
            future.result()
    return sum(len(share) for share in shares) / (time.perf_counter() - start)


def in_process_runs(executable: Any, x: np.ndarray, calls: int) -> float:
    """The median seconds of `calls` runs of the executable in this process."""
    return median_per_call(lambda: executable.run([x]), calls)


def spinning_round_trips(calls: int) -> float:
    """Echo(spin=True).round_trips of a fresh echo process, which burns a core while it waits
    and so runs only for its own sample."""
    echo = Echo(spin=True)
    try:
        echo.round_trips(min(calls, 50))  # its start-up, untimed
        return echo.round_trips(calls)
    finally:
        echo.close()


# -- (c) ---------------------------------------------------------------------

_executor_executable: Any = None


def _executor_init(program: LoweredProgram, cache_dir: str) -> None:
    global _executor_executable
    _executor_executable, _ = compile_program(program, cache_dir=cache_dir)


def _executor_run(x: np.ndarray) -> np.ndarray:
    return _executor_executable.run([x])[0]


def part_a(programs: list[LoweredProgram], workers: int, repeat: int) -> None:
    """(a): compiling every example serially in this process against a pool, alternated."""
    sides = [
        Side("serial, in this process", lambda: serial_compile(programs), measures=True),
        Side(f"Pool({workers}).compile_many", lambda: pool_compile(programs, workers), True),
    ]
    samples = compare(sides, repeat, warmup=0)
    title = f"\n(a) compiling {len(programs)} programs"
    report(samples, title, unit="s", goals={sides[1].name: 0.65})
    serial, cpu = samples.median(sides[0].name), samples.median(sides[0].name, "cpu")
    cores = os.cpu_count() or 1
    print(f"  the pool's start apart: {samples.median(sides[1].name, 'start'):.2f} s; XLA "
          f"itself keeps {cpu / serial:.2f} cores busy, so {cores} cores cannot beat "
          f"{cpu / cores / serial:.2f}x")  # fmt: skip


class Tiny:
    """The tiny program of (b) and (e), its input, and its executable in this process."""

    def __init__(self) -> None:
        self.program = lower(lambda x: x + 1, [jax.ShapeDtypeStruct((4,), jnp.float32)])
        self.x = np.ones(4, np.float32)
        self.executable, _ = compile_program(self.program, disk_cache=False)


def sequential_calls(tiny: Tiny, calls: int) -> Samples:
    """(b)'s sides, each sample the median seconds of a batch of calls: the pool's run and
    submit, the run in this process, and bare round trips between two processes (blocking
    and spinning); eight rounds."""
    tiny_args = (tiny.program, tiny.x)
    blocking = Echo(spin=False)
    batch = max(calls // 8, 1)
    with Pool(1, cache_dir=fresh_dir("b-")) as pool:
        sides = [
            Side("in-process run", lambda: in_process_runs(tiny.executable, tiny.x, batch), True),
            Side("bare round trip, spinning", lambda: spinning_round_trips(batch), True),
            Side("bare round trip, blocking", lambda: blocking.round_trips(batch), True),
            Side("pool.run", lambda: round_trip(pool, *tiny_args, batch), True),
            Side("submit + result", lambda: round_trip(pool, *tiny_args, batch, True), True),
        ]
        samples = compare(sides, 8)
    blocking.close()
    return samples


def report_b(samples: Samples) -> None:
    """(b): the pool's round trip against the floors two bare processes set (a bare round
    trip plus the run in one process)."""
    local = samples.median("in-process run")
    spinning = samples.median("bare round trip, spinning") + local
    blocking = samples.median("bare round trip, blocking") + local
    title = "\n(b) tiny program, sequential calls, each against the run in process"
    report(samples, title, unit="us")
    print("  against the floors (a bare round trip between two processes + the run):")
    ratio_line("spinning floor", spinning, spinning, "us")
    ratio_line("pool.run", samples.median("pool.run"), spinning, "us", goal=2)
    ratio_line("submit + result", samples.median("submit + result"), spinning, "us", goal=3)
    ratio_line("blocking floor", blocking, blocking, "us")
    ratio_line("pool.run", samples.median("pool.run"), blocking, "us")


def _pool_with_small_pages(cache_dir: str) -> Pool:
    """A Pool(1) whose worker runs with glibc's huge pages turned off (see
    pool.spawn.with_huge_pages): what they save on the plugin's own output buffer."""
    saved = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = f"{HUGE_PAGES_TUNABLE}=0"
    try:
        return Pool(1, cache_dir=cache_dir)
    finally:
        if saved is None:
            del os.environ["GLIBC_TUNABLES"]
        else:
            os.environ["GLIBC_TUNABLES"] = saved


def part_c(repeat: int) -> None:
    """(c): a 64 MiB output through the pool, in this process and through
    ProcessPoolExecutor, returned and read."""
    big = lower(
        lambda s: jnp.full((BIG,), 1.0, jnp.float32) * s,
        [jax.ShapeDtypeStruct((), jnp.float32)],
    )
    cache_c = fresh_dir("c-")
    big_exe, _ = compile_program(big, cache_dir=cache_c)
    scalar = np.float32(3.0)
    with (
        _pool_with_small_pages(cache_c) as small_pages,
        Pool(1, cache_dir=cache_c) as pool,
        concurrent.futures.ProcessPoolExecutor(
            1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_executor_init,
            initargs=(big, cache_c),
        ) as executor,
    ):
        calls = {
            "in-process": lambda: big_exe.run([scalar])[0],
            "pool": lambda: pool.run(big, [scalar])[0],
            "pool, 4 KiB pages": lambda: small_pages.run(big, [scalar])[0],
            "ProcessPoolExecutor": lambda: executor.submit(_executor_run, scalar).result(),
        }
        sides = [Side(name, big_output(call), measures=True) for name, call in calls.items()]
        samples = compare(sides, max(repeat, 5), warmup=2)
    report(samples, "\n(c) 64 MiB output, returned", goals={"pool": 1.5})
    report(samples, "(c) 64 MiB output, returned and read", figure="read", goals={"pool": 1.5})


def big_output(call: Callable[[], np.ndarray]) -> Callable[[], dict[str, float]]:
    """A side's sample: seconds to return the 64 MiB output ("wall"), and to return it and read
    it all ("read": the pool's array maps its pages lazily, so "returned" alone would hide
    that cost)."""

    def measure() -> dict[str, float]:
        start = time.perf_counter()
        out = call()
        returned = time.perf_counter()
        total = float(out.sum(dtype=np.float64))
        read = time.perf_counter()
        assert total == 3.0 * BIG
        return {"wall": returned - start, "read": read - start}

    return measure


NUMPY = (sys.executable, "-c", "import numpy")
"""A fresh interpreter that imports numpy: the floor of any process a worker could be."""


def part_d(workers: int, repeat: int) -> None:
    """(d): how long a worker takes to start, and a Pool to be ready, against a fresh
    interpreter that imports numpy."""

    def pool_start() -> dict[str, float]:
        start = time.perf_counter()
        with Pool(workers, cache_dir=fresh_dir("d-")) as pool:
            wall = time.perf_counter() - start
            ready = [w["startup_seconds"] for w in pool.worker_info]
        return {"wall": wall, "worker": statistics.median(ready)}

    sides = [
        Side("python -c 'import numpy'", lambda: subprocess.run(NUMPY, check=True)),
        Side(f"Pool({workers}) ready", pool_start, measures=True),
    ]
    samples = compare(sides, max(repeat, 3))
    report(samples, "\n(d) start-up", unit="s")
    numpy = samples.median(sides[0].name)
    worker = samples.median(sides[1].name, "worker")
    ratio_line("a worker, spawn to Ready (goal < 0.5 s)", worker, numpy, "s")


def part_e(tiny: Tiny, floor: Samples, tasks: int, repeat: int) -> None:
    """(e): submits from one and from eight threads on Pool(2), then every result, against
    the floor's time per task (a blocking round trip and a run each, from (b))."""
    each = floor.median("bare round trip, blocking") + floor.median("in-process run")

    def per_task(threads: int) -> Callable[[], float]:
        return lambda: 1 / throughput(pool, tiny.program, tiny.x, tasks, threads)

    with Pool(2, cache_dir=fresh_dir("e-")) as pool:
        throughput(pool, tiny.program, tiny.x, 1000, 1)  # both workers load the program
        throughput(pool, tiny.program, tiny.x, 1000, 8)
        sides = [
            Side("1 thread", per_task(1), measures=True),
            Side("8 threads", per_task(8), measures=True),
        ]
        samples = compare(sides, max(repeat, 3), warmup=0)
    print(f"\n(e) throughput: {tasks} submits on Pool(2), then every result, a task")
    ratio_line("floor (a round trip and a run)", each, each, "us")
    for side in samples.sides:
        ratio_line(side, samples.median(side), each, "us")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--calls", type=int, default=2000, help="round trips per side in (b)")
    parser.add_argument("--repeat", type=int, default=3, help="passes in (a), runs in (c)")
    parser.add_argument("--tasks", type=int, default=10_000, help="submits per case in (e)")
    parser.add_argument(
        "--parts", default="abcde", help="which parts to run, e.g. b for the round trip only"
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
        part_a(programs, args.workers, args.repeat)
    tiny = Tiny()
    floor = sequential_calls(tiny, args.calls) if set("be") & set(args.parts) else None
    if floor is not None and "b" in args.parts:
        report_b(floor)
    if "c" in args.parts:
        part_c(args.repeat)
    if "d" in args.parts:
        part_d(args.workers, args.repeat)
    if floor is not None and "e" in args.parts:
        part_e(tiny, floor, args.tasks, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
