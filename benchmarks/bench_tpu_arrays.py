"""Issue 50's TPU figures in one command: large arrays, a training loop, compiles at start.

Usage (on the TPU host; pjrt-pool installed there as DESIGN.md says, libtpu's path in
PJRT_POOL_PLUGIN_TPU)::

    python benchmarks/tpu_arrays.py --out DIR [--legs ...] [--steps 300] [--programs 12]

Each leg is a process of its own, one after another, since one process at a time may
hold the chip (a leg that finds it still held by the last one waits and tries again):

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
                   three sizes, with numpy inputs (and, where the tree spreads large
                   copies, the same with PJRT_POOL_COPY_THREADS=1; where it streams
                   them, the same with the copy made plainly) and with inputs made
                   by pool.asarray,
                   the MLP loop through Pool.function with keep=0 (the parameters stay
                   in the worker) and without, and the tiny round trip
    jax-serial     jax.jit(step).lower().compile() of the training steps one by one
    jax-threads    the same from 4 threads of one process

It prints one table (ratios against jax.jit, and the goals of issue 50: Pool.run at most
1.15x jax.jit at 16 and 256 MiB, the kept loop at most 1.2x a step and bit-identical,
compile_many with the pool's start at most 0.95x the better JAX leg, the tiny round trip
at most 1.0x) and writes DIR/summary.json. TPU_ARRAYS_PLATFORM=cpu rehearses every leg
on a machine without a TPU (its pool then splits compiles from runs with run_workers=1,
as a TPU host's pool does); use --programs 2 there, since XLA:CPU compiles the training
steps slowly.
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
    copy_threads_variable,
    median_seconds,
    streams_copies,
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
    return median_seconds(lambda _: call(), rounds) * 1e3


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
                variable = copy_threads_variable()
                if variable is not None:  # the same call with the copy on one thread
                    one = lambda run=run, v=variable: with_environment(v, "1", run)  # noqa: E731
                    found[f"pool_one_copy_thread_{mib}MiB_ms"] = _median_ms(one, _rounds(mib))
                if streams_copies():  # the same call with the copy made plainly
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
            return {"failed": f"over {seconds:g} s", "stderr": text.strip().splitlines()[-12:]}
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            found = json.loads(lines[-1])
            found["leg_seconds"] = round(time.perf_counter() - started, 1)
            return found
        held = any(text in done.stderr for text in HELD)
        if not held or time.monotonic() > deadline:
            return {"failed": done.returncode, "stderr": done.stderr.strip().splitlines()[-12:]}
        time.sleep(3)


def _bit_identical(out: Path) -> bool | None:
    import numpy as np

    paths = [out / "params_jax.npz", out / "params_pool.npz"]
    if not all(p.exists() for p in paths):
        return None
    with np.load(paths[0]) as a, np.load(paths[1]) as b:
        return len(a.files) == len(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)


def _table(found: dict[str, dict[str, Any]], out: Path) -> list[str]:
    jax_leg, pool_leg = found.get("jax", {}), found.get("pool", {})
    inproc = found.get("inproc", {})
    rows = ["| what | jax.jit | in-process | Pool.run | shared input | Pool/jit | goal |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip

    def cell(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else "-"

    for mib in SIZES_MIB:
        jit = jax_leg.get(f"jit_{mib}MiB_ms")
        ours = pool_leg.get(f"pool_{mib}MiB_ms")
        ratio = ours / jit if jit and ours else None
        goal = "<= 1.15x" if mib >= 16 else "-"
        rows.append(
            f"| f(x) = x*2+1, {mib} MiB (ms) | {cell(jit)} | {cell(inproc.get(f'run_{mib}MiB_ms'))}"
            f" | {cell(ours)} (1 copy thread: "
            f"{cell(pool_leg.get(f'pool_one_copy_thread_{mib}MiB_ms'))}; plain copy: "
            f"{cell(pool_leg.get(f'pool_plain_copy_{mib}MiB_ms'))})"
            f" | {cell(pool_leg.get(f'pool_shared_{mib}MiB_ms'))} | "
            f"{cell(ratio)} | {goal} |"
        )
    jit_step, kept = jax_leg.get("loop_ms_per_step"), pool_leg.get("kept_all_loop_ms_per_step")
    rows.append(
        f"| MLP step, kept values (ms) | {cell(jit_step)} | - | {cell(kept)} | "
        f"(keep=0, loss read each step: {cell(pool_leg.get('kept_loop_ms_per_step'))}; "
        f"without keep: {cell(pool_leg.get('plain_loop_ms_per_step'))}) | "
        f"{cell(kept / jit_step if jit_step and kept else None)} | <= 1.2x, bit-identical: "
        f"{_bit_identical(out)} |"
    )
    serial = found.get("jax-serial", {}).get("wall")
    threads = found.get("jax-threads", {}).get("wall")
    best = min(v for v in (serial, threads, float("inf")) if v is not None)
    pool_total = pool_leg.get("start_and_compile_many_s")
    rows.append(
        f"| compile_many, start included (s) | serial {cell(serial)}, 4 threads "
        f"{cell(threads)} | - | {cell(pool_total)} (start {cell(pool_leg.get('start_s'))}, "
        f"chip ready at {cell(pool_leg.get('device_ready_after_s'))}) | - | "
        f"{cell(pool_total / best if pool_total and best != float('inf') else None)} | "
        "<= 0.95x the better |"
    )
    tiny_jit, tiny = jax_leg.get("tiny_ms"), pool_leg.get("tiny_ms")
    rows.append(
        f"| tiny round trip (ms) | {cell(tiny_jit)} | - | {cell(tiny)} | - | "
        f"{cell(tiny / tiny_jit if tiny and tiny_jit else None)} | <= 1.0x |"
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--legs", default=",".join(LEGS))
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
    found: dict[str, dict[str, Any]] = {}
    for leg in args.legs.split(","):
        found[leg] = _run_leg(leg, args.out, argv, args.leg_timeout)
        print(f"{leg}: {json.dumps(found[leg], default=str)}", flush=True)
    rows = _table(found, args.out)
    (args.out / "summary.json").write_text(json.dumps(found, indent=1, default=str))
    print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
