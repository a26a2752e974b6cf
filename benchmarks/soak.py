"""Soak: one long-lived process makes pools, runs tasks, keeps values, and is interrupted.

Usage: python benchmarks/soak.py [--pools 200] [--tasks 20] [--workers 1] [--seed 0]

One process does what a notebook or a service does over hours: it makes
--pools Pools, each over a cache directory of its own (made, then removed
after the pool closes), runs --tasks tasks in each (runs and submits of
small and large arrays, arrays made by pool.asarray and pool.empty, values
kept on a worker's device and fetched back, results kept past the pool's end
and dropped later), and mixes in what goes wrong: a worker killed with
SIGKILL while it runs a task (every 7th pool), and a real Ctrl-C, SIGINT to
this process at a moment drawn from --seed while a task runs or the pool
starts or closes (every 5th pool). A KeyboardInterrupt ends that pool's with
block, as it would end a user's.

It measures before the first of those pools (after three warm-up pools: a
plain one, one interrupted and one with a worker killed, which make what a
process makes once, such as imports and the thread stacks glibc keeps for
reuse) and after the last (results dropped, garbage collected): this
process's file descriptors, its threads (the kernel's count, native ones
included, and Python's), its memory mappings, the shared-memory segments it
holds or maps (pjrt-pool's are memfds), any file in /dev/shm named as
pjrt-pool's, its live child processes, and its resident and anonymous
memory. It prints a table of each at start and end, and exits 1 if a count
grew. Memory, and the anonymous mappings (the heap, thread stacks and
glibc's malloc arenas, which it makes as threads first allocate at once,
up to eight per core, and keeps for reuse), are printed, not judged;
pjrt-pool's own mappings are of files and segments, which are.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from pool import Pool, WorkerCrashedError, lower

COUNTS = ("descriptors", "threads (kernel)", "threads (Python)", "mappings of files",
          "shared-memory segments", "pjrt-pool's /dev/shm files", "child processes")  # fmt: skip
"""The resources that must come back to where they started."""


def _children() -> int:
    """This process's live (not zombie) children, from /proc."""
    me, found = os.getpid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            found += 1
    return found


def _segments() -> int:
    """The shared-memory segments this process holds (a descriptor) or maps: pjrt-pool's are
    memfds, which the kernel frees with their last descriptor and mapping."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
                held.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/memfd:"):
            held.add(int(fields[4]))
    return len(held)


def _shm_files() -> int:
    """Files in /dev/shm named as pjrt-pool would name them (it makes none: its segments are
    memfds); other programs' files there come and go with them, so they are not counted."""
    if not os.path.isdir("/dev/shm"):
        return 0
    return sum(name.startswith(("pjrt", "memfd")) for name in os.listdir("/dev/shm"))


def _memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _mappings() -> list[str]:
    """What each of this process's memory mappings maps: a file's path, "/memfd:..." (a
    shared-memory segment), "[heap]", "[stack]", or "" for anonymous memory."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return [fields[5] if len(fields) > 5 else "" for fields in map(str.split, lines)]


def measure() -> dict[str, float]:
    """Every resource this benchmark watches, now."""
    gc.collect()
    return {
        "descriptors": len(os.listdir("/proc/self/fd")) - 1,  # less listdir's own
        "threads (kernel)": len(os.listdir("/proc/self/task")),
        "threads (Python)": threading.active_count(),
        "mappings of files": sum(name.startswith("/") for name in _mappings()),
        "anonymous mappings": sum(not name.startswith("/") for name in _mappings()),
        "shared-memory segments": _segments(),
        "pjrt-pool's /dev/shm files": _shm_files(),
        "child processes": _children(),
        "resident memory (MiB)": _memory_kib("VmRSS") / 1024,
        "anonymous memory (MiB)": _memory_kib("RssAnon") / 1024,
    }


def _heavy(x):
    import jax

    return jax.lax.fori_loop(0, 400, lambda _, a: np.float32(0.5) * (a @ a) / 256 + 0.5, x)


class Programs:
    """The programs the soak runs: lowered once, run by every pool."""

    def __init__(self) -> None:
        import jax.numpy as jnp

        f32 = np.float32
        self.small = lower(lambda x: x * 2 + 1, [np.zeros(16, f32)])
        self.large = lower(lambda x: jnp.tanh(x) * 2, [np.zeros((512, 256), f32)])  # 512 KiB
        self.ints = lower(lambda i: i * 3, [np.zeros(16, np.int32)])
        self.heavy = lower(_heavy, [np.zeros((256, 256), f32)])  # tens of ms: kills land in it


class Interrupter:
    """Sends this process a real SIGINT, as a terminal's Ctrl-C does, after a delay."""

    def __init__(self) -> None:
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._pending = False  # sent, and its KeyboardInterrupt not yet seen

    def arm(self, delay: float) -> None:
        self._timer = threading.Timer(delay, self._fire)
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._pending = True
                os.kill(os.getpid(), signal.SIGINT)

    def received(self) -> None:
        """Its KeyboardInterrupt was seen."""
        self._pending = False

    def disarm(self) -> None:
        """Stops a SIGINT not yet sent; one sent and not yet seen is waited for (its
        KeyboardInterrupt is raised here)."""
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if self._pending:
            time.sleep(5)  # the KeyboardInterrupt comes during this sleep
            raise AssertionError("a SIGINT was sent and no KeyboardInterrupt came")


class Tally:
    def __init__(self) -> None:
        self.pools = self.tasks = self.interrupts = self.kills = self.crashed_tasks = 0
        self.kept_values = 0


def one_pool(
    interrupt: bool,
    kill: bool,
    programs: Programs,
    tasks: int,
    workers: int,
    rng: random.Random,
    kept: list[np.ndarray],
    tally: Tally,
    interrupter: Interrupter,
) -> None:
    """One pool's life over its own cache directory (removed afterwards)."""
    directory = tempfile.mkdtemp(prefix="soak-cache-")
    try:
        try:
            if interrupt:
                interrupter.arm(rng.uniform(0.0, 2.0))  # from before the pool starts to its end
            with Pool(workers, cache_dir=directory) as pool:
                _tasks(pool, programs, tasks, rng, kept, tally, kill)
        except KeyboardInterrupt:
            interrupter.received()
            raise
        finally:
            interrupter.disarm()
    except KeyboardInterrupt:  # in the with block, or where disarm waited for it
        interrupter.received()
        tally.interrupts += 1
    tally.pools += 1
    shutil.rmtree(directory, ignore_errors=True)


def _tasks(
    pool: Pool,
    programs: Programs,
    tasks: int,
    rng: random.Random,
    kept: list[np.ndarray],
    tally: Tally,
    kill: bool,
) -> None:
    small_in = np.arange(16, dtype=np.float32)
    large_in = pool.asarray(np.full((512, 256), 0.25, np.float32))
    filled = pool.empty((512, 256), np.float32)
    filled[...] = 1.0
    for number in range(tasks):
        step = number % 6
        if step == 0:
            (out,) = pool.run(programs.small, [small_in])
        elif step == 1:
            (out,) = pool.run(programs.large, [large_in if number % 2 else filled])
            if rng.random() < 0.3:
                kept.append(out)  # outlives the pool: dropped later, in the main loop
        elif step == 2:
            futures = [pool.submit(programs.small, [small_in + k]) for k in range(4)]
            for future in futures:
                future.result()
        elif step == 3:
            (value,) = pool.run(programs.large, [large_in], keep=0)  # stays on the worker
            (again,) = pool.run(programs.large, [value], keep=0)
            np.asarray(again)
            tally.kept_values += 2
            del value, again
        elif step == 4:
            put = pool.put(np.ones(16, np.float32))
            pool.run(programs.small, [put])
            tally.kept_values += 1
            del put
        else:
            pool.run(programs.ints, [pool.asarray(np.arange(16, dtype=np.int32))])
        tally.tasks += 1
    if kill:
        future = pool.submit(programs.heavy, [np.eye(256, dtype=np.float32)])
        time.sleep(rng.uniform(0.0, 0.05))
        pids = [info["pid"] for info in pool.worker_info if info.get("pid")]
        if pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rng.choice(pids), signal.SIGKILL)
            tally.kills += 1
        try:
            future.result()
        except WorkerCrashedError:
            tally.crashed_tasks += 1
        pool.run(programs.small, [small_in])  # the replacement works
        tally.tasks += 2
    # The heavy program, so that a Ctrl-C has a run to land in.
    pool.run(programs.heavy, [np.eye(256, dtype=np.float32)])
    tally.tasks += 1


def table(start: dict[str, float], end: dict[str, float]) -> str:
    """Each resource at start and end, and the change; counts whole, MiB to a tenth, the
    ones not judged marked."""
    width = max(map(len, start)) + 12
    lines = [f"{'resource':<{width}}  {'start':>10}  {'end':>10}  {'change':>10}"]
    for name in start:
        a, b = start[name], end[name]
        shown = name if name in COUNTS else f"{name} (not judged)"
        digits = 1 if "MiB" in name else 0
        lines.append(
            f"{shown:<{width}}  {a:>10.{digits}f}  {b:>10.{digits}f}  {b - a:>+10.{digits}f}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pools", type=int, default=200, help="pools made (default 200)")
    parser.add_argument("--tasks", type=int, default=20, help="tasks per pool (default 20)")
    parser.add_argument("--workers", type=int, default=1, help="workers per pool (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the interrupts' moments")
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even as a background job
    rng = random.Random(args.seed)
    programs = Programs()
    interrupter = Interrupter()
    tally = Tally()
    kept: list[np.ndarray] = []
    # Warm-up: a pool of each kind, so that what is made once per process (imports, the
    # threads' stacks glibc keeps for reuse) is in the baseline.
    for interrupt, kill in ((False, False), (True, False), (False, True)):
        one_pool(
            interrupt, kill, programs, args.tasks, args.workers, rng, kept, Tally(), interrupter
        )
    kept.clear()
    start = measure()
    began = time.monotonic()
    for index in range(args.pools):
        interrupt, kill = index % 5 == 4, index % 7 == 6
        one_pool(interrupt, kill, programs, args.tasks, args.workers, rng, kept, tally, interrupter)
        if len(kept) > 50:
            del kept[: len(kept) // 2]  # results outlive their pools, then go
        if (index + 1) % 20 == 0:
            print(f"  {index + 1} pools, {tally.tasks} tasks ({time.monotonic() - began:.0f} s)",
                  file=sys.stderr, flush=True)  # fmt: skip
    kept.clear()
    time.sleep(0.5)  # the last pool's reaped workers' threads and pipes close
    end = measure()
    print(
        f"soak: {tally.pools} pools over their own cache directories, {tally.tasks} tasks, "
        f"{tally.kept_values} values kept on devices, {tally.interrupts} Ctrl-C (SIGINT), "
        f"{tally.kills} workers killed ({tally.crashed_tasks} tasks failed with them), "
        f"{args.workers} worker(s) per pool, in {time.monotonic() - began:.0f} s"
    )
    print(table(start, end))
    grew = [name for name in COUNTS if end[name] > start[name]]
    if grew:
        print(f"grew: {', '.join(grew)}")
        return 1
    print("every count came back to where it started")
    return 0


if __name__ == "__main__":
    sys.exit(main())
