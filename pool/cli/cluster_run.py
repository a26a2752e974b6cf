"""``pjrt-pool run MANIFEST NAME --scheduler|--ray ADDRESS``: runs on a cluster, once or a batch.

With --scheduler, the program runs on a Dask cluster's nodes through a
ClusterPool; with --ray, on a Ray cluster's through a RayClusterPool. Each
node loads it from its disk cache (the manifest's
directory, or --cache-dir, as the nodes see it: a shared filesystem, or the
same path warmed on each), and from the remote tier that --remote or this
process's PJRT_POOL_CACHE_REMOTE names (as a run here would). Without
--batch it runs once, on --inputs or seeded random inputs, and prints what
a local run prints. With --batch FILE..., it runs once per .npz (or .npy)
file, read as its run is submitted (at most a few runs per node in flight,
so a long batch is never all in memory), shows progress on stderr and
prints a report: each file's outputs (types and checksums) or its error (a
file that does not read or fit the program fails in its place), and the
counts; exit status 1 if any run failed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from pool.cli.main import ExitCode, UsageError
from pool.cli.options import cluster_address
from pool.cli.run_files import describe, finite_sums, read_inputs
from pool.manifest import Manifest
from pool.progress import ProgressDisplay
from worker.partitioning import devices_needed
from worker.records import ProgramSpec


@contextlib.contextmanager
def cluster_pool(
    args: argparse.Namespace, manifest: Manifest, spec: ProgramSpec, remote: str | None
) -> Iterator[Any]:
    """A ClusterPool on --scheduler (or a RayClusterPool on --ray), for the manifest's
    platform and cache directory, whose nodes use the remote tier run's --remote names
    (checked; None: the nodes' own)."""
    options = {
        "workers_per_node": args.workers or None,
        "platform": spec.platform,
        "cache_dir": manifest.cache_dir,
        "remote": remote,
        "devices_per_worker": devices_needed(spec.partitioning),
    }
    with contextlib.ExitStack() as stack:
        # Here, not at the top: each engine is an optional extra (MissingExtraError).
        if args.ray:
            from pool.cluster import RayClusterPool, connect_ray

            try:
                stack.enter_context(connect_ray(args.ray))
            except (OSError, ValueError) as error:
                raise UsageError(f"--ray {args.ray}: cannot connect ({error})") from None
            yield stack.enter_context(RayClusterPool(**options))
            return
        from pool.cluster import ClusterPool, connect

        try:
            client = stack.enter_context(connect(args.scheduler))
        except (OSError, ValueError) as error:
            raise UsageError(f"--scheduler {args.scheduler}: cannot connect ({error})") from None
        yield stack.enter_context(ClusterPool(client, **options))


def run_batch(
    args: argparse.Namespace, manifest: Manifest, spec: ProgramSpec, remote: str | None
) -> int:
    """Runs the program once per --batch file on the cluster; prints the report (see above)."""
    progress = ProgressDisplay(len(args.batch))
    runs: list[dict[str, Any] | None] = [None] * len(args.batch)
    submitted: collections.deque[int] = collections.deque()  # files whose runs are in flight
    started = last = time.perf_counter()

    def record(index: int, outcome: list[np.ndarray] | Exception) -> None:
        nonlocal last
        now = time.perf_counter()
        path = args.batch[index]
        if isinstance(outcome, Exception):
            error = str(outcome)
            if not isinstance(outcome, UsageError):  # a run's failure: its exception's class too
                error = f"{type(outcome).__name__}: {error}"
            progress.update(path, "failed", now - last, error)
            runs[index] = {"inputs": path, "error": error}
        else:
            progress.update(path, "ran", now - last)
            runs[index] = {"inputs": path, "outputs": describe(outcome)}
        last = now

    def batches() -> Iterator[list[np.ndarray]]:
        """Each file's inputs, read as the bounded map asks for them."""
        for index, path in enumerate(args.batch):
            try:
                inputs = read_inputs(path, spec, "--batch")
            except UsageError as error:  # this file's failure, in its place
                record(index, error)
                continue
            submitted.append(index)
            yield inputs

    with cluster_pool(args, manifest, spec, remote) as pool:
        for result in pool.map(spec, batches(), return_exceptions=True):
            record(submitted.popleft(), result)
    progress.close()
    done = [run for run in runs if run is not None]
    failed = sum("error" in run for run in done)
    report = {
        "name": args.name,
        "key": spec.key,
        "scheduler": args.scheduler,
        "ray": args.ray,
        "seconds": time.perf_counter() - started,
        "counts": {"ran": len(done) - failed, "failed": failed},
        "runs": [run if "error" in run else finite_sums(run) for run in done],
    }
    if args.json:
        print(json.dumps(report, indent=2, allow_nan=False))
    else:
        for run in done:
            if "error" in run:
                print(f"{run['inputs']}: failed: {run['error'].splitlines()[0][:300]}")
                continue
            shown = "; ".join(
                f"{o['dtype']}{o['shape']}" + ("" if o["sum"] is None else f" sum {o['sum']:.6g}")
                for o in run["outputs"]
            )
            print(f"{run['inputs']}: {shown}")
        print(
            f"{args.name}: {len(done) - failed} ran, {failed} failed on {cluster_address(args)} "
            f"in {report['seconds']:.2f} s"
        )
    return ExitCode.PROBLEMS if failed else ExitCode.OK
