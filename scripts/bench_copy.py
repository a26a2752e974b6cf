"""How fast the parent copies a numpy input into shared memory: one thread, as Pool.run
does, against the same copy split over 2, 4 and 8 threads (numpy's copyto frees the GIL).

Usage::

    python scripts/bench_copy.py [--mib 4,16,64,256]

Prints, per size, the median ms of each way, alternated, and the threaded ones' ratio
against one thread: whether splitting the one copy Pool.run makes of a numpy input would
pay on this host.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PAGE = 4096


def one_thread(memory: mmap.mmap, array: np.ndarray) -> None:
    memoryview(memory)[: array.nbytes] = array.view(np.uint8).data  # as worker.wire.shm.write


def threaded(threads: ThreadPoolExecutor, k: int) -> Callable[[mmap.mmap, np.ndarray], None]:
    def copy(memory: mmap.mmap, array: np.ndarray) -> None:
        destination = np.frombuffer(memory, np.uint8, count=array.nbytes)
        source = array.view(np.uint8).reshape(-1)
        step = -(-array.nbytes // k // PAGE) * PAGE
        rest = [
            threads.submit(np.copyto, destination[i : i + step], source[i : i + step])
            for i in range(step, array.nbytes, step)
        ]
        np.copyto(destination[:step], source[:step])
        for future in rest:
            future.result()

    return copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="4,16,64,256")
    args = parser.parse_args()
    with ThreadPoolExecutor(8) as threads:
        ways = {"1 thread": one_thread} | {f"{k} threads": threaded(threads, k) for k in (2, 4, 8)}
        for mib in map(int, args.mib.split(",")):
            size = mib << 20
            fd = os.memfd_create("bench-copy")
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
            os.close(fd)
            array = np.random.default_rng(0).random(size // 4, dtype=np.float32)
            one_thread(memory, array)  # the pages faulted in once, as a reused segment's are
            times: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(max(5, 400 // mib)):
                for name, way in ways.items():
                    started = time.perf_counter()
                    way(memory, array)
                    times[name].append(time.perf_counter() - started)
            base = statistics.median(times["1 thread"])
            cells = [
                f"{name} {statistics.median(t) * 1e3:.3f} ms ({statistics.median(t) / base:.2f}x)"
                for name, t in times.items()
            ]
            print(f"{mib} MiB: " + ", ".join(cells))
            memory.close()


if __name__ == "__main__":
    main()
