"""``pjrt-pool run MANIFEST NAME --scheduler ADDRESS``: runs on a Dask cluster, once or a batch.

With --scheduler, the program runs on the cluster's nodes through a
ClusterPool: each node loads it from its disk cache (the manifest's
directory, or --cache-dir, as the nodes see it: a shared filesystem, or the
same path warmed on each). Without --batch it runs once, on --inputs or
seeded random inputs, and prints what a local run prints. With --batch
FILE..., it runs once per .npz file (at most a few runs per node in
flight), shows progress on stderr and prints a report: each file's
outputs (types and checksums) or its error, and the counts; exit status 1
if any run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

from pool.cli.main import EXIT_OK, EXIT_PROBLEMS, UsageError
from pool.manifest import Manifest
from pool.progress import ProgressDisplay
from worker.records import ProgramSpec


@contextlib.contextmanager
def cluster_pool(args: argparse.Namespace, manifest: Manifest, spec: ProgramSpec) -> Iterator[Any]:
    """A ClusterPool on --scheduler, for the manifest's platform and cache directory."""
    try:
        # Here, not at the top: Dask's distributed is an optional extra.
        from pool.cluster import ClusterPool, connect
    except ImportError as error:
        raise UsageError(f"--scheduler: {error}") from None
    with contextlib.ExitStack() as stack:
        try:
            client = stack.enter_context(connect(args.scheduler))
        except (OSError, ValueError) as error:
            raise UsageError(f"--scheduler {args.scheduler}: cannot connect ({error})") from None
        yield stack.enter_context(
            ClusterPool(
                client,
                workers_per_node=args.workers or None,
                platform=spec.platform,
                cache_dir=manifest.cache_dir,
            )
        )


def run_batch(
    args: argparse.Namespace,
    manifest: Manifest,
    spec: ProgramSpec,
    inputs_of: Any,
    describe: Any,
) -> int:
    """Runs the program once per --batch file on the cluster; prints the report (see above).

    inputs_of(path) reads and checks one file's inputs (raising UsageError),
    describe(outputs) gives the outputs' types and checksums; both are the
    run command's own, so a batch reads and reports as a single run does.
    """
    batches = [inputs_of(path) for path in args.batch]  # every file checked before any runs
    progress = ProgressDisplay(len(batches))
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    with cluster_pool(args, manifest, spec) as pool:
        last = time.perf_counter()
        results = pool.map(spec, batches, return_exceptions=True)
        for path, result in zip(args.batch, results, strict=True):
            now = time.perf_counter()
            if isinstance(result, Exception):
                error = f"{type(result).__name__}: {result}"
                progress.update(path, "failed", now - last, error)
                runs.append({"inputs": path, "error": error})
            else:
                progress.update(path, "ran", now - last)
                runs.append({"inputs": path, "outputs": describe(result)})
            last = now
    progress.close()
    failed = sum("error" in run for run in runs)
    report = {
        "name": args.name,
        "key": spec.key,
        "scheduler": args.scheduler,
        "seconds": time.perf_counter() - started,
        "counts": {"ran": len(runs) - failed, "failed": failed},
        "runs": runs,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for run in runs:
            if "error" in run:
                print(f"{run['inputs']}: failed: {run['error'].splitlines()[0][:300]}")
                continue
            shown = "; ".join(
                f"{o['dtype']}{o['shape']}" + ("" if o["sum"] is None else f" sum {o['sum']:.6g}")
                for o in run["outputs"]
            )
            print(f"{run['inputs']}: {shown}")
        print(
            f"{args.name}: {len(runs) - failed} ran, {failed} failed on {args.scheduler} "
            f"in {report['seconds']:.2f} s"
        )
    return EXIT_PROBLEMS if failed else EXIT_OK
