"""The TPU figures in one command: large arrays, a training loop, compiles at start.

Usage (on the TPU host, pjrt-pool installed with the tpu extra; libtpu's path in
PJRT_POOL_PLUGIN_TPU where it is not the installed one)::

    python benchmarks/bench_tpu_arrays.py --out DIR [--legs ...] [--rounds 2] [--steps 300]
                                          [--programs 12]

Each leg is a process of its own, one after another, since one process at a time may
hold the chip (a leg that finds it still held by the last one waits and tries again);
the legs alternate for --rounds rounds (benchmarks/harness.py), and every figure is the
median over the rounds:

    jax            jax.jit on the chip, numpy in and out: f(x) = x * 2 + 1 at 1, 16 and
                   256 MiB (float32); the MLP's --steps SGD steps (parameters fed back,
                   so they stay on the chip); a tiny program (x + 1, 4 floats)
    inproc         compile_program + Executable.run of the same programs in one process
                   (JAX_PLATFORMS=cpu: pjrt-pool alone holds the chip)
    pool           a fresh Pool(4, platform="tpu"): its start and compile_many of the
                   --programs training steps (pool/examples/training.py) into an empty
                   cache (its device worker, started when needed by default, opens
                   the chip once they are done: benchmarks/bench_tpu_compile.py
                   --device-start when-needed,at-once compares the two starts),
                   then (once its device worker holds the chip) Pool.run at the
                   three sizes, with numpy inputs (and the same with
                   PJRT_POOL_COPY_THREADS=1, and with the copy made plainly instead
                   of streamed) and with inputs made by pool.asarray, the MLP loop
                   through Pool.function with everything kept, with keep=0 (the
                   parameters stay in the worker) and without, and the tiny round trip
    jax-serial     jax.jit(step).lower().compile() of the training steps one by one
    jax-threads    the same from 4 threads of one process

It prints each figure against jax.jit's, with the goals: Pool.run at most 1.15x jax.jit
at 16 and 256 MiB, the kept loop at most 1.2x a step and bit-identical, compile_many with
the pool's start at most 0.95x the better JAX leg, the tiny round trip at most 1.0x; and
writes the medians to DIR/summary.json. TPU_ARRAYS_PLATFORM=cpu rehearses every leg on a
machine without a TPU (its pool then splits compiles from runs with run_workers=1, as a
TPU host's pool does); use --programs 2 there, since XLA:CPU compiles the training steps
slowly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import (
    Samples,
    Side,
    compare,
    median_per_call,
    ratio_line,
    with_environment,
    with_plain_copies,
)

PLATFORM = os.environ.get("TPU_ARRAYS_PLATFORM", "tpu")
LEGS = ("jax", "inproc", "pool", "jax-serial", "jax-threads")
SIZES_MIB = (1, 16, 256)
TINY_CALLS = 300
HELD = ("Device or resource busy", "TPU is already in use", "Unable to initialize backend")
"""What a leg's error says when the last leg's process still held the chip."""


def _rounds(mib: int) -> int:
    return 7 if mib >= 64 else 30


def _median_ms(call: Any, rounds: int) -> float:
    for _ in range(2):  # compiled, warm
        call()
    return median_per_call(call, rounds) * 1e3


def _mlp(width: int) -> Any:
    from bench_arrays import mlp_problem  # imports JAX: only in the legs that use it

    return mlp_problem(width)


def _loop_ms(step: Any, params: Any, x: Any, y: Any, steps: int) -> tuple[float, Any]:
    from bench_arrays import loop_seconds

    seconds, params = loop_seconds(step, params, x, y, steps)
    return seconds * 1e3, params


def _save_params(path: Path, params: Any) -> None:
    import jax
    import numpy as np

    leaves = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(params)]
    np.savez(path, *leaves)


# -- the legs ------------------------------------------------------------------------------


def leg_jax(out: Path, steps: int, width: int) -> dict[str, Any]:
    import jax
    import numpy as np

    found: dict[str, Any] = {"device": str(jax.devices()[0])}
    affine = jax.jit(lambda x: x * 2 + 1)
    for mib in SIZES_MIB:
        x = np.random.default_rng(0).random(mib << 18, dtype=np.float32)
        found[f"jit_{mib}MiB_ms"] = _median_ms(lambda x=x: np.asarray(affine(x)), _rounds(mib))
    params, bx, by, step = _mlp(width)
    found["loop_ms_per_step"], final = _loop_ms(jax.jit(step), params, bx, by, steps)
    _save_params(out / "params_jax.npz", final)
    tiny = jax.jit(lambda x: x + 1)
    small = np.ones(4, np.float32)
    found["tiny_ms"] = _median_ms(lambda: np.asarray(tiny(small)), TINY_CALLS)
    return found


def leg_inproc(out: Path) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pool import compile_program, lower

    found: dict[str, Any] = {}
    for mib in SIZES_MIB:
        n = mib << 18
        program = lower(lambda x: x * 2 + 1, [jax.ShapeDtypeStruct((n,), jnp.float32)],
                        platform=PLATFORM)  # fmt: skip
        executable, _ = compile_program(program, cache_dir=out / "inproc-cache")
        x = np.random.default_rng(0).random(n, dtype=np.float32)
        found[f"run_{mib}MiB_ms"] = _median_ms(lambda e=executable, x=x: e.run([x]), _rounds(mib))
    return found


def _device_ready(pool: Any, seconds: float = 120.0) -> float:
    """Waits until the pool's run workers are up (started when needed, by default: once
    compile_many is done); returns how long that took."""
    started = time.perf_counter()
    while any(w["state"] in ("starting", "not started") for w in pool.worker_info):
        if time.perf_counter() - started > seconds:
            raise TimeoutError("the device worker did not start")
        time.sleep(0.05)
    return time.perf_counter() - started


def leg_pool(out: Path, steps: int, width: int, programs: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pool import Pool, lower
    from pool.examples.training import train_steps
    from pool.executor.copier import COPY_THREADS_VARIABLE

    lowered = [lower(f, s, platform=PLATFORM) for _, f, s in train_steps()[:programs]]
    found: dict[str, Any] = {}
    split = {} if PLATFORM == "tpu" else {"run_workers": 1}
    with tempfile.TemporaryDirectory(prefix="tpu-arrays-", dir=out) as cache:
        started = time.perf_counter()
        with Pool(4, platform=PLATFORM, cache_dir=cache, **split) as pool:
            found["start_s"] = time.perf_counter() - started
            found["roles_at_start"] = {w["role"]: w["state"] for w in pool.worker_info}
            pool.compile_many(lowered)
            found["start_and_compile_many_s"] = time.perf_counter() - started
            found["compiled"] = pool.statistics.compiled
            # "not started": the device worker did not open the chip beside the compiles.
            found["devices_after_compile_many"] = [
                w["state"] for w in pool.worker_info if w["role"] != "compile"
            ]
            found["device_ready_after_s"] = _device_ready(pool) + found["start_and_compile_many_s"]
            for mib in SIZES_MIB:
                n = mib << 18
                program = lower(lambda x: x * 2 + 1, [jax.ShapeDtypeStruct((n,), jnp.float32)],
                                platform=PLATFORM)  # fmt: skip
                x = np.random.default_rng(0).random(n, dtype=np.float32)
                assert np.array_equal(pool.run(program, [x])[0], x * 2 + 1)
                run = lambda p=program, x=x: pool.run(p, [x])  # noqa: E731
                found[f"pool_{mib}MiB_ms"] = _median_ms(run, _rounds(mib))
                # The same call with the copy on one thread, and with it made plainly.
                one = lambda run=run: with_environment(COPY_THREADS_VARIABLE, "1", run)  # noqa: E731
                found[f"pool_one_copy_thread_{mib}MiB_ms"] = _median_ms(one, _rounds(mib))
                plain_copy = lambda run=run: with_plain_copies(run)  # noqa: E731
                found[f"pool_plain_copy_{mib}MiB_ms"] = _median_ms(plain_copy, _rounds(mib))
                shared = pool.asarray(x)
                run = lambda p=program, s=shared: pool.run(p, [s])  # noqa: E731
                found[f"pool_shared_{mib}MiB_ms"] = _median_ms(run, _rounds(mib))
                del shared
            params, bx, by, step = _mlp(width)
            # Everything kept (as jax.jit keeps its outputs on the chip; the loss is read
            # once at the end): the worker answers each step once it is dispatched.
            everything = pool.function(step, keep=True)
            found["kept_all_loop_ms_per_step"], final = _loop_ms(everything, params, bx, by, steps)
            _save_params(out / "params_pool.npz", final)
            kept = pool.function(step, keep=0)  # the loss read every step
            found["kept_loop_ms_per_step"], final = _loop_ms(kept, params, bx, by, steps)
            _save_params(out / "params_pool_keep0.npz", final)
            plain = pool.function(step)
            found["plain_loop_ms_per_step"], _ = _loop_ms(plain, params, bx, by, steps)
            tiny = lower(lambda x: x + 1, [jax.ShapeDtypeStruct((4,), jnp.float32)],
                         platform=PLATFORM)  # fmt: skip
            small = np.ones(4, np.float32)
            found["tiny_ms"] = _median_ms(lambda: pool.run(tiny, [small]), TINY_CALLS)
            found["worker_info"] = [
                {k: w[k] for k in ("role", "values", "value_bytes", "hot_runs")}
                for w in pool.worker_info
            ]
    return found


def leg_jax_compile(threads: int, programs: int) -> dict[str, Any]:
    from bench_tpu_compile import _jax_leg

    return _jax_leg(threads, programs, None, None)  # on the chip (or, rehearsed, this CPU)


# -- running them --------------------------------------------------------------------------


def _one(leg: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    if leg == "jax":
        return leg_jax(out, args.steps, args.width)
    if leg == "inproc":
        return leg_inproc(out)
    if leg == "pool":
        return leg_pool(out, args.steps, args.width, args.programs)
    return leg_jax_compile(1 if leg == "jax-serial" else 4, args.programs)


def _run_leg(leg: str, out: Path, argv: list[str], seconds: float) -> dict[str, Any]:
    """Runs a leg in a process of its own, for at most `seconds`; tries again while the chip
    is still held by the last leg's process."""
    environment = dict(os.environ)
    if leg.startswith("jax"):
        environment.pop("JAX_PLATFORMS", None)  # JAX on the chip
        if PLATFORM != "tpu":
            environment["JAX_PLATFORMS"] = PLATFORM
    else:
        environment["JAX_PLATFORMS"] = "cpu"  # pjrt-pool holds the chip, not this JAX
    command = [sys.executable, str(Path(__file__).resolve()), "--one", leg, *argv]
    deadline = time.monotonic() + 120
    while True:
        started = time.perf_counter()
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, env=environment, timeout=seconds
            )
        except subprocess.TimeoutExpired as expired:
            raw = expired.stderr or b""
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            raise SystemExit(f"leg {leg} ran over {seconds:g} s:\n{text[-3000:]}") from None
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            found = json.loads(lines[-1])
            found["leg_seconds"] = round(time.perf_counter() - started, 1)
            return found
        held = any(text in done.stderr for text in HELD)
        if not held or time.monotonic() > deadline:
            raise SystemExit(f"leg {leg} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        time.sleep(3)


def _bit_identical(out: Path) -> bool | None:
    import numpy as np

    paths = [out / "params_jax.npz", out / "params_pool.npz"]
    if not all(p.exists() for p in paths):
        return None
    with np.load(paths[0]) as a, np.load(paths[1]) as b:
        return len(a.files) == len(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)


def leg_side(leg: str, out: Path, argv: list[str], seconds: float) -> Side:
    """A side whose sample is one run of a leg in its own process: its figures (the numbers
    it found; what else it found, such as the pool's workers, is printed)."""

    def measure() -> dict[str, float]:
        found = _run_leg(leg, out, argv, seconds)
        numbers = {k: float(v) for k, v in found.items() if isinstance(v, int | float)}
        others = {k: v for k, v in found.items() if k not in numbers}
        print(f"  {leg}: {json.dumps(others, default=str)}", flush=True)
        return {"wall": found["leg_seconds"], **numbers}

    return Side(leg, measure, measures=True)


def report_tpu(samples: Samples, out: Path) -> None:
    """Prints each figure against jax.jit's, with its goal."""
    legs = set(samples.sides)

    def figure(leg: str, name: str) -> float | None:
        present = leg in legs and name in samples.figures(leg)
        return samples.median(leg, name) if present else None

    def line(label: str, leg: str, name: str, against: float | None, goal: float | None = None):
        value = figure(leg, name)
        if value is not None and against:
            ratio_line(label, value / 1e3, against / 1e3, "ms", goal)

    for mib in SIZES_MIB:
        jit = figure("jax", f"jit_{mib}MiB_ms")
        print(f"f(x) = x * 2 + 1, {mib} MiB, numpy in and out, against jax.jit")
        line("jax.jit", "jax", f"jit_{mib}MiB_ms", jit)
        line("in-process", "inproc", f"run_{mib}MiB_ms", jit)
        line("Pool.run", "pool", f"pool_{mib}MiB_ms", jit, 1.15 if mib >= 16 else None)
        line("Pool.run, 1 copy thread", "pool", f"pool_one_copy_thread_{mib}MiB_ms", jit)
        line("Pool.run, copied plainly", "pool", f"pool_plain_copy_{mib}MiB_ms", jit)
        line("Pool.run, pool.asarray input", "pool", f"pool_shared_{mib}MiB_ms", jit)
    step = figure("jax", "loop_ms_per_step")
    print(f"an MLP's SGD step, against jax.jit's; bit-identical: {_bit_identical(out)}")
    line("jax.jit", "jax", "loop_ms_per_step", step)
    line("Pool.function, everything kept", "pool", "kept_all_loop_ms_per_step", step, 1.2)
    line("Pool.function, keep=0", "pool", "kept_loop_ms_per_step", step)
    line("Pool.function", "pool", "plain_loop_ms_per_step", step)
    tiny = figure("jax", "tiny_ms")
    print("the tiny round trip, against jax.jit's")
    line("jax.jit", "jax", "tiny_ms", tiny)
    line("Pool.run", "pool", "tiny_ms", tiny, 1.0)
    serial, threads = figure("jax-serial", "wall"), figure("jax-threads", "wall")
    best = min((v for v in (serial, threads) if v is not None), default=None)
    print("compile_many of the training steps with the pool's start, against the better JAX leg")
    if best and "pool" in legs:
        ratio_line("the better JAX leg", best, best, "s")
        ratio_line("a fresh Pool(4): start + compile_many",
                   samples.median("pool", "start_and_compile_many_s"), best, "s", 0.95)  # fmt: skip
        ratio_line("  its start", samples.median("pool", "start_s"), best, "s")
        ratio_line("  the chip ready", samples.median("pool", "device_ready_after_s"), best, "s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--legs", default=",".join(LEGS))
    parser.add_argument("--rounds", type=int, default=2, help="runs of every leg, alternated")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=1024, help="the MLP's hidden width")
    parser.add_argument("--programs", type=int, default=12, help="training steps compiled")
    parser.add_argument("--leg-timeout", type=float, default=150.0, help="seconds per leg")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        print(json.dumps(_one(args.one, args.out, args), default=str))
        return
    argv = ["--out", str(args.out), "--steps", str(args.steps), "--width", str(args.width),
            "--programs", str(args.programs)]  # fmt: skip
    sides = [leg_side(leg, args.out, argv, args.leg_timeout) for leg in args.legs.split(",")]
    samples = compare(sides, args.rounds, warmup=0)
    report_tpu(samples, args.out)
    medians = {
        leg: {name: samples.median(leg, name) for name in samples.figures(leg)}
        for leg in samples.sides
    }
    (args.out / "summary.json").write_text(json.dumps(medians, indent=1))


if __name__ == "__main__":
    main()
