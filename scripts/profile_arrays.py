"""Where a large run's time goes, on both sides: copies, page faults, the plugin's own work.

Usage::

    python scripts/profile_arrays.py [--mib 1,16,256] [--calls 10] [--perf]

For f(x) = x * 2 + 1 on float32 arrays of each size, after two warm-up calls, runs
--calls calls each of jax.jit (numpy in and out), Executable.run in this process, and
Pool(1).run (with a numpy input, with one made by pool.asarray, with the numpy input's
copy on one thread, and with the outputs kept off the numpy input's segment), and prints per
call: the median time, the minor page faults taken by this process and by the
worker (/proc/PID/stat), and the CPU seconds of each; then each Pool.run side's calls
split where the request is built and sent and the reply read (the parent's work before
and while building it, its copy of a numpy input among it; the send; the wait for the
worker; the rest). With --perf, `perf record`
samples the worker and this process during the Pool.run calls and the report
groups their samples: the copies (memmove), the kernel zeroing fresh pages
(clear_page), other page-fault handling, XLA's own code (JIT-compiled kernels
and the plugin library), Python, and the rest.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("PJRT_POOL_CACHE_DIR", tempfile.mkdtemp(prefix="profile-arrays-"))
# Read before JAX is imported: --platform tpu, or --platform=tpu.
if "--platform=tpu" in sys.argv or ("--platform" in sys.argv and "tpu" in sys.argv):
    os.environ["JAX_PLATFORMS"] = "cpu"  # the pool's worker holds the chip, not this process

import jax
import jax.numpy as jnp
import numpy as np
from timing import copy_threads_variable, marked, with_environment  # this folder's

from pool import Pool, compile_program, lower
from pool.executor import inputs as pool_inputs

T = TypeVar("T")

CLOCK = os.sysconf("SC_CLK_TCK")


def counters(pid: int) -> tuple[int, float]:
    """A process's minor page faults and CPU seconds so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7]), (int(fields[11]) + int(fields[12])) / CLOCK


def measure(call: Callable[[], Any], calls: int, worker: int | None) -> dict[str, float]:
    """Per call: the median seconds, and the faults and CPU seconds of both processes."""
    for _ in range(2):
        call()
    me = os.getpid()
    before = counters(me), counters(worker) if worker else (0, 0.0)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    after = counters(me), counters(worker) if worker else (0, 0.0)
    return {
        "ms": statistics.median(times) * 1e3,
        "faults": (after[0][0] - before[0][0]) / calls,
        "cpu_ms": (after[0][1] - before[0][1]) / calls * 1e3,
        "worker_faults": (after[1][0] - before[1][0]) / calls,
        "worker_cpu_ms": (after[1][1] - before[1][1]) / calls * 1e3,
    }


GROUPS = (
    ("copies (memmove)", ("memmove", "memcpy")),
    ("zeroing fresh pages", ("clear_page", "clear_huge_page", "folio_zero")),
    ("page faults, mappings", ("fault", "mmap", "munmap", "unmap", "pte", "folio", "tlb", "page")),
    ("the plugin (XLA)", ("pjrt_c_api", "[JIT]", "xla", "Eigen", "tsl")),
    ("Python", ("libpython", "_PyEval", "Py")),
)


def outputs_apart(call: Callable[[], T]) -> T:
    """Makes a call whose numpy inputs' segment the outputs may not go over
    (TaskMemory.spare answers None): they go to a segment of their own, as before stop 57,
    which tells that placement's share of a call apart from the copy's."""
    memory = pool_inputs.TaskMemory
    spare = memory.spare
    memory.spare = lambda self: None  # type: ignore[method-assign]
    try:
        return call()
    finally:
        memory.spare = spare  # type: ignore[method-assign]


def split(call: Callable[[], Any], calls: int) -> dict[str, float] | None:
    """Median ms of a direct Pool.run's parts: the parent's work before it builds the request
    (its copy of a numpy input among it), the request's making, its send, the wait for the
    worker's reply, and the reply's reading and the rest; None for a tree without these
    steps, or calls that did not take the direct path."""
    from pool.executor import caller, requests, worker_process

    steps = (
        (requests.Requests, "build"),
        (worker_process.WorkerProcess, "send"),
        (caller.CallerPath, "receive_directly"),
    )
    if not all(hasattr(owner, name) for owner, name in steps):
        return None
    marks: dict[str, int] = {}
    names = ("before build", "build", "send", "worker", "after")
    parts: dict[str, list[int]] = {name: [] for name in names}
    with marked(steps, marks):
        for _ in range(calls):
            marks.clear()
            start = time.perf_counter_ns()
            call()
            end = time.perf_counter_ns()
            if len(marks) != 6:
                continue
            points = [start, marks["build start"], marks["build end"], marks["send start"],
                      marks["send end"], marks["receive_directly start"], end]  # fmt: skip
            parts["before build"].append(points[1] - points[0])
            parts["build"].append(points[2] - points[1])
            parts["send"].append(points[4] - points[3])
            parts["worker"].append(points[5] - points[4])
            parts["after"].append(points[6] - points[5])
    if not parts["send"]:
        return None
    return {name: statistics.median(values) / 1e6 for name, values in parts.items()}


def perf_report(data: Path) -> list[str]:
    """The samples of a perf record, grouped (see GROUPS), by process."""
    done = subprocess.run(
        ["perf", "report", "-i", str(data), "--no-children", "--sort", "pid,dso,sym", "-g",
         "none", "--stdio"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    shares: dict[str, dict[str, float]] = {}
    for line in done.stdout.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "%" not in line.split()[0]:
            continue
        share = float(line.split()[0].rstrip("%"))
        process = line.split()[1]
        group = next((g for g, keys in GROUPS if any(k in line for k in keys)), "other")
        shares.setdefault(process, {}).setdefault(group, 0.0)
        shares[process][group] += share
    return [
        f"      {process}: " + ", ".join(f"{g} {v:.0f}%" for g, v in sorted(groups.items(),
                                                                          key=lambda i: -i[1]))
        for process, groups in shares.items()
    ]  # fmt: skip


def profile_size(
    pool: Pool, worker: int, mib: int, calls: int, perf: bool, platform: str = "cpu"
) -> None:
    """Prints the four sides' figures for one size (and Pool.run's samples, with perf).

    On a TPU only the pool's sides: its worker holds the chip, which one process at a
    time may hold (tpu_arrays.py compares jax.jit there, in a process of its own).
    """
    n = mib << 18
    program = lower(
        lambda x: x * 2 + 1, [jax.ShapeDtypeStruct((n,), jnp.float32)], platform=platform
    )
    x = np.random.default_rng(0).random(n, dtype=np.float32)
    sides: dict[str, tuple[Callable[[], Any], int | None]] = {}
    if platform == "cpu":
        executable, _ = compile_program(program)
        jitted = jax.jit(lambda x: x * 2 + 1)
        sides["jax.jit"] = (lambda: np.asarray(jitted(x)), None)
        sides["Executable.run"] = (lambda: executable.run([x]), None)
    sides["Pool.run"] = (lambda: pool.run(program, [x]), worker)
    if hasattr(pool, "asarray"):  # a tree before pool.asarray profiles the rest
        shared = pool.asarray(x)
        sides["Pool.run, shared input"] = (lambda: pool.run(program, [shared]), worker)
    variable = copy_threads_variable()
    if variable is not None:  # a tree that spreads large copies: the same call on one thread
        sides["Pool.run, 1 copy thread"] = (
            lambda: with_environment(variable, "1", lambda: pool.run(program, [x])),
            worker,
        )
    if hasattr(getattr(pool_inputs, "TaskMemory", None), "spare"):  # outputs over inputs' copy
        sides["Pool.run, outputs apart"] = (
            lambda: outputs_apart(lambda: pool.run(program, [x])),
            worker,
        )
    print(
        f"\n  {mib} MiB: per call   ms      faults here   CPU ms here   faults worker   "
        "CPU ms worker"
    )
    for name, (call, pid) in sides.items():
        found = measure(call, calls, pid)
        print(
            f"    {name:<22} {found['ms']:8.2f} {found['faults']:12.0f} "
            f"{found['cpu_ms']:12.2f} {found['worker_faults']:15.0f} "
            f"{found['worker_cpu_ms']:14.2f}"
        )
    print("    the same calls' parts, ms: before the request is built, its building, its "
          "send, the worker's reply, reading it and after")  # fmt: skip
    for name, (call, pid) in sides.items():
        parts = split(call, calls) if pid is not None else None
        if parts is not None:
            print(f"    {name:<22} " + "  ".join(f"{k} {v:6.2f}" for k, v in parts.items()))
    if perf:
        data = Path(tempfile.mkdtemp(prefix="perf-")) / "perf.data"
        recorder = subprocess.Popen(
            ["perf", "record", "-F", "2000", "-o", str(data), "-p", f"{os.getpid()},{worker}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)
        measure(sides["Pool.run"][0], calls, worker)
        recorder.terminate()
        recorder.wait()
        print("    Pool.run's samples, by process (this one, the worker and its threads):")
        print("\n".join(perf_report(data)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", default="1,16,256")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--perf", action="store_true", help="sample both processes with perf")
    parser.add_argument(
        "--platform", default="cpu", choices=("cpu", "tpu"),
        help="tpu: the pool's sides on the chip (JAX_PLATFORMS=cpu is set for this process)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.perf and shutil.which("perf") is None:
        parser.error("perf is not installed")
    with Pool(1, platform=args.platform) as pool:
        pool.run(lower(lambda x: x + 1, [jax.ShapeDtypeStruct((4,), jnp.float32)],
                       platform=args.platform), [np.ones(4, np.float32)])  # fmt: skip
        worker = next(w["pid"] for w in pool.worker_info if w.get("pid") and
                      w.get("role", "device") != "compile")  # fmt: skip
        print(
            f"profile_arrays: jax {jax.__version__}, {os.cpu_count()} CPUs, "
            f"platform {args.platform}, worker {worker}"
        )
        for mib in (int(m) for m in args.mib.split(",")):
            profile_size(pool, worker, mib, args.calls, args.perf, args.platform)
    return 0


if __name__ == "__main__":
    sys.exit(main())
