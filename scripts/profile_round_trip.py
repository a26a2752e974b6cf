"""Where a small program's round trip through the Pool goes, step by step.

Usage::

    python scripts/profile_round_trip.py [--calls N] [--platform tpu]

Runs the tiny program (x + 1, float32[4]) --calls times with Pool(1).run
(on --platform's device worker: on a TPU host this process leaves the chip
to it, JAX_PLATFORMS=cpu, and opens it itself only once the pool is closed)
after a warm-up and prints the median microseconds of:

- the call's segments, split at the three socket steps of the direct path
  (timestamps around protocol.send_frame, spin_until_readable and
  recv_frame): the parent's work before sending, the send, the wait for the
  reply (the worker's receive, run and reply, which the worker's native hot
  loop does without Python, plus two socket hops), the receive, and the
  parent's work after it;
- a bare exchange with the same worker in the fewest Python calls (no
  task, future, claim or settling): what the bookkeeping costs on top;
- each of Pool.run's own steps, timed alone (a time.perf_counter_ns wrapper
  each, which adds about a microsecond to what it wraps);
- the worker's part without the socket: the same program's hot slot run by
  a HotLoop in this process (HotLoop.run), and Executable.run beside it;
- pool.submit(...).result() of the same program, split where submit returns.

Functions a version of the pool does not have are left out, so the same
script profiles older trees too.
"""

from __future__ import annotations

import argparse
import collections
import mmap
import os
import select
import socket
import sys
import tempfile
import time
from typing import Any

os.environ["PJRT_POOL_CACHE_DIR"] = tempfile.mkdtemp(prefix="profile-round-trip-")
# Read before JAX is imported: --platform tpu, or --platform=tpu.
if "--platform=tpu" in sys.argv or ("--platform" in sys.argv and "tpu" in sys.argv):
    os.environ["JAX_PLATFORMS"] = "cpu"  # the pool's worker holds the chip, not this process

import jax
import jax.numpy as jnp
import numpy as np
from timing import marked  # this folder's

from pool import Pool, compile_program, lower
from pool.executor import caller, dispatch, requests
from pool.executor import pool as pool_module
from pool.executor.workers import Source
from worker import _pjrt
from worker.serve import server
from worker.wire import protocol, shm

Samples = collections.defaultdict[str, list[int]]
_now = time.perf_counter_ns


def median_us(values: list[int]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] / 1000 if ordered else float("nan")


def wrap(owner: Any, name: str, samples: Samples, recording: list[bool]) -> None:
    """Replaces owner.name with a wrapper that records its nanoseconds per call."""
    original = getattr(owner, name, None)
    if original is None:
        return

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = _now()
        try:
            return original(*args, **kwargs)
        finally:
            if recording[0]:
                samples[name].append(_now() - start)

    setattr(owner, name, timed)


def segments(pool: Pool, tiny: Any, x: np.ndarray, calls: int) -> dict[str, list[int]]:
    """The direct path's segments per call, split at its three socket steps."""
    marks: dict[str, int] = {}
    steps = [(protocol, name) for name in ("send_frame", "spin_until_readable", "recv_frame")]
    found: dict[str, list[int]] = collections.defaultdict(list)
    with marked(steps, marks):
        for _ in range(calls):
            marks.clear()
            start = _now()
            pool.run(tiny, [x])
            end = _now()
            if len(marks) != 6:
                continue  # a call that did not take the direct path
            points = [
                ("before sending", start, marks["send_frame start"]),
                ("send_frame", marks["send_frame start"], marks["send_frame end"]),
                (
                    "waiting: the worker",
                    marks["spin_until_readable start"],
                    marks["spin_until_readable end"],
                ),
                ("recv_frame", marks["recv_frame start"], marks["recv_frame end"]),
                ("after receiving", marks["recv_frame end"], end),
                ("the whole call", start, end),
            ]
            for name, begin, finish in points:
                found[name].append(finish - begin)
    return found


def steps(pool: Pool, tiny: Any, x: np.ndarray, calls: int) -> Samples:
    """Each of Pool.run's steps, timed alone."""
    samples: Samples = collections.defaultdict(list)
    recording = [False]
    for name in ("_new_task", "_stage"):
        wrap(pool_module.WorkerPool, name, samples, recording)
    wrap(caller.CallerPath, "claim", samples, recording)
    wrap(requests.Requests, "build", samples, recording)
    for name in ("send", "receive", "_handle_hot", "_finish"):
        wrap(dispatch.Dispatcher, name, samples, recording)
    recording[0] = True
    for _ in range(calls):
        pool.run(tiny, [x])
    recording[0] = False
    return samples


def native_runs(tiny: Any, x: np.ndarray, calls: int) -> tuple[list[int], list[int]] | None:
    """The hot slot run by a HotLoop in this process, and Executable.run, per call
    (None for a tree without a native hot loop)."""
    executable, _ = compile_program(tiny, disk_cache=False)
    register_slot = getattr(server, "register_slot", None)
    if register_slot is None:
        return None
    arena_size = 4096
    arena = mmap.mmap(-1, arena_size + protocol.CONTROL_BYTES)
    ours, theirs = socket.socketpair()
    loop = _pjrt.HotLoop(theirs.fileno(), arena, arena_size, 0.0)
    types = executable.input_types
    input_offsets, end = shm.layout(types)
    output_offsets, _ = shm.layout(executable.output_types, end)
    register_slot(loop, 0, executable, types, input_offsets, output_offsets)
    hot, full = [], []
    for _ in range(calls):
        start = _now()
        loop.run(0, 0, True)
        middle = _now()
        executable.run([x])
        hot.append(middle - start)
        full.append(_now() - middle)
    ours.close()
    theirs.close()
    return hot, full


def bare_exchanges(pool: Pool, x: np.ndarray, calls: int) -> list[int]:
    """The same exchange with the pool's worker in the fewest Python calls: the bound.

    Inputs copied into the arena, a packed HotRun sent, a poll spin, the
    HotReply read into a buffer, outputs copied out; no task, future, claim
    or settling. The worker is taken out of the manager's wait set meanwhile.
    """
    # The worker that runs (a TPU pool has compile workers beside it, without hot slots).
    (worker,) = [worker for worker in pool._workers if worker.hot]
    hot = next(iter(worker.hot.values()))
    sock = worker.sock
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    frame = protocol._HOT_RUN  # the header and HotRun's fields
    reply = bytearray(frame.size)
    wait_set = pool._wait_set
    with pool._lock:
        if getattr(worker, "parked", False):
            # Its socket is out of the wait set already; unparked, the manager does not
            # put it back meanwhile (it would read these replies as a protocol breach).
            worker.park(False)
        else:
            wait_set.remove(sock.fileno())
    times = []
    try:
        for task_id in range(1 << 40, (1 << 40) + calls):
            start = _now()
            hot.inputs[0][...] = x
            sock.sendall(
                frame.pack(protocol.MIN_PAYLOAD, 0, protocol.Format.HOT_RUN, task_id, hot.slot, 1)
            )
            while not poller.poll(0):
                pass
            sock.recv_into(reply)
            hot.outputs[0].copy()
            times.append(_now() - start)
    finally:
        with pool._lock:
            wait_set.add(sock.fileno(), (Source.SOCKET, worker))
    return times


def submits(pool: Pool, tiny: Any, x: np.ndarray, calls: int) -> dict[str, list[int]]:
    """pool.submit(...).result(), split where submit returns."""
    parts: dict[str, list[int]] = {"submit()": [], "result()": [], "the whole": []}
    for _ in range(calls):
        start = _now()
        future = pool.submit(tiny, [x])
        submitted = _now()
        future.result()
        end = _now()
        parts["submit()"].append(submitted - start)
        parts["result()"].append(end - submitted)
        parts["the whole"].append(end - start)
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument(
        "--platform", default="cpu", help="the pool's platform (tpu: its device worker's chip)"
    )
    args = parser.parse_args(argv)
    tiny = lower(lambda x: x + 1, [jax.ShapeDtypeStruct((4,), jnp.float32)], platform=args.platform)
    x = np.ones(4, np.float32)
    with Pool(1, platform=args.platform) as pool:
        for _ in range(1000):
            pool.run(tiny, [x])
        split = segments(pool, tiny, x, args.calls)
        bare = bare_exchanges(pool, x, args.calls)
        timed = steps(pool, tiny, x, args.calls)
        submitted = submits(pool, tiny, x, args.calls)
    runs = native_runs(tiny, x, args.calls)
    print(f"Pool(1).run of the tiny program on {args.platform}, {args.calls} calls, medians in us")
    print(f"the call, split at its socket steps ({len(split['the whole call'])} direct calls):")
    for name, values in split.items():
        print(f"    {name:22s} {median_us(values):7.1f}")
    print(f"    {'a bare exchange':22s} {median_us(bare):7.1f}   (the same, without bookkeeping)")
    print("Pool.run's steps, each timed alone:")
    for name, values in timed.items():
        print(
            f"    {name:22s} {median_us(values):7.1f}   ({len(values) / args.calls:.1f} per call)"
        )
    print("pool.submit(...).result(), split where submit returns:")
    for name, values in submitted.items():
        print(f"    {name:22s} {median_us(values):7.1f}")
    if runs is None:
        return 0
    hot, full = runs
    print("the worker's part, in this process:")
    print(f"    {'HotLoop.run':22s} {median_us(hot):7.1f}   (what the worker's hot loop runs)")
    print(f"    {'Executable.run':22s} {median_us(full):7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
