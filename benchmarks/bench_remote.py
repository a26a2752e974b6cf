"""Benchmark a remote-cache hit against a local-cache hit, and prefetching, in the same run.

Usage::

    python benchmarks/bench_remote.py [--parts hit,prefetch] [--programs 12] [--size 128]
                                      [--latency-ms 20] [--entries 300] [--rounds 3]

Part ``prefetch``: --entries synthetic cache entries (4 KiB random payloads
under real key parts, encoded as the cache encodes entries) are published
through RemoteCache.publish to moto's S3 server answering every request
--latency-ms late (in a process of its own); then they are fetched into
empty local caches one by one (worker.cache.remote.prefetch with
concurrency 1: the same code, sequential) and by prefetch (concurrency 16),
alternated (benchmarks/harness.py) --rounds times; the medians and their
ratio are printed (the goal: at most 1/8). The same from a plain HTTP
server (the entries as files) sleeping as long before each answer. No
program is compiled for it: prefetching verifies and stores entries, it
loads none.

Part ``hit``: the parent lowers --programs small programs (a matmul and a
sin, of --size), then compiles them once with a remote tier, which
publishes each entry there. Then, for each remote (moto's S3 server on the
loopback, the same answering --latency-ms late, and a file:// directory),
one program a round, it times:

- local hit: compile_program with the warm local cache directory;
- remote hit: compile_program with another local cache directory (made
  beforehand, without the entry), so the entry comes from the remote
  (record, then entry file: two requests), is verified, published into the
  local cache (written and fsynced) and loaded from it;
- transfer: the two raw gets of that record and entry file with the same
  client, without verifying or loading.

and prints medians and the ratios remote / local and remote / (local +
transfer): the bound is that a remote hit costs at most the local load plus
one transfer of its bytes plus one round trip.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from harness import Samples, Side, compare, ratio_line, report

S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}


def serve_s3(delay: float) -> None:
    """Serves moto's S3 API on the loopback, each request answered `delay` seconds late (a
    distant store); prints the port as the first line, then serves until killed."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    application = DomainDispatcherApplication(create_backend_app)

    def delayed(environ: dict, start_response: object) -> object:
        time.sleep(delay)
        return application(environ, start_response)

    server = make_server("127.0.0.1", 0, delayed, threaded=True, request_handler=MotoRequestHandler)
    print(server.server_port, flush=True)
    server.serve_forever()


def s3_server(delay: float = 0.0) -> tuple[subprocess.Popen[str], str]:
    """serve_s3 in a process of its own (which takes none of this one's GIL), with a bucket
    "bench"; returns the process and its URL."""
    import boto3

    command = [sys.executable, __file__, "--serve-s3", str(delay)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert child.stdout is not None
    url = f"http://127.0.0.1:{child.stdout.readline().strip()}"
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="bench")
    return child, url


def lowered_programs(count: int, size: int) -> list:
    """count distinct small programs, lowered once."""
    import jax
    import jax.numpy as jnp

    import pool
    import worker

    worker.get_runtime("cpu")
    shape = [jax.ShapeDtypeStruct((size, size), jnp.float32)]
    return [pool.lower(lambda x, k=k: jnp.sin(x @ x) * (k + 2.0), shape) for k in range(count)]


def hits(name: str, url: str, programs: list, scratch: Path) -> tuple[Samples, float]:
    """Warms the remote at url, then times, one program after another, a local hit, a remote
    hit and the raw transfer of its record and entry; returns them and the entries' size."""
    import worker
    from worker.cache import open_cache
    from worker.cache.remote import open_remote
    from worker.cache.remote.layout import MAX_RECORD_SIZE, blob_name, record_name
    from worker.cache.remote.verify import checked_record

    remote = open_remote(url)
    assert remote is not None
    warm = scratch / f"{name}-warm"
    keys = [worker.compile_program(p, cache_dir=warm, remote=url)[0].key for p in programs]
    sizes: list[int] = []

    def local(index: int) -> None:
        _, stats = worker.compile_program(programs[index], cache_dir=warm, remote=url)
        assert stats.loaded == 1

    def fetched(index: int) -> float:
        hits = remote.counters.hits
        fresh = scratch / f"{name}-{index}"
        open_cache(fresh)  # made beforehand: a host's cache directory exists, without the entry
        start = time.perf_counter()
        _, stats = worker.compile_program(programs[index], cache_dir=fresh, remote=url)
        seconds = time.perf_counter() - start
        assert stats.loaded == 1 and remote.counters.hits == hits + 1, remote.counters
        return seconds

    def transfer(index: int) -> None:
        deadline = time.monotonic() + 30
        record_bytes = remote.client.get(
            record_name(keys[index], remote.signer), MAX_RECORD_SIZE, deadline
        )
        assert record_bytes is not None
        record = checked_record(record_bytes, keys[index], remote.signer, remote.keys)
        blob = remote.client.get(blob_name(record.sha256), record.size, deadline)
        assert blob is not None
        sizes.append(len(blob))

    def each_program(call: Callable[[int], float | None]) -> Callable[[], float | None]:
        """call of the next program, one a round."""
        numbers = itertools.count()
        return lambda: call(next(numbers))

    sides = [
        Side("local hit", each_program(local)),
        Side("remote hit", each_program(fetched), measures=True),
        Side("raw transfer of record and entry", each_program(transfer)),
    ]
    return compare(sides, len(programs), warmup=0), statistics.median(sizes)


def synthetic_entries(count: int) -> list[tuple[str, dict, bytes]]:
    """count (key, parts, entry file) of distinct entries with 4 KiB random payloads."""
    from worker.cache import entry as entry_format
    from worker.identity.keys import key_of

    made = []
    for index in range(count):
        parts = {"platform": "cpu", "program_sha256": f"{index:064x}", "bench": "prefetch"}
        key = key_of(parts)
        metadata = {"name": f"synthetic_{index}", "platform": "cpu"}
        made.append((key, parts, entry_format.encode(key, parts, metadata, os.urandom(4096))))
    return made


DELAYED_FILES = r"""
import functools, http.server, sys, time
root, delay = sys.argv[1], float(sys.argv[2])

class Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def do_GET(self):
        time.sleep(delay)
        super().do_GET()

    def do_HEAD(self):
        time.sleep(delay)
        super().do_HEAD()

handler = functools.partial(Handler, directory=root)
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def publish_synthetic(url: str, entries: int) -> list[str]:
    """Publishes synthetic entries through RemoteCache.publish (16 at once); returns the keys."""
    from worker.cache.remote import RemoteCache, parse_remote
    from worker.cache.remote.outcomes import Published
    from worker.cache.remote.transfer import run_concurrently

    made = {key: (parts, data) for key, parts, data in synthetic_entries(entries)}
    writer = RemoteCache(parse_remote(url))
    written = run_concurrently(list(made), lambda key: writer.publish(key, *made[key]))
    assert all(outcome is Published.WRITTEN for outcome in written.values()), writer.counters
    return list(made)


def prefetching(url: str, keys: list[str], scratch: Path, concurrency: int) -> Side:
    """A side's sample: every key fetched into an empty local cache by prefetch, `concurrency`
    at once (1: one by one, the same code); the seconds prefetch reports."""
    from worker.cache.remote import RemoteCache, parse_remote, prefetch
    from worker.cache.store import DiskCache

    numbers = itertools.count()

    def measure() -> float:
        reader = RemoteCache(parse_remote(url))  # a fresh process's tier: no state kept
        cache = DiskCache(scratch / f"{concurrency}-{next(numbers)}")
        outcome = prefetch(reader, cache, keys, concurrency=concurrency)
        assert outcome.counts() == {"fetched": len(keys)}, outcome.counts()
        return outcome.seconds

    name = "one by one" if concurrency == 1 else f"prefetch, {concurrency} at once"
    return Side(name, measure, measures=True)


def time_prefetch(url: str, keys: list[str], rounds: int, scratch: Path) -> Samples:
    """One-by-one fetches (concurrency 1) and prefetch (16) of keys, alternated."""
    sides = [prefetching(url, keys, scratch, 1), prefetching(url, keys, scratch, 16)]
    return compare(sides, rounds, warmup=0)


def _child_url(command: list[str]) -> tuple[subprocess.Popen[str], str]:
    """Starts a server process that prints its URL (or port) as its first line."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    return child, child.stdout.readline().strip()


def measure_prefetch(
    latency: float, entries: int, rounds: int, scratch: Path
) -> dict[str, Samples]:
    """Prefetch against one-by-one fetches, from two servers with the same added latency.

    "s3": moto's S3 server answering each request late, in its own process
    (so that it takes none of this process's GIL); "http": the same entries as
    files (published to file://), served by a plain HTTP server in another
    process that sleeps the latency before each answer. moto spends several
    milliseconds of CPU on each request, which bounds what concurrency can
    gain on a small machine; the http row measures the prefetch itself.
    """
    rows = {}
    children: list[subprocess.Popen] = []
    try:
        moto, delayed = s3_server(latency)
        children.append(moto)
        os.environ["AWS_ENDPOINT_URL"] = delayed
        keys = publish_synthetic("s3://bench/prefetch", entries)
        (scratch / "s3").mkdir()
        rows["s3"] = time_prefetch("s3://bench/prefetch", keys, rounds, scratch / "s3")
        root = scratch / "files"
        publish_synthetic(f"file://{root}/prefetch", entries)
        files, port = _child_url([sys.executable, "-c", DELAYED_FILES, str(root), str(latency)])
        children.append(files)
        (scratch / "http").mkdir()
        url = f"http://127.0.0.1:{port}/prefetch"
        rows["http"] = time_prefetch(url, keys, rounds, scratch / "http")
    finally:
        for child in children:
            child.kill()
            child.wait()
    return rows


def main() -> None:
    """Runs the benchmark and prints one line per remote (hit) and one for prefetch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="hit,prefetch", help="hit, prefetch, or both")
    parser.add_argument("--programs", type=int, default=12)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--entries", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve-s3", type=float, metavar="DELAY", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_s3 is not None:  # the child of s3_server
        serve_s3(args.serve_s3)
    parts = set(args.parts.split(","))
    if not parts <= {"hit", "prefetch"}:
        parser.error(f"--parts {args.parts!r}: name hit, prefetch or both")
    os.environ.update(S3_ENV)
    if "prefetch" in parts:
        with tempfile.TemporaryDirectory() as scratch:
            rows = measure_prefetch(args.latency_ms / 1e3, args.entries, args.rounds, Path(scratch))
        for name, samples in rows.items():
            delay = f"+{args.latency_ms:g} ms a request"
            title = f"prefetch of {args.entries} entries from {name}, {delay}"
            report(samples, title, unit="s", goals={"prefetch, 16 at once": 1 / 8})
    if "hit" not in parts:
        return
    servers = [s3_server(), s3_server(args.latency_ms / 1e3)]
    (_, endpoint), (_, delayed) = servers
    programs = lowered_programs(args.programs, args.size)
    print(f"{args.programs} programs, {args.size}x{args.size} f32, each a round")
    with tempfile.TemporaryDirectory() as scratch:
        remotes = [
            ("s3 loopback", endpoint, "s3://bench/loopback"),
            (f"s3 +{args.latency_ms:g} ms", delayed, "s3://bench/delayed"),
            ("file://", None, f"file://{scratch}/remote"),
        ]
        for name, url_endpoint, url in remotes:
            if url_endpoint is not None:
                os.environ["AWS_ENDPOINT_URL"] = url_endpoint
            samples, size = hits(f"remote{len(name)}", url, programs, Path(scratch))
            report(samples, f"{name}: a hit, entries of {size / 1024:.1f} KiB")
            bound = samples.median("local hit") + samples.median(samples.sides[2])
            ratio_line("remote hit / (local hit + raw transfer)",
                       samples.median("remote hit"), bound)  # fmt: skip
    for child, _ in servers:
        child.kill()
        child.wait()


if __name__ == "__main__":
    main()
