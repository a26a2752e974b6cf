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

warm: the example programs (examples) warmed into fresh cache directories
by a local Pool with one worker per CPU and by a ClusterPool (one PJRT
worker per node); the cluster's start-up is timed apart.

Legs alternate in order across --repeat rounds; medians are printed. On
one 2-core machine the cluster can only add overhead; the ratios say how
much.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_SCRATCH = tempfile.mkdtemp(prefix="bench-cluster-")
os.environ["PJRT_POOL_CACHE_DIR"] = str(Path(_SCRATCH) / "default-cache")

import distributed  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pool import ClusterPool, Pool, lower  # noqa: E402
from pool.cluster import local_client  # noqa: E402
from pool.cluster.node import node_figures  # noqa: E402

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
    from pool.cluster.node import node_pool

    return node_pool(plugin).run(program, [x])


def _runs(client: distributed.Client, cluster: ClusterPool, count: int, repeat: int) -> None:
    program = lower(_tiny, [jax.ShapeDtypeStruct((8,), jnp.float32)])
    x = np.arange(8, dtype=np.float32)
    with Pool(2) as local:
        legs = {
            "local": lambda: [
                f.result() for f in [local.submit(program, [x]) for _ in range(count)]
            ],
            "cluster": lambda: [
                f.result() for f in [cluster.submit(program, [x]) for _ in range(count)]
            ],
            "dask": lambda: client.gather(
                [client.submit(_jit_task, x, pure=False) for _ in range(count)]
            ),
        }
        for leg in legs.values():  # warm: pools started, the program loaded, jit compiled
            leg()
        times: dict[str, list[float]] = {name: [] for name in legs}
        for rep in range(repeat):
            order = list(legs) if rep % 2 == 0 else list(reversed(legs))
            for name in order:
                start = time.perf_counter()
                results = legs[name]()
                times[name].append(time.perf_counter() - start)
                assert len(results) == count
            print(f"  runs round {rep + 1}/{repeat} done", flush=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    us = {name: 1e6 * t / count for name, t in median.items()}
    print(f"\n{count} tiny runs, all submitted then read (median of {repeat}):")
    print(f"  local Pool(2)                      {us['local']:8.0f} us/run")
    print(
        f"  ClusterPool, 2 nodes x 1 PJRT       {us['cluster']:8.0f} us/run   "
        f"cluster/dask {median['cluster'] / median['dask']:.2f}x   "
        f"cluster/local {median['cluster'] / median['local']:.2f}x"
    )
    print(f"  plain Dask tasks calling jax.jit   {us['dask']:8.0f} us/run")


def _large(client: distributed.Client, cluster: ClusterPool, repeat: int) -> None:
    program = lower(
        lambda v: jnp.broadcast_to(v, (SIDE, SIDE)) * 2.0,
        [jax.ShapeDtypeStruct((SIDE,), jnp.float32)],
    )
    x = np.full(SIDE, 3.0, np.float32)
    legs = {
        "cluster": lambda: cluster.run(program, [x])[0],
        "dask": lambda: client.submit(_large_task, 3.0, pure=False).result(),
        "dask_jit": lambda: client.submit(_large_jit_task, x, pure=False).result(),
    }
    on_node = {  # the same legs, the array made on the node and not sent
        "cluster": lambda: client.submit(
            _timed_on_node, _pool_run_on_node, cluster.plugin_name, program, x
        ).result(),
        "dask": lambda: client.submit(_timed_on_node, _large_task, 3.0, pure=False).result(),
        "dask_jit": lambda: client.submit(_timed_on_node, _large_jit_task, x, pure=False).result(),
    }
    for leg in legs.values():
        assert float(leg()[-1, -1]) == 6.0
    times: dict[str, list[float]] = {name: [] for name in legs}
    made: dict[str, list[float]] = {name: [] for name in legs}
    for rep in range(repeat * 3):
        for name in list(legs) if rep % 2 == 0 else list(reversed(legs)):
            start = time.perf_counter()
            out = legs[name]()
            times[name].append(time.perf_counter() - start)
            assert out.nbytes == 64 << 20
            del out
            made[name].append(on_node[name]())
    total = {name: statistics.median(t) for name, t in times.items()}
    node = {name: statistics.median(t) for name, t in made.items()}
    print(f"\n64 MiB output, fetched to the client (median of {repeat * 3}; 'made' is")
    print("the node's own time to make it, 'sent' the rest: Dask, the network, the client):")
    for name, label in [
        ("cluster", "ClusterPool.run"),
        ("dask", "plain Dask task, np.full"),
        ("dask_jit", "plain Dask task, jax.jit"),
    ]:
        sent = total[name] - node[name]
        print(
            f"  {label:28s} {total[name] * 1e3:7.1f} ms  made {node[name] * 1e3:6.1f} ms  "
            f"sent {sent * 1e3:6.1f} ms"
        )
    print(
        f"  cluster/np.full task {total['cluster'] / total['dask']:.2f}x, cluster/jit task "
        f"{total['cluster'] / total['dask_jit']:.2f}x, sent part cluster/np.full task "
        f"{(total['cluster'] - node['cluster']) / (total['dask'] - node['dask']):.2f}x"
    )
    # The fastest of each leg: what a busy machine disturbs least (the medians above
    # move by 1.5x between runs here when other work shares the two cores).
    fastest = {name: min(t) for name, t in times.items()}
    print(
        f"  fastest of each: cluster {fastest['cluster'] * 1e3:.1f} ms, np.full task "
        f"{fastest['dask'] * 1e3:.1f} ms, jit task {fastest['dask_jit'] * 1e3:.1f} ms: "
        f"cluster/np.full task {fastest['cluster'] / fastest['dask']:.2f}x, cluster/jit task "
        f"{fastest['cluster'] / fastest['dask_jit']:.2f}x (goal 1.2x)"
    )


def _loads(client: distributed.Client, cluster: ClusterPool) -> int:
    return sum(
        int(s.get("compiled", 0)) + int(s.get("loaded", 0))
        for s in client.run(node_figures, cluster.plugin_name, "statistics").values()
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
    local, remote = [], []
    for rep in range(repeat):
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
        print(f"  warm round {rep + 1}/{repeat} done", flush=True)
    lo, re = statistics.median(local), statistics.median(remote)
    print(f"\nwarm {len(programs)} programs: local pool of {cores} workers {lo:7.2f} s")
    print(f"  LocalCluster, 2 Dask workers x 1 PJRT   {re:7.2f} s   cluster/local {re / lo:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="runs,large,routing,warm")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
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
