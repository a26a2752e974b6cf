"""Measure what the directory fsync after each publish costs a cache write.

Usage::

    python benchmarks/bench_publish_fsync.py [--count N] [--dir DIR]

DiskCache.publish writes an entry to a temporary file, fsyncs it, renames
it into entries/ and then fsyncs entries/ itself, so that the rename
survives a power loss (worker/cache/atomic.py). This times publish with
that last fsync and, as the baseline in the same run, with PendingFile.sync
replaced by a no-op (the only change), alternating the two in rounds so
that the disk's state is shared. For each payload size it prints the median
time per publish of each and their ratio. The directory defaults to a fresh
one under the system's temporary directory: pass --dir to measure the file
system a cache really lives on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from worker.cache import DiskCache
from worker.cache.atomic import PendingFile
from worker.identity.keys import key_of

SIZES = (4 << 10, 256 << 10, 4 << 20)
ROUNDS = 5


def _publish_all(cache: DiskCache, tag: str, count: int, size: int) -> list[float]:
    payload = os.urandom(size)
    seconds = []
    for index in range(count):
        parts = {"bench": tag, "index": index, "size": size}
        started = time.perf_counter()
        if not cache.publish(key_of(parts), parts, {}, payload):
            raise SystemExit(f"the cache did not store entry {index}: {cache.problem}")
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    """Runs the measurement and prints one line per payload size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=40, help="publishes per round and kind")
    parser.add_argument("--dir", default=None, help="where to make the cache (default: a tmpdir)")
    args = parser.parse_args()
    real_sync = PendingFile.sync
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        print(f"cache under {root} ({args.count} publishes x {ROUNDS} rounds per kind)")
        for size in SIZES:
            cache = DiskCache(Path(root) / f"cache-{size}", max_size=1 << 40)
            timings: dict[str, list[float]] = {"without": [], "with": []}
            for round_ in range(ROUNDS):
                for kind in ("without", "with") if round_ % 2 == 0 else ("with", "without"):
                    PendingFile.sync = real_sync if kind == "with" else (lambda self: None)
                    try:
                        tag = f"{kind}-{round_}"
                        timings[kind] += _publish_all(cache, tag, args.count, size)
                    finally:
                        PendingFile.sync = real_sync
            without = statistics.median(timings["without"])
            with_ = statistics.median(timings["with"])
            print(
                f"payload {size >> 10:>5} KiB: publish {without * 1e3:7.3f} ms without the "
                f"directory fsync, {with_ * 1e3:7.3f} ms with it: ratio {with_ / without:.2f} "
                f"(+{(with_ - without) * 1e3:.3f} ms)"
            )


if __name__ == "__main__":
    main()
