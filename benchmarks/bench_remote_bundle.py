"""Benchmark loading one program out of a bundle at a URL against the same bundle as a file.

Usage::

    python benchmarks/bench_remote_bundle.py [--programs 100] [--rounds 9] [--latency-ms 20]

The parent lowers and compiles --programs small programs (bench_remote's),
bundles them (pjrt-pool bundle create's writer) and puts the bundle on
moto's S3 server on the loopback. Then, round after round, interleaved, it
times load_manifest(...) and one Manifest.run of a program (another each
round, the same on every side) from: the local file; s3:// on the
loopback; s3:// from a server answering every request --latency-ms late (a
distant store), alternated (benchmarks/harness.py). It prints medians,
the ratios against the local file, and what the remote reads cost: requests
and bytes, against the bundle's size.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_remote import S3_ENV, lowered_programs, s3_server
from harness import Side, compare, report


def make_bundle(count: int, size: int, scratch: Path) -> tuple[Path, list[str]]:
    """Compiles count programs into a cache and bundles them; returns the bundle and names."""
    import worker
    from worker.bundle.writer import create_bundle
    from worker.cache import DiskCache
    from worker.records import ProgramSpec

    cache = scratch / "cache"
    specs = []
    for k, program in enumerate(lowered_programs(count, size)):
        executable, _ = worker.compile_program(program, cache_dir=cache, remote=False)
        specs.append(ProgramSpec.from_executable(f"p{k}", executable))
    bundle = scratch / "app.bundle"
    create_bundle(bundle, [(spec, DiskCache(cache, create=False), "") for spec in specs])
    return bundle, [spec.name for spec in specs]


def load_one(where: str, name: str, x: object) -> tuple[float, int, int]:
    """Seconds to open the bundle and run one program; the requests and bytes it read."""
    from pool.manifest import load_manifest

    start = time.perf_counter()
    manifest = load_manifest(where)
    manifest.run(name, [x])
    seconds = time.perf_counter() - start
    archive = manifest.bundle.archive
    return seconds, getattr(archive, "requests", 0), getattr(archive, "bytes_read", 0)


def opening(where: str, endpoint: str | None, names: list[str], x: object) -> Any:
    """A side's sample: load_one of another program each round (the same one on every side
    in a round), from `where`, reached through `endpoint` (an s3:// URL's server)."""
    rounds = itertools.count()

    def measure() -> dict[str, float]:
        if endpoint is not None:
            os.environ["AWS_ENDPOINT_URL"] = endpoint
        name = names[(next(rounds) * 37) % len(names)]
        seconds, requests, read = load_one(where, name, x)
        return {"wall": seconds, "requests": requests, "bytes": read}

    return measure


def main() -> None:
    """Runs the benchmark and prints one line per place."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=100)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    args = parser.parse_args()
    os.environ.update(S3_ENV)
    import boto3
    import numpy as np

    servers = [s3_server(), s3_server(args.latency_ms / 1e3)]
    (_, endpoint), (_, delayed) = servers
    x = np.ones((args.size, args.size), np.float32)
    with tempfile.TemporaryDirectory() as scratch:
        bundle, names = make_bundle(args.programs, args.size, Path(scratch))
        for url in (endpoint, delayed):
            s3 = boto3.client("s3", endpoint_url=url)
            s3.put_object(Bucket="bench", Key="apps/app.bundle", Body=bundle.read_bytes())
        places = [
            ("local file", None, str(bundle)),
            ("s3 loopback", endpoint, "s3://bench/apps/app.bundle"),
            (f"s3 +{args.latency_ms:g} ms", delayed, "s3://bench/apps/app.bundle"),
        ]
        load_one(str(bundle), names[0], x)  # the plugin loads once, outside the rounds
        sides = [Side(label, opening(where, endpoint, names, x), measures=True)
                 for label, endpoint, where in places]  # fmt: skip
        samples = compare(sides, args.rounds, warmup=0)
        size = bundle.stat().st_size
        title = f"bundle of {args.programs} programs, {size / 1024:.0f} KiB: open, run one"
        report(samples, title)
        for label, _, _ in places[1:]:
            requests, read = samples.median(label, "requests"), samples.median(label, "bytes")
            print(f"  {label}: {requests:.0f} requests, {read / 1024:.0f} KiB read "
                  f"({read / size:.1%} of the bundle)")  # fmt: skip
    for child, _ in servers:
        child.kill()
        child.wait()


if __name__ == "__main__":
    main()
