"""Measure what the directory fsync after each publish costs a cache write.

Usage::

    python benchmarks/bench_publish_fsync.py [--count N] [--rounds N] [--dir DIR]

DiskCache.publish writes an entry to a temporary file, fsyncs it, renames
it into entries/ and then fsyncs entries/ itself, so that the rename
survives a power loss (worker/cache/atomic.py). This times publish with
that last fsync and, as the baseline in the same run, with PendingFile.sync
replaced by a no-op (the only change), alternating the two (benchmarks/
harness.py) so that the disk's state is shared. For each payload size it prints the median
time per publish of each and their ratio. The directory defaults to a fresh
one under the system's temporary directory: pass --dir to measure the file
system a cache really lives on.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from harness import Side, compare, report

from worker.cache import DiskCache
from worker.cache.atomic import PendingFile
from worker.identity.keys import key_of

SIZES = (4 << 10, 256 << 10, 4 << 20)


def publishing(cache: DiskCache, size: int, count: int, fsync: bool) -> Callable[[], float]:
    """A side's call that measures itself: seconds per publish of `count` fresh entries of
    `size` bytes, with the directory fsync or without it (PendingFile.sync a no-op then)."""
    payload, numbers = os.urandom(size), itertools.count()
    real_sync = PendingFile.sync

    def measure() -> float:
        if not fsync:
            PendingFile.sync = lambda self: None  # type: ignore[method-assign]
        try:
            start = time.perf_counter()
            for _ in range(count):
                parts = {"bench": "publish", "index": next(numbers), "fsync": fsync, "size": size}
                if not cache.publish(key_of(parts), parts, {}, payload):
                    raise SystemExit(f"the cache did not store an entry: {cache.problem}")
            return (time.perf_counter() - start) / count
        finally:
            PendingFile.sync = real_sync  # type: ignore[method-assign]

    return measure


def main() -> None:
    """Runs the measurement and prints a table per payload size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=40, help="publishes per sample")
    parser.add_argument("--rounds", type=int, default=5, help="samples per side")
    parser.add_argument("--dir", default=None, help="where to make the cache (default: a tmpdir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        print(f"cache under {root}; a sample is the time per publish of {args.count} entries")
        for size in SIZES:
            cache = DiskCache(Path(root) / f"cache-{size}", max_size=1 << 40)
            count = args.count
            sides = [
                Side("without the directory fsync", publishing(cache, size, count, False), True),
                Side("publish (with it)", publishing(cache, size, count, True), True),
            ]
            report(compare(sides, args.rounds), f"payload {size >> 10} KiB")


if __name__ == "__main__":
    main()
