"""Benchmark the worker pool against in-process baselines measured in the same run.

Usage::

    python benchmarks/bench_pool.py [--workers N] [--calls N] [--repeat N] [--parts abcde]

(a) Parallel compile. The example programs (examples, lowered first and
    outside every timer) are compiled with a Pool of --workers workers
    (default: the CPU count) into a fresh cache directory, against compiling
    them one after another in this process (compile_program, disk_cache=False).
    Pool start-up is timed apart. Target: pool wall time <= 0.65x serial.
    Passes alternate which side goes first; medians over --repeat passes.

(b) Round trip. pool.run on the tiny program (x + 1, float32[4]), sequential
    calls after a warm-up, and pool.submit(...).result(), whose reply the
    waiting thread reads (as run does; the manager reads it when the reply
    comes first), against the floor of any design that runs the
    program in another process and wakes both sides: a bare round trip of one
    byte between two Python processes over a Unix socketpair (the other side
    echoes it) plus Executable.run of the same program in this process. The
    round trip is measured two ways: both sides spinning on a non-blocking
    recv (the fair floor: the pool and its workers poll before they sleep,
    so neither pays a wake-up; issue 33) and both blocking in recv (on a VM a
    wake-up can cost more than the pool's whole call). All six alternate in
    batches; per-call medians. Targets: run <= 2x the spinning floor (1.5x
    the ambition), submit + result <= 3x.

(c) 64 MiB output. A program that returns a 64 MiB float32 array, run through
    the pool, against Executable.run in this process (target: <= 1.5x), and
    against a concurrent.futures.ProcessPoolExecutor whose worker runs the
    same executable in-process and returns the array pickled, as plain
    process pools do (target: the pool >= 3x faster).

(d) Worker start-up: spawn to Ready (plugin loaded, handshake done) for each
    worker of a fresh pool, and the whole Pool() construction. Target < 0.5 s.

(e) Throughput. --tasks submits of the tiny program on a Pool(2), from one
    thread and from 8 threads at once, then every result: tasks per second,
    against the floor's rate (one bare round trip plus one in-process run
    per task, as in (b)).

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
from pathlib import Path
from typing import Any

_SCRATCH = tempfile.mkdtemp(prefix="bench-pool-")
os.environ["PJRT_POOL_CACHE_DIR"] = str(Path(_SCRATCH) / "default-cache")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pool import Pool, compile_program, lower  # noqa: E402
from pool.examples import example_programs  # noqa: E402
from pool.spawn import HUGE_PAGES_TUNABLE  # noqa: E402
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

    def round_trips(self, calls: int) -> list[float]:
        """Seconds per bare round trip of one byte (spinning or blocking in recv)."""
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
        return times

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


def part_a(programs: list[LoweredProgram], workers: int, repeat: int) -> None:
    """(a): compiling every example serially in this process against a pool, alternated."""
    serial, serial_cpu, parallel, startups = [], [], [], []
    for rep in range(repeat):
        if rep % 2 == 0:
            wall_s, cpu_s = serial_compile(programs)
            startup, wall = pool_compile(programs, workers)
        else:
            startup, wall = pool_compile(programs, workers)
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
        f"    pool of {workers} workers   {median(parallel):7.2f} s  "
        f"(+ {median(startups):.2f} s pool start-up)"
    )
    print(
        f"    ratio pool/serial   {ratio_a:7.2f}   target <= 0.65: "
        f"{'met' if ratio_a <= 0.65 else 'NOT met'}"
    )


class Tiny:
    """The tiny program of (b) and (e), its input, and its executable in this process."""

    def __init__(self) -> None:
        self.program = lower(lambda x: x + 1, [jax.ShapeDtypeStruct((4,), jnp.float32)])
        self.x = np.ones(4, np.float32)
        self.executable, _ = compile_program(self.program, disk_cache=False)


def sequential_calls(tiny: Tiny, calls: int) -> dict[str, list[float]]:
    """(b)'s timings, in seconds per call: the pool's run and submit, the run in this
    process, and bare round trips between two processes (blocking and spinning), taken
    in eight alternated batches."""
    tiny_args = (tiny.program, tiny.x)
    # The spinning echo burns a core while it waits; it runs only in its batches.
    blocking = Echo(spin=False)
    times: dict[str, list[float]] = {"pool": [], "submit": [], "local": [], "block": [], "spin": []}
    with Pool(1, cache_dir=fresh_dir("b-")) as pool:
        round_trips(pool, *tiny_args, 200)
        round_trips(pool, *tiny_args, 200, submit=True)
        in_process_runs(tiny.executable, tiny.x, 200)
        blocking.round_trips(200)
        batch = max(calls // 8, 1)
        for _ in range(8):
            times["pool"] += round_trips(pool, *tiny_args, batch)
            times["submit"] += round_trips(pool, *tiny_args, batch, submit=True)
            times["local"] += in_process_runs(tiny.executable, tiny.x, batch)
            times["block"] += blocking.round_trips(batch)
            spinning = Echo(spin=True)
            spinning.round_trips(min(batch, 50))  # its start-up, untimed
            times["spin"] += spinning.round_trips(batch)
            spinning.close()
    blocking.close()
    return times


def report_b(times: dict[str, list[float]]) -> None:
    """(b): the pool's round trip against the floors two bare processes set."""
    rt, submitted, local, bare, bare_spin = (
        median(times[side]) * 1e6 for side in ("pool", "submit", "local", "block", "spin")
    )
    floor_us, spin_floor_us = bare + local, bare_spin + local
    print("\n(b) tiny program, sequential calls (median):")
    print(f"    bare round trip     {bare_spin:7.1f} us   (two processes, one byte, spinning)")
    print(f"    bare round trip     {bare:7.1f} us   (two processes, one byte, blocking recv)")
    print(f"    in-process run      {local:7.1f} us")
    print(f"    spinning floor      {spin_floor_us:7.1f} us   (spinning round trip + run)")
    print(f"    blocking floor      {floor_us:7.1f} us   (blocking round trip + run)")
    print(
        f"    pool.run            {rt:7.1f} us   "
        f"(p90 {np.percentile(times['pool'], 90) * 1e6:.1f} us)   "
        f"{rt / spin_floor_us:5.2f}x the spinning floor, target <= 2 "
        f"(ambition 1.5): {'met' if rt <= 2 * spin_floor_us else 'NOT met'}; "
        f"{rt / floor_us:5.2f}x the blocking floor"
    )
    print(
        f"    submit + result     {submitted:7.1f} us   (result() reads)  "
        f"{submitted / spin_floor_us:5.2f}x the spinning floor, target <= 3: "
        f"{'met' if submitted <= 3 * spin_floor_us else 'NOT met'}"
    )


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
        sides = {
            "pool": lambda: pool.run(big, [scalar])[0],
            "pool, 4 KiB pages": lambda: small_pages.run(big, [scalar])[0],
            "in-process": lambda: big_exe.run([scalar])[0],
            "executor": lambda: executor.submit(_executor_run, scalar).result(),
        }
        timings = _timed_big_outputs(sides, max(repeat, 5))
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
        small = median(timings["pool, 4 KiB pages" + suffix])
        label = "returned and read" if suffix else "returned"
        print(f"    {label}: pool/pool with 4 KiB pages {p / small:.2f}")
        print(
            f"    {label}: pool/in-process {p / loc:.2f} (target <= 1.5: "
            f"{'met' if p / loc <= 1.5 else 'NOT met'}); pool {ex / p:.2f}x faster than "
            f"ProcessPoolExecutor (target >= 3: {'met' if ex / p >= 3 else 'NOT met'})"
        )


def _timed_big_outputs(sides: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Each side's seconds to return its 64 MiB output, and to return it and read it all,
    after two warm-up calls each."""
    for _ in range(2):  # warm up all four
        for call in sides.values():
            assert call()[-1] == 3.0
    timings: dict[str, list[float]] = {}
    for _ in range(rounds):
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
    return timings


def part_d(workers: int, repeat: int) -> None:
    """(d): how long a worker takes to start, and a Pool to be ready."""
    ready, constructions = [], []
    for _ in range(max(repeat, 3)):
        start = time.perf_counter()
        with Pool(workers, cache_dir=fresh_dir("d-")) as pool:
            constructions.append(time.perf_counter() - start)
            ready += [w["startup_seconds"] for w in pool.worker_info]
    print("\n(d) worker start to ready:")
    print(
        f"    per worker median   {median(ready):7.3f} s   max {max(ready):.3f} s   "
        f"target < 0.5 s: {'met' if median(ready) < 0.5 else 'NOT met'}"
    )
    print(f"    Pool({workers}) ready     {median(constructions):7.3f} s")


def part_e(tiny: Tiny, times: dict[str, list[float]], tasks: int, repeat: int) -> None:
    """(e): submits from one and from eight threads on Pool(2), against the rate of a
    blocking round trip and a run each ((b)'s floor)."""
    floor_rate = 1 / (median(times["block"]) + median(times["local"]))
    with Pool(2, cache_dir=fresh_dir("e-")) as pool:
        throughput(pool, tiny.program, tiny.x, 1000, 1)  # both workers load the program
        throughput(pool, tiny.program, tiny.x, 1000, 8)
        rates: dict[int, list[float]] = {1: [], 8: []}
        for _ in range(max(repeat, 3)):
            for threads in rates:
                rates[threads].append(throughput(pool, tiny.program, tiny.x, tasks, threads))
    print(f"\n(e) throughput, {tasks} submits on Pool(2), then every result (median):")
    print(f"    floor               {floor_rate:9.0f} tasks/s   (a round trip + a run each)")
    for threads, measured in rates.items():
        rate = median(measured)
        print(
            f"    {threads} thread{'s' if threads > 1 else ' '}"
            f"           {rate:9.0f} tasks/s   "
            f"{rate / floor_rate:5.2f}x the floor's rate"
        )


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
    times = sequential_calls(tiny, args.calls) if set("be") & set(args.parts) else {}
    if "b" in args.parts:
        report_b(times)
    if "c" in args.parts:
        part_c(args.repeat)
    if "d" in args.parts:
        part_d(args.workers, args.repeat)
    if "e" in args.parts:
        part_e(tiny, times, args.tasks, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
