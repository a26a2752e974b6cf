"""How fast the parent copies a numpy input into shared memory: a plain copy on the
caller's thread alone, against the pool's Copier streaming it (writes around the caches,
`_pjrt.stream_copy`) on that thread ("Copier 1") and spreading it over 2, 4 and 8 threads
(its own, kept between copies; the copy frees the GIL), and a plain copy over threads
made for each copy.

Usage::

    python benchmarks/bench_copy.py [--mib 1,4,16,64] [--cache hot|cold|both]

Prints, per size, the median ms of each way, alternated, and each one's ratio against
one thread: whether spreading the one copy Pool.run makes of a numpy input pays on this
host, from what size (pool.executor.copier.SPREAD_BYTES), and over how many threads.
Each way is timed twice: "hot", the same copy again at once (both arrays in the CPU's
caches), and "cold", after 256 MiB of other memory was written (as in a call, where the
worker's reads and writes of inputs and outputs come between two copies of the
parent's).
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time
from collections.abc import Callable

import numpy as np
from harness import Side, compare, report, with_environment

from pool.executor.copier import COPY_THREADS_VARIABLE, SPREAD_BYTES, STREAM_BYTES, Copier

PAGE = 4096


def one_thread(memory: mmap.mmap, array: np.ndarray) -> None:
    memoryview(memory)[: array.nbytes] = array.view(np.uint8).data  # as worker.wire.shm.write


def copier(way: Copier, k: int) -> Callable[[mmap.mmap, np.ndarray], None]:
    """The pool's copy over k threads (PJRT_POOL_COPY_THREADS=k), at any size."""

    def copy(memory: mmap.mmap, array: np.ndarray) -> None:
        destination = memoryview(memory)[: array.nbytes]
        source = array.view(np.uint8).reshape(-1)
        with_environment(COPY_THREADS_VARIABLE, str(k), lambda: way.copy(destination, source))

    return copy


def fresh_threads(k: int) -> Callable[[mmap.mmap, np.ndarray], None]:
    """The copy over k threads made for it (what a Copier's kept threads spare)."""

    def copy(memory: mmap.mmap, array: np.ndarray) -> None:
        destination = np.frombuffer(memory, np.uint8, count=array.nbytes)
        source = array.view(np.uint8).reshape(-1)
        step = -(-array.nbytes // k // PAGE) * PAGE
        parts = [
            (destination[i : i + step], source[i : i + step])
            for i in range(step, array.nbytes, step)
        ]
        rest = [threading.Thread(target=np.copyto, args=part) for part in parts]
        for thread in rest:
            thread.start()
        np.copyto(destination[:step], source[:step])
        for thread in rest:
            thread.join()

    return copy


Copy = Callable[[mmap.mmap, np.ndarray], None]


def timed(
    way: Copy, memory: mmap.mmap, array: np.ndarray, evict: np.ndarray | None
) -> Callable[[], float]:
    """A side that measures itself: the seconds of one copy, after writing `evict` (256 MiB of other
    memory, which pushes both arrays out of every cache level) where it is given."""

    def measure() -> float:
        if evict is not None:
            np.add(evict, 1, out=evict)
        start = time.perf_counter()
        way(memory, array)
        return time.perf_counter() - start

    return measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="1,4,16,64")
    parser.add_argument("--cache", choices=("hot", "cold", "both"), default="both")
    args = parser.parse_args()
    scratch = np.zeros(64 << 20, np.float32)  # 256 MiB, written between cold copies
    # Every size spread and streamed, to show where each starts to pay.
    spreading = Copier(spread_bytes=0, stream_bytes=0)
    print(f"bench_copy: {os.cpu_count()} CPUs; the pool spreads copies of "
          f"{SPREAD_BYTES >> 20} MiB or more, streams those of "
          f"{STREAM_BYTES >> 20} MiB or more")  # fmt: skip
    ways = {"1 thread": one_thread} | {f"Copier {k}": copier(spreading, k) for k in (1, 2, 4, 8)}
    ways |= {"4 fresh threads": fresh_threads(4)}
    try:
        for mib in map(int, args.mib.split(",")):
            size = mib << 20
            fd = os.memfd_create("bench-copy")
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
            os.close(fd)
            array = np.random.default_rng(0).random(size // 4, dtype=np.float32)
            one_thread(memory, array)  # the pages faulted in once, as a reused segment's are
            for cache in ("hot", "cold") if args.cache == "both" else (args.cache,):
                evict = scratch if cache == "cold" else None
                sides = [
                    Side(name, timed(way, memory, array, evict), measures=True)
                    for name, way in ways.items()
                ]
                rounds = max(5, (400 if cache == "hot" else 40) // mib)
                report(compare(sides, rounds), f"{mib} MiB, {cache}")
            memory.close()
    finally:
        spreading.close()


if __name__ == "__main__":
    main()
