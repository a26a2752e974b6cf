"""Compiling twelve TPU training steps: pjrt-pool's pool against JAX, in one run.

Usage::

    python benchmarks/bench_tpu_compile.py [--workers 2,4] [--threads 4] [--repeat 1]
                                        [--programs 12] [--topology v5e:1x1] [--mesh 2x4]
                                        [--device-start when-needed,at-once]

Legs, each in a fresh process, alternated --repeat times (benchmarks/harness.py;
this machine's speed drifts between hours, so only ratios within one run mean
anything):

    jax-serial     jax.jit(step).lower(...).compile() of each step, one by one
    jax-threads    the same from a thread pool of --threads in one process
    pool-N         Pool(N compile workers).compile_many of the steps, into a
                   fresh cache directory (the pool's start is timed apart, and
                   with it: "start + compile_many"), its device workers started
                   when needed (DeviceStart.WHEN_NEEDED, the default: not while
                   compile_many runs)
    pool-N-at-once the same with device_start=DeviceStart.AT_ONCE (on the chip:
                   the device worker opens it beside the compiles), with
                   --device-start at-once

On a TPU host (a chip attached, no --topology) JAX compiles on the chip and
the pool is Pool(N, platform="tpu"): N compile workers beside the device
worker, as a user's pool is. Elsewhere, or with --topology, both compile
for the topology without a device (JAX through jax.experimental.topologies,
the pool as Pool(N, topology=...)): what a CI machine does (no device
worker there, so --device-start changes nothing). Prints each leg's
compile time against JAX serial's, each pool's start + compile time against
the best JAX leg's (goal: at most 0.95x), and each at-once leg's start +
compile time against the same pool's when needed.

--mesh DxM compiles the steps sharded over a mesh of D x M devices (axes
"data" and "model": pool.examples.training.sharded_train_steps), both legs
with the same shardings over the topology's devices (needs --topology, or a
host of that many chips): for example --topology v5e:2x4 --mesh 2x4.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import Side, compare, ratio_line, report


def _devices(topology: str | None) -> list[Any]:
    """The devices compiled for: the topology's (without a device), or the chips here."""
    import jax

    if topology is None:
        return jax.devices()  # the backend (the chip) opens before the clock starts
    from jax.experimental import topologies

    from worker.plugin.topology import parse_topology

    spec = parse_topology(topology)
    return topologies.get_topology_desc(spec.name, "tpu", **spec.create_options()).devices


def _steps(count: int, topology: str | None, mesh: str | None) -> list[Any]:
    """(name, function, shapes, jax.jit's shardings) of each step: on one device, or split over
    a mesh of the devices compiled for (--mesh)."""
    import numpy as np
    from jax.sharding import Mesh, SingleDeviceSharding

    from pool.examples.training import sharded_train_steps, train_steps

    devices = _devices(topology)
    if mesh is None:
        one = SingleDeviceSharding(devices[0])
        shardings = {"in_shardings": one, "out_shardings": one}
        return [(name, f, shapes, shardings) for name, f, shapes in train_steps()[:count]]
    shape = tuple(int(n) for n in mesh.split("x"))
    grid = Mesh(np.array(devices[: int(np.prod(shape))]).reshape(shape), ("data", "model"))
    return [
        (name, f, shapes, {"in_shardings": ins, "out_shardings": outs})
        for name, f, shapes, ins, outs in sharded_train_steps(grid)[:count]
    ]


def _jax_leg(threads: int, count: int, topology: str | None, mesh: str | None) -> dict[str, Any]:
    """Compiles the steps with JAX in this process: serially (threads 1) or from a pool."""
    import jax

    placed = _steps(count, topology, mesh)

    def compile_one(step: Any) -> float:
        _name, function, shapes, shardings = step
        started = time.perf_counter()
        jax.jit(function, **shardings).trace(*shapes).lower().compile()
        return time.perf_counter() - started

    started = time.perf_counter()
    if threads == 1:
        seconds = [compile_one(step) for step in placed]
    else:
        with concurrent.futures.ThreadPoolExecutor(threads) as executor:
            seconds = list(executor.map(compile_one, placed))
    return {"wall": time.perf_counter() - started, "per_program": seconds}


def _pool_leg(
    workers: int, count: int, topology: str | None, mesh: str | None, at_once: bool = False
) -> dict[str, Any]:
    """Compiles the steps with a Pool of `workers` compile workers into a fresh cache, its
    device workers started when needed (or at once)."""
    from pool import DeviceStart, Pool, lower

    steps = _steps(count, topology, mesh)
    one_device = mesh is None  # jax.jit's single-device shardings are lower()'s default
    programs = [
        lower(f, shapes, platform="tpu", **({} if one_device else shardings))
        for _, f, shapes, shardings in steps
    ]
    with tempfile.TemporaryDirectory(prefix="bench-tpu-") as cache:
        started = time.perf_counter()
        options: dict[str, Any] = {"topology": topology} if topology else {}
        options["device_start"] = DeviceStart.AT_ONCE if at_once else DeviceStart.WHEN_NEEDED
        if not topology and mesh is not None:  # on the chips: a device worker holds them all
            options["devices_per_worker"] = programs[0].partitioning.devices
        with Pool(workers, platform="tpu", cache_dir=cache, **options) as pool:
            start = time.perf_counter() - started
            began = time.perf_counter()
            pool.compile_many(programs)
            wall = time.perf_counter() - began
            compiled = pool.statistics.compiled
            roles = [w["role"] for w in pool.worker_info]
            # The device workers' state as compile_many returned: "not started" when needed.
            devices = [w["state"] for w in pool.worker_info if w["role"] == "device"]
    return {
        "wall": wall,
        "start": start,
        "total": start + wall,
        "compiled": compiled,
        "roles": roles,
        "devices_after": devices,
    }


def _one(leg: str, count: int, topology: str | None, mesh: str | None) -> dict[str, Any]:
    kind, _, size = leg.partition("-")
    if kind == "jax":
        return _jax_leg(1 if size == "serial" else int(size), count, topology, mesh)
    size, _, start = size.partition("-")
    return _pool_leg(int(size), count, topology, mesh, at_once=start == "at-once")


def _run_leg(leg: str, count: int, topology: str | None, mesh: str | None) -> dict[str, Any]:
    environment = dict(os.environ)
    if topology is not None:  # JAX loads libtpu itself: as pjrt-pool's compile workers do
        from worker.plugin.libtpu import compile_only_environment

        environment.update(compile_only_environment())
    if leg.startswith("pool") or topology is not None:
        environment["JAX_PLATFORMS"] = "cpu"  # the parent only lowers; the chip is the pool's
    else:
        environment.pop("JAX_PLATFORMS", None)  # JAX on the chip
    arguments = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--one",
        leg,
        "--programs",
        str(count),
    ]
    if topology:
        arguments += ["--topology", topology]
    if mesh:
        arguments += ["--mesh", mesh]
    done = subprocess.run(arguments, capture_output=True, text=True, env=environment, check=False)
    if done.returncode != 0:
        raise SystemExit(f"leg {leg} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers", default="4", help="pool sizes (compile workers), comma-separated"
    )
    parser.add_argument("--threads", type=int, default=4, help="threads of the JAX thread-pool leg")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--programs", type=int, default=12)
    parser.add_argument("--topology", default=None, help="compile for it without a device")
    parser.add_argument("--mesh", default=None, help="shard the steps over a DxM mesh (2x4)")
    parser.add_argument(
        "--device-start",
        default="when-needed",
        help="the pools' device_start, comma-separated: when-needed (pool-N), at-once "
        "(pool-N-at-once)",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, args.programs, args.topology, args.mesh)))
        return
    from worker.plugin import libtpu

    topology = args.topology
    if topology is None and libtpu.attached_chips() == 0:
        topology = "v5e:1x1"
    starts = {"when-needed": "", "at-once": "-at-once"}
    chosen = args.device_start.split(",")
    if unknown := set(chosen) - set(starts):
        raise SystemExit(f"--device-start takes {', '.join(starts)}, not {sorted(unknown)}")
    pools = [f"pool-{n}{starts[s]}" for n in args.workers.split(",") for s in chosen]
    legs = ["jax-serial", f"jax-{args.threads}", *pools]
    where = f"deviceless for {topology}" if topology else "on the chip"
    if args.mesh:
        where += f", sharded over a {args.mesh} mesh (data x model)"
    print(f"{args.programs} train steps, {where}, {os.cpu_count()} cores", flush=True)
    sides = [Side(leg, leg_figures(leg, args.programs, topology, args.mesh), True) for leg in legs]
    samples = compare(sides, args.repeat, warmup=0)
    report(samples, "compiling: JAX's compiles, compile_many", unit="s")
    best = min(samples.median("jax-serial"), samples.median(f"jax-{args.threads}"))
    print("each pool's start + compile_many, against the best JAX leg")
    ratio_line("the best JAX leg", best, best, "s")
    for leg in pools:
        ratio_line(leg, samples.median(leg, "total"), best, "s", goal=0.95)
    for leg in pools:
        when_needed = leg.removesuffix("-at-once")
        if leg != when_needed and when_needed in pools:
            ratio_line(f"{leg}, against {when_needed}", samples.median(leg, "total"),
                       samples.median(when_needed, "total"), "s")  # fmt: skip


def leg_figures(
    leg: str, count: int, topology: str | None, mesh: str | None
) -> Callable[[], dict[str, float]]:
    """A side's sample: one leg in a fresh process; its compile time ("wall") and, with the
    pool's start, "total" (a JAX leg's is its wall). A pool leg's workers are printed."""

    def measure() -> dict[str, float]:
        found = _run_leg(leg, count, topology, mesh)
        if "start" in found:
            devices = found["devices_after"]
            print(f"  {leg}: start {found['start']:.1f} s, workers {found['roles']}, device "
                  f"workers as compile_many returned {devices}", flush=True)  # fmt: skip
        return {"wall": found["wall"], "total": found.get("total", found["wall"])}

    return measure


if __name__ == "__main__":
    main()
