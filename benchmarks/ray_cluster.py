"""Benchmark RayClusterPool on a local Ray cluster of two nodes, against baselines of the same run.

Usage::

    python benchmarks/ray_cluster.py [--parts runs,warm] [--repeat N] [--runs N]

runs: N tiny runs (default 2,000) of one tiny program, (a) through a
RayClusterPool on a LocalRayCluster of two nodes (one PJRT worker each),
and (b) as plain Ray tasks on the same cluster calling jax.jit in Ray's
worker processes (compiled there beforehand). Each leg both ways: one at a
time (run, ray.get of each task), and all submitted then every result read.
The goal: (a) at most 1.5x (b).

warm: the example programs (pool.examples, which `pjrt-pool warm
pool.examples:programs` warms) warmed into fresh cache directories on two nodes of one PJRT worker
each, (a) by a RayClusterPool (warm(ray=...): its actors start with it) and
(b) by the Dask ClusterPool (warm(scheduler=...)) on a LocalCluster of two
Dask workers, both clusters on this machine, started before (their start-up
in no figure). The goal: (a) at most 1.1x (b). For the record, in the same
rounds: Ray's own start of an actor per node (an empty one, made and
answering once), which every RayClusterPool's start includes (its actors
are new worker processes; a Dask ClusterPool's nodes are the running Dask
workers).

Legs alternate in order across --repeat rounds; medians are printed. Self-
contained: every figure's baseline is measured in the same run.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_SCRATCH = tempfile.mkdtemp(prefix="bench-ray-")
os.environ["PJRT_POOL_CACHE_DIR"] = str(Path(_SCRATCH) / "default-cache")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
from harness import cluster_arguments  # noqa: E402

from pool import lower  # noqa: E402
from pool.cluster import LocalRayCluster, RayClusterPool, connect_ray  # noqa: E402

_jitted: Any = None


def _tiny(x):
    return x * 2.0 + 1.0


@ray.remote(num_cpus=1)
def _jit_task(x: np.ndarray) -> np.ndarray:
    """A plain Ray task: jax.jit of the tiny program, compiled once per Ray worker process."""
    global _jitted
    if _jitted is None:
        import jax as worker_jax

        _jitted = worker_jax.jit(lambda v: v * 2.0 + 1.0)
    return np.asarray(_jitted(x))


def _timed(legs: dict[str, Callable[[], Any]], repeat: int, what: str) -> dict[str, float]:
    """Each leg's median seconds over `repeat` rounds, legs alternating in order."""
    for leg in legs.values():  # warm: pools started, the program loaded, jit compiled
        leg()
    times: dict[str, list[float]] = {name: [] for name in legs}
    for rep in range(repeat):
        for name in list(legs) if rep % 2 == 0 else list(reversed(legs)):
            start = time.perf_counter()
            legs[name]()
            times[name].append(time.perf_counter() - start)
        took = ", ".join(f"{name} {times[name][-1]:.2f} s" for name in legs)
        print(f"  {what} round {rep + 1}/{repeat}: {took}", flush=True)
    return {name: statistics.median(t) for name, t in times.items()}


def _runs(cluster: RayClusterPool, count: int, repeat: int) -> None:
    program = lower(_tiny, [jax.ShapeDtypeStruct((8,), jnp.float32)])
    x = np.arange(8, dtype=np.float32)
    want = np.asarray(jax.jit(_tiny)(x))
    assert np.array_equal(cluster.run(program, [x])[0], want)
    assert np.array_equal(ray.get(_jit_task.remote(x)), want)
    legs = {
        "pool, one at a time": lambda: [cluster.run(program, [x]) for _ in range(count)],
        "tasks, one at a time": lambda: [ray.get(_jit_task.remote(x)) for _ in range(count)],
        "pool, all submitted": lambda: [
            f.result() for f in [cluster.submit(program, [x]) for _ in range(count)]
        ],
        "tasks, all submitted": lambda: ray.get([_jit_task.remote(x) for _ in range(count)]),
    }
    median = _timed(legs, repeat, "runs")
    print(f"\n{count} tiny runs (median of {repeat}):")
    for name, seconds in median.items():
        print(f"  {name:24s} {1e6 * seconds / count:8.0f} us/run")
    for way in ("one at a time", "all submitted"):
        ratio = median[f"pool, {way}"] / median[f"tasks, {way}"]
        print(f"  RayClusterPool / plain Ray tasks with jax.jit, {way}: {ratio:.2f}x (goal 1.5x)")


def _warm(ray_address: str, repeat: int) -> None:
    from pool.cluster import local_client
    from pool.examples import example_programs
    from pool.warm.spec_file import WarmProgram
    from pool.warm.warming import warm

    programs = [
        WarmProgram(name, None, (), lowered=lower(function, shapes))
        for name, function, shapes in example_programs()
    ]

    def leg(engine: str, **where: str) -> Callable[[], None]:
        def warm_once() -> None:
            cache = tempfile.mkdtemp(prefix=f"{engine}-", dir=_SCRATCH)
            report = warm(programs, workers=1, cache_dir=cache, **where)
            assert report.ok and report.statistics.compiled == len(programs), report.summary()

        return warm_once

    started = time.perf_counter()
    with local_client(2, threads_per_worker=1) as client:
        print(f"Dask cluster start-up {time.perf_counter() - started:.2f} s (in no figure)")
        legs = {
            "ray": leg("ray", ray=ray_address),
            "dask": leg("dask", scheduler=client.scheduler.address),
            "actors": _empty_actors,
        }
        median = _timed(legs, repeat, "warm")
    print(f"\nwarm {len(programs)} programs on 2 nodes x 1 PJRT worker (median of {repeat}):")
    print(f"  RayClusterPool        {median['ray']:7.2f} s")
    print(f"  Dask ClusterPool      {median['dask']:7.2f} s")
    print(f"  Ray / Dask {median['ray'] / median['dask']:.2f}x (goal 1.1x)")
    print(
        f"  of the RayClusterPool's time, Ray's own start of an actor per node (an empty "
        f"actor, made and answering, in the same rounds): {median['actors']:.2f} s"
    )


class _Empty:
    def ping(self) -> int:
        return os.getpid()


def _empty_actors() -> None:
    """Ray's own part of a RayClusterPool's start: a new actor (a new worker process) on each
    node, placed as its NodeActor is, answering once, then ended."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    empty = ray.remote(_Empty)
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
    actors = [
        empty.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote()
        for node in nodes
    ]
    ray.get([actor.ping.remote() for actor in actors])
    for actor in actors:
        ray.kill(actor)


def main(argv: list[str] | None = None) -> int:
    args, parts = cluster_arguments(__doc__.split("\n\n")[0], "runs,warm", argv)
    print(f"{os.cpu_count()} CPUs, ray {ray.__version__}", flush=True)
    started = time.perf_counter()
    with LocalRayCluster(2, cpus_per_node=1) as local, connect_ray(local.address):
        print(f"Ray cluster start-up {time.perf_counter() - started:.2f} s (in no figure)")
        if "runs" in parts:
            cache = str(Path(_SCRATCH) / "runs")
            with RayClusterPool(workers_per_node=1, cache_dir=cache) as cluster:
                _runs(cluster, args.runs, args.repeat)
        if "warm" in parts:
            _warm(local.address, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
