"""Benchmark warming on a two-worker Dask LocalCluster against the local pool.

Usage::

    python scripts/bench_cluster.py [--repeat N]

The same example programs (examples), lowered once in this process
beforehand, are warmed into fresh cache directories (a) by a local Pool with
one worker per CPU and (b) by a ClusterPool on a LocalCluster of two Dask
worker processes on loopback, each running a Pool of one PJRT worker. The
cluster's start-up is timed apart from the warm run. On one 2-core machine
the cluster can only add overhead (scheduling, pickling programs to the Dask
workers); the figure says how much, which is what a cluster of real machines
must win back with its extra cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_SCRATCH = tempfile.mkdtemp(prefix="bench-cluster-")
os.environ["PJRT_POOL_CACHE_DIR"] = str(Path(_SCRATCH) / "default-cache")

from examples import example_programs  # noqa: E402

from pool import lower  # noqa: E402
from pool.cluster import local_client  # noqa: E402
from pool.warm.spec_file import WarmProgram  # noqa: E402
from pool.warm.warming import warm  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    programs = [
        WarmProgram(name, None, (), lowered=lower(function, shapes))
        for name, function, shapes in example_programs()
    ]
    cores = os.cpu_count() or 2
    print(f"{len(programs)} programs, {cores} CPUs", flush=True)

    started = time.perf_counter()
    with local_client(2, threads_per_worker=1) as client:
        cluster_startup = time.perf_counter() - started
        local, remote = [], []
        for rep in range(args.repeat):
            for side in ("local", "cluster") if rep % 2 == 0 else ("cluster", "local"):
                cache = tempfile.mkdtemp(prefix=f"{side}-", dir=_SCRATCH)
                start = time.perf_counter()
                if side == "local":
                    report = warm(programs, workers=cores, cache_dir=cache)
                    local.append(time.perf_counter() - start)
                else:
                    report = warm(
                        programs, workers=1, cache_dir=cache, scheduler=client.scheduler.address
                    )
                    remote.append(time.perf_counter() - start)
                assert report.ok and report.statistics.compiled == len(programs), report.summary()
            print(f"  round {rep + 1}/{args.repeat} done", flush=True)
    lo, re = statistics.median(local), statistics.median(remote)
    print(f"\nlocal pool of {cores} workers              {lo:7.2f} s")
    print(f"LocalCluster, 2 Dask workers x 1 PJRT   {re:7.2f} s   cluster/local {re / lo:.2f}")
    print(f"cluster start-up (not in the above)     {cluster_startup:7.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
