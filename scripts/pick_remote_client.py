"""Measures the two candidate object-store clients for the remote cache tier.

    python scripts/pick_remote_client.py [--rounds 50] [--size 262144]

For obstore and for fsspec+s3fs it prints: the import time in a fresh
interpreter (what a worker would pay to reach the remote), the median of a
put and of a get of one object against moto's ThreadedMotoServer on the
loopback, and whether a create-only put (If-None-Match: *) of an existing
object is refused. Times are medians of --rounds, in the same run, with the
ratio of s3fs to obstore.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time

from timing import median_seconds

IMPORTS = {"obstore": "import obstore, obstore.store", "s3fs": "import s3fs"}


def import_seconds(statement: str, rounds: int = 5) -> float:
    """The median wall time of a fresh interpreter running statement, less a bare one's."""

    def once(code: str) -> float:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - start

    bare = statistics.median(once("pass") for _ in range(rounds))
    return statistics.median(once(statement) for _ in range(rounds)) - bare


def measure_obstore(endpoint: str, data: bytes, rounds: int) -> dict[str, object]:
    """Put, get and create-only put with obstore's S3Store."""
    import obstore
    from obstore.exceptions import AlreadyExistsError, PreconditionError
    from obstore.store import S3Store

    store = S3Store("bench", endpoint=endpoint, region="us-east-1", allow_http=True)
    put = median_seconds(lambda i: obstore.put(store, f"o/{i}", data), rounds)
    get = median_seconds(lambda i: obstore.get(store, f"o/{i}").bytes(), rounds)
    try:
        obstore.put(store, "o/0", b"other", mode="create")
        refused = False
    except (AlreadyExistsError, PreconditionError):
        refused = True
    return {"put_ms": put * 1e3, "get_ms": get * 1e3, "create_only_refused": refused}


def measure_s3fs(endpoint: str, data: bytes, rounds: int) -> dict[str, object]:
    """Put, get and create-only put with fsspec's s3fs."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="k", secret="s", use_listings_cache=False)
    put = median_seconds(lambda i: fs.pipe_file(f"bench/f/{i}", data), rounds)
    get = median_seconds(lambda i: fs.cat_file(f"bench/f/{i}"), rounds)
    try:
        fs.pipe_file("bench/f/0", b"other", mode="create")
        refused = False
    except (FileExistsError, OSError):
        refused = True
    return {"put_ms": put * 1e3, "get_ms": get * 1e3, "create_only_refused": refused}


def main() -> None:
    """Runs the measurement and prints one line per client, then the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--size", type=int, default=256 << 10)
    args = parser.parse_args()
    os.environ.update(AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_REGION="us-east-1")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    data = os.urandom(args.size)
    results = {}
    for name, measure in (("obstore", measure_obstore), ("s3fs", measure_s3fs)):
        results[name] = {"import_ms": import_seconds(IMPORTS[name]) * 1e3}
        results[name].update(measure(endpoint, data, args.rounds))
        row = results[name]
        print(
            f"{name:8s} import {row['import_ms']:7.1f} ms  put {row['put_ms']:6.2f} ms  "
            f"get {row['get_ms']:6.2f} ms  create-only refused: {row['create_only_refused']}"
        )
    for field in ("import_ms", "put_ms", "get_ms"):
        ratio = results["s3fs"][field] / results["obstore"][field]
        print(f"s3fs/obstore {field}: {ratio:.2f}")
    server.stop()


if __name__ == "__main__":
    main()
