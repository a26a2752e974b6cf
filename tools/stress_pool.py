"""Stress the worker pool from many threads and check every result, descriptor and byte.

Usage::

    python tools/stress_pool.py [--threads 8] [--tasks 3000] [--workers 2] [--large-every 50]

Each of --threads threads sends --tasks tasks to one Pool, alternating
``submit`` and ``run`` and mixing four programs: a tiny one (inputs and
outputs in the worker's arena), one with a 256 KiB input (a segment of its
own), a 64 KiB one that goes through the arena both ways, and every
--large-every-th task one that returns 16 MiB (an output segment, recycled
between tasks). Every input carries a value unique to its task, so a result
computed from another task's arguments, a lost result or a duplicated one
shows. While it runs, the parent's open descriptors and RSS are sampled;
after it, they must be back near where they started, and after close() no
worker process and no shared memory may be left.

Prints one JSON summary and exits 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pool import Pool, lower

BIG = 1 << 22  # float32 elements: 16 MiB


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def memfds() -> int:
    found = 0
    for entry in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone already
            found += os.readlink(f"/proc/self/fd/{entry}").startswith("/memfd:")
    return found


def worker_children() -> list[int]:
    me, children = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == me:
                children.append(int(entry))
    return children


def programs() -> dict[str, Any]:
    f32 = jnp.float32
    return {
        "tiny": lower(lambda x: x * 2.0 + 1.0, [jax.ShapeDtypeStruct((4,), f32)]),
        "input": lower(
            lambda x: x.sum() * 0.0 + x[:4] * 2.0 + 1.0, [jax.ShapeDtypeStruct((65536,), f32)]
        ),
        "arena": lower(lambda x: x * 2.0 + 1.0, [jax.ShapeDtypeStruct((16384,), f32)]),
        "large": lower(lambda s: jnp.full((BIG,), 1.0, f32) * s, [jax.ShapeDtypeStruct((), f32)]),
    }


def check(kind: str, tag: float, outputs: list[np.ndarray]) -> bool:
    """Whether outputs are exactly what the task with this tag computes."""
    (out,) = outputs
    if kind == "large":
        return out.shape == (BIG,) and bool(np.all(out == np.float32(tag)))
    return bool(np.all(out == np.float32(tag) * 2 + 1))


def arguments(kind: str, tag: float) -> list[np.ndarray]:
    size = {"tiny": 4, "input": 65536, "arena": 16384}.get(kind)
    if size is None:
        return [np.float32(tag)]
    return [np.full(size, tag, np.float32)]


def stress(threads: int, tasks: int, workers: int, large_every: int) -> dict[str, Any]:
    compiled = programs()
    summary: dict[str, Any] = {"threads": threads, "tasks_per_thread": tasks, "workers": workers}
    wrong: list[str] = []
    seen: dict[float, int] = {}
    seen_lock = threading.Lock()
    samples: list[tuple[int, float]] = []
    with Pool(workers) as pool:
        for kind, program in compiled.items():  # warm up: compile, and map some segments
            assert check(kind, 1.0, pool.run(program, arguments(kind, 1.0)))
        gc.collect()
        fds_before, rss_before = open_descriptors(), rss_mib()

        def one_thread(index: int) -> None:
            rng = random.Random(index)
            pending: list[tuple[str, float, Future[list[np.ndarray]]]] = []

            def collect(kind: str, tag: float, outputs: list[np.ndarray]) -> None:
                with seen_lock:
                    seen[tag] = seen.get(tag, 0) + 1
                if not check(kind, tag, outputs):
                    wrong.append(f"{kind} tag {tag}")

            for i in range(tasks):
                tag = float(index * 1_000_000 + i + 2)  # exact in float32 below 2**24
                if large_every and i % large_every == large_every - 1:
                    kind = "large"
                else:
                    kind = rng.choice(("tiny", "tiny", "input", "arena"))
                if i % 2:
                    collect(kind, tag, pool.run(compiled[kind], arguments(kind, tag)))
                else:
                    pending.append((kind, tag, pool.submit(compiled[kind], arguments(kind, tag))))
                if len(pending) >= 16 or i == tasks - 1:
                    for kind_, tag_, future in pending:
                        collect(kind_, tag_, future.result(timeout=300))
                    pending.clear()
                if i % 100 == 0 and index == 0:
                    samples.append((open_descriptors(), rss_mib()))

        started = time.perf_counter()
        runners = [threading.Thread(target=one_thread, args=(i,)) for i in range(threads)]
        for runner in runners:
            runner.start()
        for runner in runners:
            runner.join()
        summary["seconds"] = round(time.perf_counter() - started, 2)
        gc.collect()
        fds_after, rss_after = open_descriptors(), rss_mib()
        summary["statistics"] = pool.statistics._asdict()
    gc.collect()
    return _judged(summary, seen, wrong, samples, (fds_before, fds_after), (rss_before, rss_after))


def _judged(
    summary: dict[str, Any],
    seen: dict[float, int],
    wrong: list[str],
    samples: list[tuple[int, float]],
    fds: tuple[int, int],
    rss: tuple[float, float],
) -> dict[str, Any]:
    """The summary with what the run found (results, descriptors and memory before,
    at their peak and after, what close left) and the checks it passed."""
    (fds_before, fds_after), (rss_before, rss_after) = fds, rss
    threads, tasks = summary["threads"], summary["tasks_per_thread"]
    expected = threads * tasks
    tags = threads * tasks
    summary.update(
        tasks=expected,
        results=sum(seen.values()),
        distinct=len(seen),
        duplicated=sum(1 for count in seen.values() if count > 1),
        wrong=len(wrong),
        wrong_examples=wrong[:5],
        fds={"before": fds_before, "peak": max([s[0] for s in samples] + [fds_after])},
        rss_mib={
            "before": round(rss_before),
            "peak": round(max([s[1] for s in samples] + [rss_after])),
        },
    )
    summary["fds"]["after"] = fds_after
    summary["rss_mib"]["after"] = round(rss_after)
    summary["after_close"] = {"worker_processes": len(worker_children()), "memfds": memfds()}
    checks = {
        "every result right": not wrong,
        "none lost or duplicated": summary["results"] == expected and len(seen) == tags,
        # Flat: what the pool keeps (segment_fds, 64 by default) plus a little.
        "descriptors flat": fds_after - fds_before <= 70,
        # Flat: the recycled segments (at most 512 MiB by default) plus allocator noise.
        "RSS flat": rss_after - rss_before <= 600,
        "nothing left after close": summary["after_close"] == {"worker_processes": 0, "memfds": 0},
    }
    summary["checks"] = checks
    summary["passed"] = all(checks.values())
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=3000, help="tasks per thread")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--large-every", type=int, default=50, help="every Nth task returns 16 MiB")
    args = parser.parse_args(argv)
    summary = stress(args.threads, args.tasks, args.workers, args.large_every)
    print(json.dumps(summary, indent=2))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
