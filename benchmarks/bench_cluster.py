"""Benchmark ClusterPool on a two-worker Dask LocalCluster, against baselines of the same run.

Usage::

    python benchmarks/bench_cluster.py [--parts runs,large,routing,warm] [--repeat N] [--runs N]

runs: N small runs (default 2,000) of one tiny program, all submitted and
then every result read, (a) through a local Pool(2), (b) through a
ClusterPool on a LocalCluster of two Dask worker processes with one thread
and one PJRT worker each, and (c) as plain Dask tasks on the same cluster
calling jax.jit in the Dask workers (compiled there beforehand). The goal:
(b) at most 1.5x (c) per task.

large: a 64 MiB output through the cluster (ClusterPool.run) against a
plain Dask task returning the same numpy array (made in the Dask worker);
the goal: at most 1.2x.

routing: 16 programs run 20 times each: how many times the nodes' Pools
compiled or loaded them (16 when each stays on one node, up to 32 when
runs go anywhere); then one program run N times: the nodes it spread to.

warm: the example programs (pool.examples) warmed into fresh cache directories
by a local Pool with one worker per CPU and by a ClusterPool (one PJRT
worker per node); the cluster's start-up is timed apart.

Sides alternate across --repeat rounds (three times as many for large),
after a warm-up round (benchmarks/harness.py); medians and ratios against
the plain Dask tasks (the local pool for warm) are printed. On one 2-core
machine the cluster can only add overhead; the ratios say how much.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_SCRATCH = tempfile.mkdtemp(prefix="bench-cluster-")
os.environ["PJRT_POOL_CACHE_DIR"] = str(Path(_SCRATCH) / "default-cache")

import distributed  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from harness import Side, cluster_arguments, compare, report  # noqa: E402

from pool import ClusterPool, Pool, lower  # noqa: E402
from pool.cluster import local_client  # noqa: E402
from pool.cluster.dask.node import node_answer  # noqa: E402

SIDE = 4096
"""A SIDE x SIDE float32 output is 64 MiB."""


def _tiny(x):
    return x * 2.0 + 1.0


def _jit_task(x: np.ndarray) -> np.ndarray:
    """A plain Dask task: jax.jit of the tiny program, compiled once per Dask worker."""
    worker = distributed.get_worker()
    jitted = getattr(worker, "bench_jitted", None)
    if jitted is None:
        import jax as worker_jax

        jitted = worker.bench_jitted = worker_jax.jit(lambda v: v * 2.0 + 1.0)
    return np.asarray(jitted(x))


def _large_task(value: float) -> np.ndarray:
    """A plain Dask task returning the 64 MiB array the cluster's program returns."""
    return np.full((SIDE, SIDE), value * 2.0, np.float32)


def _large_jit_task(x: np.ndarray) -> np.ndarray:
    """A plain Dask task computing that array as the program does, with jax.jit."""
    worker = distributed.get_worker()
    jitted = getattr(worker, "bench_large_jitted", None)
    if jitted is None:
        import jax as worker_jax
        import jax.numpy as worker_jnp

        jitted = worker.bench_large_jitted = worker_jax.jit(
            lambda v: worker_jnp.broadcast_to(v, (SIDE, SIDE)) * 2.0
        )
    return np.asarray(jitted(x))


def _timed_on_node(make: Any, *args: Any) -> float:
    """Seconds a leg's array takes to make on the node (kept there: nothing is sent)."""
    start = time.perf_counter()
    made = make(*args)
    del made
    return time.perf_counter() - start


def _pool_run_on_node(plugin: str, program: Any, x: np.ndarray) -> list[np.ndarray]:
    from pool.cluster.dask.node import node_pool

    return node_pool(plugin).run(program, [x])


def _runs(client: distributed.Client, cluster: ClusterPool, count: int, repeat: int) -> None:
    program = lower(_tiny, [jax.ShapeDtypeStruct((8,), jnp.float32)])
    x = np.arange(8, dtype=np.float32)

    def each(results: Callable[[], list[Any]]) -> Callable[[], float]:
        def measure() -> float:
            start = time.perf_counter()
            assert len(results()) == count
            return (time.perf_counter() - start) / count

        return measure

    with Pool(2) as local:
        sides = [
            Side("plain Dask tasks calling jax.jit", each(lambda: client.gather(
                [client.submit(_jit_task, x, pure=False) for _ in range(count)])), True),
            Side("ClusterPool, 2 nodes x 1 PJRT worker", each(lambda: [
                f.result() for f in [cluster.submit(program, [x]) for _ in range(count)]]), True),
            Side("a local Pool(2)", each(lambda: [
                f.result() for f in [local.submit(program, [x]) for _ in range(count)]]), True),
        ]  # fmt: skip
        samples = compare(sides, repeat)  # the warm-up round starts the pools, compiles
    title = f"\n{count} tiny runs, all submitted then read, a run"
    report(samples, title, unit="us", goals={sides[1].name: 1.5})


def _large(client: distributed.Client, cluster: ClusterPool, repeat: int) -> None:
    program = lower(
        lambda v: jnp.broadcast_to(v, (SIDE, SIDE)) * 2.0,
        [jax.ShapeDtypeStruct((SIDE,), jnp.float32)],
    )
    x = np.full(SIDE, 3.0, np.float32)

    def fetched(fetch: Callable[[], np.ndarray], made: Callable[[], float]) -> Any:
        """A side's sample: the array fetched to the client ("wall"), and the node's own time
        to make it, kept there ("made"; the rest is Dask, the network and the client)."""

        def measure() -> dict[str, float]:
            start = time.perf_counter()
            out = fetch()
            wall = time.perf_counter() - start
            assert out.nbytes == 64 << 20 and float(out[-1, -1]) == 6.0
            del out
            return {"wall": wall, "made": made()}

        return measure

    sides = [
        Side("plain Dask task, np.full", fetched(
            lambda: client.submit(_large_task, 3.0, pure=False).result(),
            lambda: client.submit(_timed_on_node, _large_task, 3.0, pure=False).result()), True),
        Side("plain Dask task, jax.jit", fetched(
            lambda: client.submit(_large_jit_task, x, pure=False).result(),
            lambda: client.submit(_timed_on_node, _large_jit_task, x, pure=False).result()),
            True),
        Side("ClusterPool.run", fetched(
            lambda: cluster.run(program, [x])[0],
            lambda: client.submit(
                _timed_on_node, _pool_run_on_node, cluster.plugin_name, program, x).result()),
            True),
    ]  # fmt: skip
    samples = compare(sides, repeat * 3)
    report(samples, "\n64 MiB output, fetched to the client", goals={"ClusterPool.run": 1.2})
    report(samples, "the same, the node's own time to make it", figure="made")


def _loads(client: distributed.Client, cluster: ClusterPool) -> int:
    return sum(
        int(s.get("compiled", 0)) + int(s.get("loaded", 0))
        for s in client.run(node_answer, cluster.plugin_name, "statistics").values()
    )


def _routing(client: distributed.Client, cluster: ClusterPool, count: int) -> None:
    programs = [
        lower(lambda v, i=i: v * float(i) - 1.0, [jax.ShapeDtypeStruct((8,), jnp.float32)])
        for i in range(16)
    ]
    x = np.ones(8, np.float32)
    before = _loads(client, cluster)
    futures = [cluster.submit(p, [x]) for _ in range(20) for p in programs]
    for future in futures:
        future.result()
    loads = _loads(client, cluster) - before
    print(
        f"\nrouting: 16 programs x 20 runs: {loads} compiles+loads on the nodes "
        "(16 ideal, 32 worst)"
    )
    program = programs[0]
    for future in [cluster.submit(program, [x]) for _ in range(count)]:
        future.result()
    from pool.executor.programs import program_id

    nodes = cluster.router.holders(program_id(program))
    print(f"routing: one program x {count} runs spread to {len(nodes)} of 2 nodes")


def _warm(client: distributed.Client, repeat: int) -> None:
    from pool.examples import example_programs
    from pool.warm.spec_file import WarmProgram
    from pool.warm.warming import warm

    programs = [
        WarmProgram(name, None, (), lowered=lower(function, shapes))
        for name, function, shapes in example_programs()
    ]
    cores = os.cpu_count() or 2

    def warming(**options: Any) -> Callable[[], None]:
        def call() -> None:
            cache = tempfile.mkdtemp(prefix="warm-", dir=_SCRATCH)
            report = warm(programs, cache_dir=cache, **options)
            assert report.ok and report.statistics.compiled == len(programs), report.summary()

        return call

    sides = [
        Side(f"a local pool of {cores} workers", warming(workers=cores)),
        Side("LocalCluster, 2 Dask workers x 1 PJRT",
             warming(workers=1, scheduler=client.scheduler.address)),
    ]  # fmt: skip
    report(compare(sides, repeat, warmup=0), f"\nwarm {len(programs)} programs", unit="s")


def main(argv: list[str] | None = None) -> int:
    args, parts = cluster_arguments(__doc__.split("\n\n")[0], "runs,large,routing,warm", argv)
    print(f"{os.cpu_count()} CPUs", flush=True)
    started = time.perf_counter()
    with local_client(2, threads_per_worker=1) as client:
        print(f"cluster start-up {time.perf_counter() - started:.2f} s (in no figure)", flush=True)
        if parts & {"runs", "large", "routing"}:
            with ClusterPool(client, workers_per_node=1, cache_dir=str(Path(_SCRATCH) / "c")) as cp:
                if "runs" in parts:
                    _runs(client, cp, args.runs, args.repeat)
                if "large" in parts:
                    _large(client, cp, args.repeat)
                if "routing" in parts:
                    _routing(client, cp, args.runs)
        if "warm" in parts:
            _warm(client, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
