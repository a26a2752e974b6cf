"""Where a small program's round trip through the Pool goes, step by step, on both sides.

Usage::

    python scripts/profile_round_trip.py [--calls N]

Runs the tiny program (x + 1, float32[4]) --calls times with Pool(1).run
after a warm-up and prints the mean microseconds per call of each step:
in the parent, Pool.run's own steps (new task, staging, claiming, sending,
waiting, receiving, handling the reply); in the worker, the wait for the
next request, its receive, its handling and, within that, the run itself.
Each step is timed by a wrapper (time.perf_counter_ns), which adds about a
microsecond per wrapped call; the worker's are installed by the pool's
initializer. Both sides spin before they sleep, so one side's waiting is
the other's work plus two socket hops. Functions a version of the pool does
not have are left out, so the same script profiles older trees too.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPORT = Path(tempfile.mkdtemp(prefix="profile-round-trip-")) / "worker.txt"
os.environ["PJRT_POOL_CACHE_DIR"] = str(REPORT.parent / "cache")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pool import Pool, lower  # noqa: E402
from pool.executor import dispatch  # noqa: E402
from pool.executor import pool as pool_module  # noqa: E402
from worker import protocol  # noqa: E402

Totals = collections.defaultdict[str, int]


def wrap(owner: Any, name: str, totals: Totals, label: str | None = None) -> None:
    """Replaces owner.name with a wrapper that adds its nanoseconds to totals[label]."""
    original = getattr(owner, name, None)
    if original is None:
        return
    key = label or name

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter_ns() - start

    setattr(owner, name, timed)


def per_call(totals: Totals, calls: int) -> str:
    return "  ".join(
        f"{name} {nanoseconds / calls / 1000:.1f}" for name, nanoseconds in totals.items()
    )


def time_the_worker(report: str, every: int) -> None:
    """The pool's initializer: wraps the worker's steps, and writes their means to `report`."""
    # Here: this runs in the worker, which imports these itself.
    import worker.server as server
    from worker.executable import Executable

    totals: Totals = collections.defaultdict(int)
    handled = [0]
    wrap(protocol, "spin_until_readable", totals, "waiting")
    wrap(protocol, "recv_frame", totals)
    wrap(Executable, "run_into", totals, "run_into (XLA)")
    handle = server.Server.handle

    def timed_handle(self: Any, request: Any, fds: list[int]) -> bool:
        start = time.perf_counter_ns()
        try:
            return handle(self, request, fds)
        finally:
            totals["handle"] += time.perf_counter_ns() - start
            handled[0] += 1
            if handled[0] % every == 0:
                Path(report).write_text(per_call(totals, handled[0]))

    server.Server.handle = timed_handle  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    args = parser.parse_args(argv)
    tiny = lower(lambda x: x + 1, [jax.ShapeDtypeStruct((4,), jnp.float32)])
    x = np.ones(4, np.float32)
    warm_up = 1000
    with Pool(1, initializer=time_the_worker, initargs=(str(REPORT), warm_up + args.calls)) as pool:
        for _ in range(warm_up):
            pool.run(tiny, [x])
        totals: Totals = collections.defaultdict(int)
        for name in ("run", "_new_task", "_stage", "_claim_for_caller"):
            wrap(pool_module.Pool, name, totals)
        for name in ("send", "_request_for", "receive", "_handle", "_handle_hot", "_finish"):
            wrap(dispatch.Dispatcher, name, totals)
        wrap(protocol, "spin_until_readable", totals, "waiting")
        wrap(protocol, "recv_frame", totals)
        wrap(protocol, "send_frame", totals)
        started = time.perf_counter()
        for _ in range(args.calls):
            pool.run(tiny, [x])
        wall = (time.perf_counter() - started) / args.calls * 1e6
        deadline = time.monotonic() + 10
        while not REPORT.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    print(f"Pool(1).run of the tiny program, {args.calls} calls: {wall:.1f} us per call (timed)")
    print(f"parent (us per call): {per_call(totals, args.calls)}")
    print(f"worker (us per call): {REPORT.read_text() if REPORT.exists() else '(no report)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
