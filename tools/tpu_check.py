"""The TPU check: pjrt-pool on a TPU host against jax.jit on the same chip, in one command.

Usage (on a TPU VM; each step is a process of its own, since one process at a
time may hold the chip)::

    python tools/tpu_check.py --out DIR [--bundle tpu.bundle] [--steps a,b,...]

Steps (--steps picks some; all by default):

    examples   pjrt-pool in one process: compile_program of the 33 example programs
               and the narrow-output family (outputs whose last dimension is narrow,
               transposes, batched products, an MLP's gradient) into a fresh cache,
               each run on seeded inputs; outputs saved
    again      a second process: the same compile_program calls, which must all load
               from the cache the first one filled (0 compiles)
    bundle     a bundle made without a TPU (pjrt-pool warm --platform tpu --topology
               v5e:1x1 on a CPU machine; --bundle): bundle check, then each program
               loaded and run from it with no compile and no cache, timed
    cli        pjrt-pool run of the bundle's mlp_medium, in a process of its own
    jax        jax.jit of the same functions on the chip, on the same inputs: each
               pjrt-pool output compared with JAX's (bit-exact, or the relative error)
    pool       Pool(platform=PLATFORM) with compile workers and its device worker: start,
               compile_many of the training steps, their first runs from the cache,
               a tiny program's round trip, a device worker killed mid-run
    kill       a device worker killed mid-run (SIGKILL): that run fails alone, and the
               next one runs once a new device worker has the chip
    roundtrip  jax.jit's round trip of the same tiny program, numpy in and out
    beside     a JAX process holding the chip: a Pool compiles beside it, its runs fail
               naming that process, and run once it ends
    checkplugin  pjrt-pool check-plugin --platform tpu, the whole battery (TPU_CHECK_CASES:
               a selection); tools/tpu_check_plugin.py runs it alone

Writes DIR/summary.json and prints one line per finding; the last line is the
summary. TPU_CHECK_PLATFORM=cpu rehearses every step on a machine without a
TPU (with a bundle made there for the CPU); the deviceless parts are tested by
tests/test_tpu_deviceless.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

PLATFORM = os.environ.get("TPU_CHECK_PLATFORM", "tpu")
"""The platform checked: "tpu"; "cpu" rehearses every step on a machine without one (its
pools then split compiles from runs with run_workers=1, as a TPU host's pools do)."""
STEPS = (
    "examples",
    "again",
    "bundle",
    "cli",
    "jax",
    "pool",
    "kill",
    "roundtrip",
    "beside",
    "checkplugin",
)
TINY_CALLS = 300
CLI = (sys.executable, "-c", "import sys; from pool.cli.main import main; sys.exit(main())")
"""The pjrt-pool console script's code (python -m pool.cli.main imports the module twice, and
its errors then miss its handler)."""


def log(message: str) -> None:
    print(message, flush=True)


def _programs() -> list[tuple[str, Any, list[Any]]]:
    """The example programs and the narrow-output family."""
    import jax
    import jax.numpy as jnp

    from pool.examples import example_programs

    def f32(*shape: int) -> Any:
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    def mlp_grad(w1: Any, w2: Any, x: Any) -> Any:
        return jax.grad(
            lambda w1, w2: jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2), argnums=(0, 1)
        )(w1, w2)

    narrow = [
        ("narrow_mul_32x16", lambda x: x * 2, [f32(32, 16)]),
        ("narrow_mul_64x8", lambda x: x * 2, [f32(64, 8)]),
        ("narrow_add_16x1", lambda x: x + 1, [f32(16, 1)]),
        ("narrow_add_7x100", lambda x: x + 1, [f32(7, 100)]),
        ("narrow_transpose_16x32", lambda x: x.T, [f32(16, 32)]),
        ("narrow_matmul_32x16", lambda a, b: a @ b, [f32(32, 64), f32(64, 16)]),
        ("narrow_matmul_256x32", lambda a, b: a @ b, [f32(256, 64), f32(64, 32)]),
        (
            "narrow_batched_4x32x16",
            lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
            [f32(4, 32, 8), f32(4, 8, 16)],
        ),
        ("narrow_mlp_grad", mlp_grad, [f32(64, 128), f32(128, 16), f32(32, 64)]),
    ]
    return [*example_programs(), *narrow]


def _inputs(shapes: list[Any]) -> list[np.ndarray]:
    from pool.examples import example_inputs

    return example_inputs(shapes)


def _save(path: Path, outputs: dict[str, list[np.ndarray]]) -> None:
    np.savez(path, **{f"{name}/{i}": o for name, got in outputs.items() for i, o in enumerate(got)})


def _load(path: Path) -> dict[str, list[np.ndarray]]:
    found: dict[str, list[np.ndarray]] = {}
    with np.load(path) as stored:
        for key in sorted(
            stored.files, key=lambda k: (k.rsplit("/", 1)[0], int(k.rsplit("/", 1)[1]))
        ):
            name, _ = key.rsplit("/", 1)
            found.setdefault(name, []).append(stored[key])
    return found


# -- the steps, each run in a process of its own ------------------------------------------


def step_examples(out: Path, again: bool = False) -> dict[str, Any]:
    from pool import lower
    from worker import compile_program

    cache = out / "cache"
    outputs: dict[str, list[np.ndarray]] = {}
    compile_seconds, load_seconds, first_runs = [], [], []
    compiled = loaded = 0
    for name, function, shapes in _programs():
        program = lower(function, shapes, platform=PLATFORM)
        executable, stats = compile_program(program, cache_dir=cache)
        compiled, loaded = compiled + stats.compiled, loaded + stats.loaded
        compile_seconds.append(stats.compile_seconds)
        load_seconds.append(stats.load_seconds)
        inputs = _inputs(shapes)
        started = time.perf_counter()
        outputs[name] = executable.run(inputs)
        first_runs.append(time.perf_counter() - started)
    if not again:
        _save(out / "pjrt_pool.npz", outputs)
    return {
        "programs": len(outputs),
        "compiled": compiled,
        "loaded": loaded,
        "compile_seconds_total": sum(compile_seconds),
        "compile_seconds_max": max(compile_seconds),
        "load_seconds_median": statistics.median(load_seconds),
        "load_seconds_max": max(load_seconds),
        "first_run_seconds_median": statistics.median(first_runs),
    }


def step_bundle(out: Path, bundle: str) -> dict[str, Any]:
    from pool.manifest import load_manifest

    checked = subprocess.run(
        [*CLI, "bundle", "check", bundle],
        capture_output=True,
        text=True,
        check=False,
    )
    manifest = load_manifest(bundle)
    by_name = {name: (function, shapes) for name, function, shapes in _programs()}
    outputs, load_seconds, first_runs = {}, [], []
    for name in manifest.names:
        started = time.perf_counter()
        executable = manifest.executable(name)
        load_seconds.append(time.perf_counter() - started)
        inputs = _inputs(by_name[name][1])
        started = time.perf_counter()
        outputs[name] = executable.run(inputs)
        first_runs.append(time.perf_counter() - started)
    _save(out / "bundle.npz", outputs)
    ours = _load(out / "pjrt_pool.npz")
    same = sum(
        all(np.array_equal(a, b) for a, b in zip(outputs[n], ours[n], strict=True)) for n in outputs
    )
    return {
        "check_exit": checked.returncode,
        "check_last_line": checked.stdout.strip().splitlines()[-1]
        if checked.stdout
        else checked.stderr,
        "programs": len(outputs),
        "load_seconds_median": statistics.median(load_seconds),
        "load_seconds_max": max(load_seconds),
        "first_run_seconds_median": statistics.median(first_runs),
        "equal_to_the_compiled_here": same,
    }


def step_cli(bundle: str) -> dict[str, Any]:
    started = time.perf_counter()
    done = subprocess.run(
        [*CLI, "run", bundle, "mlp_medium"],
        capture_output=True,
        text=True,
        check=False,
    )
    return {
        "exit": done.returncode,
        "seconds": time.perf_counter() - started,
        "output": done.stdout.strip().splitlines()[-3:],
        "stderr": done.stderr.strip().splitlines()[-3:],
    }


def step_jax(out: Path) -> dict[str, Any]:
    import jax

    ours = {"compiled here": _load(out / "pjrt_pool.npz")}
    if (out / "bundle.npz").exists():
        ours["bundle"] = _load(out / "bundle.npz")
    results: dict[str, Any] = {where: {"bit_exact": 0, "max_relative_error": 0.0, "worst": []}
                               for where in ours}  # fmt: skip
    for name, function, shapes in _programs():
        reference = [np.asarray(x) for x in jax.tree.leaves(jax.jit(function)(*_inputs(shapes)))]
        for where, found in ours.items():
            if name not in found:
                continue
            got = found[name]
            exact = len(got) == len(reference) and all(
                np.array_equal(a, b) for a, b in zip(got, reference, strict=True)
            )
            error = 0.0
            for a, b in zip(got, reference, strict=True):
                if a.dtype.kind in "fc":
                    scale = float(np.max(np.abs(b))) if b.size else 0.0
                    wide = np.complex128 if a.dtype.kind == "c" else np.float64
                    diff = float(np.max(np.abs(a.astype(wide) - b))) if b.size else 0.0
                    error = max(error, diff / scale if scale else diff)
                elif not np.array_equal(a, b):
                    error = max(error, float("inf"))
            entry = results[where]
            entry["bit_exact"] += exact
            entry["max_relative_error"] = max(entry["max_relative_error"], error)
            if not exact:
                entry["worst"].append((name, error))
    for entry in results.values():
        entry["worst"] = sorted(entry["worst"], key=lambda item: -item[1])[:8]
    return {"device": str(jax.devices()[0]), "programs": len(_programs()), **results}


def step_pool(out: Path) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from pool import Pool, lower
    from pool.examples.training import train_steps

    steps = [
        (name, lower(f, shapes, platform=PLATFORM), shapes) for name, f, shapes in train_steps()
    ]
    tiny = lower(lambda x: x + 1, [jax.ShapeDtypeStruct((4,), jnp.float32)], platform=PLATFORM)
    spin, spin_x = _spin()
    found: dict[str, Any] = {}
    started = time.perf_counter()
    split = {} if PLATFORM == "tpu" else {"run_workers": 1}
    with Pool(platform=PLATFORM, cache_dir=out / "pool-cache", **split) as pool:
        found["start_seconds"] = time.perf_counter() - started
        found["roles"] = [w["role"] for w in pool.worker_info]
        began = time.perf_counter()
        pool.compile_many([program for _, program, _ in steps])
        found["compile_many_seconds"] = time.perf_counter() - began
        before = pool.statistics
        first = []
        for _, program, shapes in steps:
            inputs = [np.zeros(s.shape, np.float32) for s in shapes]
            began = time.perf_counter()
            pool.run(program, inputs)
            first.append(time.perf_counter() - began)
        after = pool.statistics
        found["first_runs"] = {
            "compiled_by_the_device_worker": after.compiled - before.compiled,
            "loaded": after.loaded - before.loaded,
            "load_seconds_per_program": (after.load_seconds - before.load_seconds)
            / max(1, after.loaded - before.loaded),
            "first_run_seconds_median": statistics.median(first),
            "first_run_seconds_max": max(first),
        }
        x = np.ones(4, np.float32)
        for _ in range(20):
            pool.run(tiny, [x])
        times = []
        for _ in range(TINY_CALLS):
            began = time.perf_counter()
            pool.run(tiny, [x])
            times.append(time.perf_counter() - began)
        found["tiny_round_trip_ms_median"] = statistics.median(times) * 1e3
        # A device worker killed during a run: that run fails alone, the next one runs.
        pool.run(spin, [spin_x, np.int32(10)])  # compiled and loaded
        device = next(w for w in pool.worker_info if w["role"] == "device")
        future = pool.submit(spin, [spin_x, np.int32(200000)])
        found["killed_run"], killed = _killed_during(future, device["pid"], 1.0, 200)
        pool.run(tiny, [x])
        found["next_run_after_kill_seconds"] = time.perf_counter() - killed
        found["statistics"] = str(pool.statistics)
    return found


def _spin() -> tuple[Any, np.ndarray]:
    """A program that runs on the chip for as long as its second argument says (n products
    of 1024x1024 matrices: 200000 take minutes), and its first argument."""
    import jax
    import jax.numpy as jnp

    from pool import lower

    spin = lower(
        lambda x, n: jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ y), x),
        [jax.ShapeDtypeStruct((1024, 1024), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)],
        platform=PLATFORM,
    )
    return spin, np.full((1024, 1024), 0.001, np.float32)


def _killed_during(future: Any, pid: int, after: float, width: int) -> tuple[str, float]:
    """Kills worker pid `after` seconds into a run (future); returns how the run ended (the
    first `width` characters of its error's first line) and when the kill was."""
    from pool.errors import WorkerCrashedError

    time.sleep(after)
    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    try:
        future.result()
    except WorkerCrashedError as error:
        return f"WorkerCrashedError: {str(error).splitlines()[0][:width]}", killed
    return "did not fail", killed


def step_kill(out: Path) -> dict[str, Any]:

    from pool import Pool

    spin, x = _spin()
    found: dict[str, Any] = {}
    split = {} if PLATFORM == "tpu" else {"run_workers": 1}
    with Pool(1, platform=PLATFORM, cache_dir=out / "kill-cache", **split) as pool:
        began = time.perf_counter()
        pool.run(spin, [x, np.int32(10)])
        found["first_run_seconds"] = time.perf_counter() - began
        began = time.perf_counter()
        pool.run(spin, [x, np.int32(20000)])
        found["long_run_seconds"] = time.perf_counter() - began
        device = next(w for w in pool.worker_info if w["role"] != "compile")
        future = pool.submit(spin, [x, np.int32(200000)])
        found["killed_run"], killed = _killed_during(future, device["pid"], 1.0, 160)
        began = time.perf_counter()
        pool.run(spin, [x, np.int32(10)])
        found["next_run_seconds"] = time.perf_counter() - began
        found["next_run_after_kill_seconds"] = time.perf_counter() - killed
    return found


def step_roundtrip() -> dict[str, Any]:
    import jax

    function = jax.jit(lambda x: x + 1)
    x = np.ones(4, np.float32)
    for _ in range(20):
        np.asarray(function(x))
    times = []
    for _ in range(TINY_CALLS):
        began = time.perf_counter()
        np.asarray(function(x))
        times.append(time.perf_counter() - began)
    return {"jax_tiny_round_trip_ms_median": statistics.median(times) * 1e3}


def step_beside(out: Path) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from pool import Pool, lower
    from worker.errors import DeviceUnavailableError

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import jax, sys; jax.devices(); print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"},
    )
    found: dict[str, Any] = {"holder_pid": holder.pid}
    try:
        found["holder_said"] = holder.stdout.readline().strip()
        programs = [
            lower(
                lambda x, k=k: jnp.sin(x) * k,
                [jax.ShapeDtypeStruct((128, 128), jnp.float32)],
                platform=PLATFORM,
            )
            for k in range(4)
        ]
        started = time.perf_counter()
        split = {} if PLATFORM == "tpu" else {"run_workers": 1}
        with Pool(2, platform=PLATFORM, cache_dir=out / "beside-cache", **split) as pool:
            found["pool_start_seconds"] = time.perf_counter() - started
            began = time.perf_counter()
            pool.compile_many(programs)
            found["compile_many_beside_the_holder_seconds"] = time.perf_counter() - began
            began = time.perf_counter()
            try:
                pool.run(programs[0], [np.ones((128, 128), np.float32)])
                found["run_while_held"] = "ran"
            except DeviceUnavailableError as error:
                found["run_while_held"] = str(error)[:300]
                found["names_the_holder"] = str(holder.pid) in str(error)
            found["run_while_held_seconds"] = time.perf_counter() - began
            holder.communicate("", timeout=60)
            began = time.perf_counter()
            pool.run(programs[1], [np.ones((128, 128), np.float32)])
            found["run_after_the_holder_ended_seconds"] = time.perf_counter() - began
    finally:
        if holder.poll() is None:
            holder.kill()
    return found


def step_checkplugin() -> dict[str, Any]:
    patterns = os.environ.get("TPU_CHECK_CASES")  # default: the whole battery, as users run it
    chosen = ["--cases", patterns] if patterns else []
    done = subprocess.run(
        [*CLI, "check-plugin", "--platform", PLATFORM, *chosen, "--json"],
        capture_output=True,
        text=True,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"},
    )  # fmt: skip
    try:
        report = json.loads(done.stdout)
    except ValueError:
        return {"exit": done.returncode, "stderr": done.stderr.strip().splitlines()[-5:]}
    counts: dict[str, int] = {}
    for case in report.get("cases", []):
        counts[case["status"]] = counts.get(case["status"], 0) + 1
    failures = [
        (c["name"], c.get("message", ""), c.get("max_error"))
        for c in report.get("cases", [])
        if c["status"] not in ("pass", "skipped", "unsupported")
    ]
    return {
        "exit": done.returncode,
        "headline": report.get("headline"),
        "counts": counts,
        "failures": failures[:12],
        "seconds": report.get("seconds"),
        "workers": report.get("workers"),
        "types": report.get("types"),
        "reference_processes": report.get("reference_processes"),
    }


def _one(step: str, out: Path, bundle: str | None) -> dict[str, Any]:
    if step == "examples":
        return step_examples(out)
    if step == "again":
        return step_examples(out, again=True)
    if step == "bundle":
        assert bundle is not None
        return step_bundle(out, bundle)
    if step == "cli":
        assert bundle is not None
        return step_cli(bundle)
    if step == "jax":
        return step_jax(out)
    if step == "pool":
        return step_pool(out)
    if step == "kill":
        return step_kill(out)
    if step == "roundtrip":
        return step_roundtrip()
    if step == "beside":
        return step_beside(out)
    return step_checkplugin()


def run_steps(
    script: Path,
    steps: list[str],
    out: Path,
    extra: list[str],
    jax_on_the_chip: Callable[[str], bool],
    environment: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Runs each step as `script --one STEP --out OUT [extra]`, a process of its own (one
    process at a time may hold the chip), its JAX on the chip only where jax_on_the_chip says
    so; logs each step's JSON line (or its failure) and writes OUT/summary.json."""
    summary: dict[str, Any] = {}
    for step in steps:
        variables = dict(os.environ, **(environment or {}))
        if jax_on_the_chip(step):
            variables.pop("JAX_PLATFORMS", None)
        else:
            variables["JAX_PLATFORMS"] = "cpu"
        command = [sys.executable, str(script.resolve()), "--one", step, "--out", str(out), *extra]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=variables, check=False)
        try:
            summary[step] = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            summary[step] = {
                "failed": done.returncode,
                "stderr": done.stderr.strip().splitlines()[-12:],
            }
        summary[step]["step_seconds"] = round(time.perf_counter() - started, 1)
        log(f"{step}: {json.dumps(summary[step], default=str)}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    log(json.dumps(summary, default=str))
    return summary


JAX_ON_THE_CHIP = {"jax", "roundtrip"}
"""Steps whose own JAX runs on the chip; the others leave it to pjrt-pool's processes."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--bundle", default=None, help="a bundle made deviceless for this host")
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        print(json.dumps(_one(args.one, args.out, args.bundle), default=str))
        return
    steps = [s for s in args.steps.split(",") if args.bundle or s not in ("bundle", "cli")]
    extra = ["--bundle", args.bundle] if args.bundle else []
    run_steps(Path(__file__), steps, args.out, extra, lambda step: step in JAX_ON_THE_CHIP)


if __name__ == "__main__":
    main()
