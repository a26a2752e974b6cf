"""Large arrays through the pool, against one process and jax.jit, in one run.

Usage::

    python benchmarks/bench_arrays.py [--parts sizes,memory,loop,tiny] [--mib 1,16,256]
                                      [--rounds N] [--steps N] [--width N] [--loops N]

Parts (each prints ratios against a baseline measured in the same run; this
machine's speed drifts 2-3x between hours, so only ratios mean anything):

    sizes   f(x) = x * 2 + 1 on float32 arrays of --mib MiB, numpy in and out:
            jax.jit(f) (np.asarray of its result), compile_program +
            Executable.run in this process, Pool(1).run, and Pool(1).run of an
            input made in shared memory (pool.asarray), alternated round by
            round (benchmarks/harness.py); a sample is the median of a burst
            of BURST calls (one at 256 MiB), as a loop makes them. Goals:
            Pool.run <= 1.3x in-process at 16 and 256 MiB and <= 1.5x at 1
            MiB; in-process <= 1.1x jax.jit. Pool.run with
            PJRT_POOL_COPY_THREADS=1 too (the same call with the parent's copy
            on one thread), and the same call with the copy made plainly
            (through the caches: harness.with_plain_copies) instead of
            streamed.
    memory  a 256 MiB round trip of the same program: how much memory the
            parent and its worker touched at their peak (VmHWM growth of each,
            and the parent's private growth), as multiples of the array.
            Goal: at most 3x in all.
    loop    --steps SGD steps of an MLP (two hidden layers of --width, batch
            256): jax.jit with the parameters fed back (they stay on JAX's
            device), Pool.function with numpy parameters fed back, and
            Pool.function(keep=0) with the parameters kept in the worker
            (pool values); ms per step, and whether the kept loop's final
            parameters equal jax.jit's bit for bit (on the CPU the pool's
            plugin is another XLA build than jaxlib's, so allclose is shown too).
    tiny    the tiny round trip of benchmarks/bench_pool.py --parts b: Pool(1).run
            against two processes spinning on a socket (goal: within 2x).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_SCRATCH = tempfile.mkdtemp(prefix="bench-arrays-")
os.environ.setdefault("PJRT_POOL_CACHE_DIR", str(Path(_SCRATCH) / "cache"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from harness import (  # noqa: E402
    Side,
    compare,
    median_per_call,
    ratio_line,
    report,
    with_environment,
    with_plain_copies,
)

from pool import Pool, compile_program, lower  # noqa: E402
from pool.executor.copier import COPY_THREADS_VARIABLE  # noqa: E402


def affine(x: jax.Array) -> jax.Array:
    """The program of the sizes and memory parts."""
    return x * 2 + 1


BURST = 8
"""Calls of one side in a row, in each round of the sizes part (one at 256 MiB)."""


# -- sizes ---------------------------------------------------------------------------------


def _calls(pool: Pool, mib: int) -> tuple[dict[str, Callable[[], Any]], np.ndarray]:
    """Each side's call for an array of `mib` MiB, and the array."""
    n = mib << 18
    x = np.random.default_rng(0).random(n, dtype=np.float32)
    program = lower(affine, [jax.ShapeDtypeStruct((n,), jnp.float32)])
    executable, _ = compile_program(program)
    jitted = jax.jit(affine)
    shared = pool.asarray(x)
    calls: dict[str, Callable[[], Any]] = {
        "jax.jit": lambda: np.asarray(jitted(x)),
        "in-process": lambda: executable.run([x])[0],
        "Pool.run": lambda: pool.run(program, [x])[0],
        "Pool.run, shared input": lambda: pool.run(program, [shared])[0],
        "Pool.run, 1 copy thread": lambda: with_environment(
            COPY_THREADS_VARIABLE, "1", lambda: pool.run(program, [x])[0]
        ),
        "Pool.run, plain copy": lambda: with_plain_copies(lambda: pool.run(program, [x])[0]),
    }
    return calls, x


def burst(call: Callable[[], Any], count: int) -> Callable[[], float]:
    """A side's sample: the median time of `count` calls in a row, as a loop makes them (the
    first ones after another side's find the worker and the plugin's thread pool asleep, or
    the last side's threads still spinning; the median is the loop's pace)."""
    return lambda: median_per_call(call, count)


def part_sizes(sizes: list[int], rounds: int) -> None:
    print("\nsizes: f(x) = x * 2 + 1, float32, numpy in and out")
    with Pool(1) as pool:
        for mib in sizes:
            calls, x = _calls(pool, mib)
            expected = x * 2 + 1
            for call in calls.values():  # compile, warm up, check
                for _ in range(2):
                    out = call()
                assert np.array_equal(out, expected)
                del out
            count = BURST if mib < 64 else 1
            sides = [Side(name, burst(call, count), measures=True) for name, call in calls.items()]
            samples = compare(sides, max(3, rounds if mib < 64 else rounds // 4), warmup=0)
            report(samples, f"{mib} MiB", goals={"in-process": 1.1})
            goal = 1.5 if mib == 1 else 1.3
            in_process = samples.median("in-process")
            for side in ("Pool.run", "Pool.run, shared input"):
                ratio_line(f"{side} / in-process", samples.median(side), in_process, goal=goal)
            del calls, sides, samples, x, expected


# -- memory --------------------------------------------------------------------------------


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for process {pid}")


class _PeakSampler:
    """The largest private (anonymous) resident set a process had while it ran."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status(self.pid, "RssAnon"))
            time.sleep(0.0005)

    def __enter__(self) -> _PeakSampler:
        self.peak = _status(self.pid, "RssAnon")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _reset_peak(pid: int) -> bool:
    """Resets a process's VmHWM to its resident set now (Linux 4.0 on); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def part_memory(mib: int) -> None:
    n = mib << 18
    size = n * 4
    program = lower(affine, [jax.ShapeDtypeStruct((n,), jnp.float32)])
    small = lower(affine, [jax.ShapeDtypeStruct((1 << 18,), jnp.float32)])
    print(
        f"\nmemory: a {mib} MiB round trip of f(x) = x * 2 + 1: what it touched at its peak "
        "beyond the caller's array, as multiples of the array (the program's first run, "
        "whose outputs' places the parent learns from it, and a later one, as in a loop)"
    )
    for shared in (False, True):
        with Pool(1) as pool:
            pid = pool.worker_info[0]["pid"]
            pool.run(small, [np.ones(1 << 18, np.float32)])
            pool.compile(program)
            x = pool.asarray(np.ones(n, np.float32)) if shared else np.ones(n, np.float32)
            me = os.getpid()
            resident = _status(pid, "VmRSS")  # before any large run
            for run in ("first run", "later run"):
                before_worker = _status(pid, "VmHWM")
                if run == "later run":
                    # From what the worker held before the first: the segments it keeps
                    # mapped count as well as what this run touches.
                    if not _reset_peak(pid):
                        print("    (this kernel refused to reset the worker's VmHWM)")
                        break
                    before_worker = resident
                before_anon = _status(me, "RssAnon")
                with _PeakSampler(me) as sampler:
                    (out,) = pool.run(program, [x])
                    assert float(out[-1]) == 3.0 and float(out.sum(dtype=np.float64)) == 3.0 * n
                worker = _status(pid, "VmHWM") - before_worker
                private = sampler.peak - before_anon
                label = ("pool.asarray input" if shared else "numpy input") + ", " + run
                # The worker touched the input's segment: with a shared input, that is the
                # caller's array itself; with a numpy one, a copy of it.
                total = worker + private + (0 if shared else size)
                print(
                    f"    {label:<30} worker {worker / size:4.2f}x (shared memory it touched, "
                    f"the plugin's own buffers), parent's private {private / size:4.2f}x: "
                    f"{total / size:4.2f}x in all, the caller's array included"
                )
                del out
            del x


# -- loop ----------------------------------------------------------------------------------


def mlp_problem(width: int, batch: int = 256, features: int = 128, seed: int = 0) -> Any:
    """An MLP's parameters, a batch, and its SGD step."""
    rng = np.random.default_rng(seed)

    def dense(m: int, k: int) -> dict[str, np.ndarray]:
        scale = np.float32(1 / np.sqrt(m))
        return {"w": (rng.standard_normal((m, k)) * scale).astype(np.float32),
                "b": np.zeros(k, np.float32)}  # fmt: skip

    params = [dense(features, width), dense(width, width), dense(width, 16)]
    batch_x = rng.standard_normal((batch, features)).astype(np.float32)
    batch_y = rng.standard_normal((batch, 16)).astype(np.float32)

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        for layer in params[:-1]:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        x = x @ params[-1]["w"] + params[-1]["b"]
        return jnp.mean((x - y) ** 2)

    def step(params: Any, x: jax.Array, y: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, params, grads), value

    return params, batch_x, batch_y, step


def loop_seconds(
    step: Callable[..., Any], params: Any, x: Any, y: Any, steps: int
) -> tuple[float, Any]:
    """Seconds a step of an SGD loop (`params, value = step(params, x, y)`, the value read
    once at the end, as a training loop reads its loss), and the final parameters."""
    params, _ = step(params, x, y)  # compiled and warm
    started = time.perf_counter()
    for _ in range(steps):
        params, value = step(params, x, y)
    value = float(np.asarray(value))
    return (time.perf_counter() - started) / steps, params


def part_loop(steps: int, width: int, rounds: int) -> None:
    params, x, y, step = mlp_problem(width)
    finals: dict[str, Any] = {}

    def loop(name: str, stepping: Callable[..., Any]) -> Side:
        def measure() -> float:
            seconds, finals[name] = loop_seconds(stepping, params, x, y, steps)
            return seconds

        return Side(name, measure, measures=True)

    with Pool(1) as pool, Pool(1, dispatch_ahead=0) as waiting:
        sides = [
            loop("jax.jit", jax.jit(step)),
            loop("Pool.function", pool.function(step)),
            loop("Pool.function, kept (keep=0)", pool.function(step, keep=0)),
            loop("Pool.function, all kept", pool.function(step, keep=True)),
            loop("all kept, dispatch_ahead=0", waiting.function(step, keep=True)),
        ]
        samples = compare(sides, rounds, warmup=0)
        title = f"\nloop: {steps} SGD steps of an MLP (width {width}, batch 256), a step"
        report(samples, title, goals={"Pool.function, all kept": 1.2})
        reference = jax.tree_util.tree_leaves(finals["jax.jit"])
        for name, final in finals.items():  # kept values are read while their pool is open
            leaves = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(final)]
            same = all(np.array_equal(a, b) for a, b in zip(leaves, reference, strict=True))
            pairs = zip(leaves, reference, strict=True)
            close = all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in pairs)
            print(f"    {name:<32} final parameters: bit-identical {same}, allclose {close}")


# -- tiny ----------------------------------------------------------------------------------


def part_tiny(calls: int) -> None:
    import bench_pool

    bench_pool.report_b(bench_pool.sequential_calls(bench_pool.Tiny(), calls))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="sizes,memory,loop,tiny")
    parser.add_argument("--mib", default="1,16,256")
    parser.add_argument("--rounds", type=int, default=21, help="rounds of the sizes part")
    parser.add_argument("--steps", type=int, default=300, help="steps of the loop part")
    parser.add_argument("--width", type=int, default=256, help="hidden width in the loop part")
    parser.add_argument("--loops", type=int, default=3, help="loops per side in the loop part")
    parser.add_argument("--calls", type=int, default=2000, help="round trips in the tiny part")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    print(f"bench_arrays: {os.cpu_count()} CPUs, jax {jax.__version__}, parts {parts}")
    if "sizes" in parts:
        part_sizes([int(m) for m in args.mib.split(",")], args.rounds)
    if "memory" in parts:
        part_memory(256)
    if "loop" in parts:
        part_loop(args.steps, args.width, args.loops)
    if "tiny" in parts:
        part_tiny(args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
