"""The device check: one command that measures and checks the pool on a GPU (or rehearses on CPU).

Usage::

    python tools/device_check.py [--platform cuda] [--sizes 4,8,16] [--rounds 3]
                                   [--budget 480] [--quick] [--rtol 1e-3]

Progress goes to stderr; the last line on stdout is one JSON summary. Steps,
each skipped (and listed under "skipped") when the --budget of seconds would
run out:

1. Lower a varied set of programs for the platform: examples (MLPs and
   gradients, convolutions, scans, attention, linalg, FFT, sorting, loops)
   and a few more kinds (a transformer training step, segment sums, gather
   and scatter, a transposed convolution, bfloat16 matmuls, the sort/top_k/
   rfft program that once hit CUDA_ERROR_ILLEGAL_ADDRESS).
2. Serial JAX: jax.jit(f).lower(...).compile() of each, timed (wall and
   CPU seconds), on JAX's own backend for the platform; their outputs on the
   same random inputs are the reference every later output is compared with
   (per program: max |ours - jax| / max |jax|).
3. In process: compile_program of each, serially, into a fresh cache; run
   and compare.
4. Pools of each size: Pool(n).compile_many into a fresh executable cache
   (start-up, compile wall time, the summed per-program compile seconds and
   their phases from the workers' phase log, GPU memory), then run and compare.
   At the largest size also: compile slots off (PJRT_POOL_COMPILE_SLOTS=0),
   and again with warm autotune results (executable cache cleared, the
   autotune directory kept).
5. Crash isolation: a busy worker is SIGKILLed; its task must fail with
   WorkerCrashedError and every other task in flight must be right.
6. Repeated rounds: every program run through one pool --rounds times;
   failures per round, and how many workers were replaced.
7. A tiny program's round trip: in process, through a Pool, jax.jit.

On a CPU machine, ``--platform cpu`` rehearses the whole sequence (the
figures then say nothing about GPUs); ``--quick`` runs a handful of programs
with one small pool. Cache directories are temporary; the user's cache is
untouched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

# Before JAX loads: JAX's GPU client would otherwise take 75% of the GPU's
# memory and leave little to the pool's workers.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
_SCRATCH = Path(tempfile.mkdtemp(prefix="device-check-"))
os.environ["PJRT_POOL_CACHE_DIR"] = str(_SCRATCH / "default-cache")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pool import Pool, WorkerCrashedError, compile_program, lower  # noqa: E402
from pool.examples import example_inputs, example_programs  # noqa: E402
from worker.cache import DiskCache  # noqa: E402
from worker.compile.slots import SLOTS_ENV, compile_slots  # noqa: E402
from worker.phases import PHASE_LOG_ENV  # noqa: E402
from worker.plugin.locate import environment_variables  # noqa: E402
from worker.plugin.runtime import loaded_runtime  # noqa: E402

Program = tuple[str, Callable[..., Any], list[jax.ShapeDtypeStruct]]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- programs ----------------------------------------------------------------


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _transformer_step(x, w_qkv, w_o, w_1, w_2, target):
    """One SGD step of a one-block transformer encoder; returns the loss and new weights."""

    def loss(params):
        qkv_w, o_w, w1, w2 = params
        h = x
        mean = h.mean(-1, keepdims=True)
        h = (h - mean) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
        q, k, v = jnp.split(h @ qkv_w, 3, axis=-1)
        weights = jax.nn.softmax(q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]), axis=-1)
        h = x + (weights @ v) @ o_w
        h = h + jax.nn.gelu(h @ w1) @ w2
        return jnp.mean((h - target) ** 2)

    params = (w_qkv, w_o, w_1, w_2)
    value, grads = jax.value_and_grad(loss)(params)
    return (value, *(p - 0.01 * g for p, g in zip(params, grads, strict=True)))


def _segment_sums(x):
    ids = (jnp.abs(x[:, 0]) * 7).astype(jnp.int32) % 16
    return jax.ops.segment_sum(x, ids, num_segments=16), jax.ops.segment_max(x, ids, 16)


def _gather_scatter(x, table):
    idx = (jnp.abs(x) * 50).astype(jnp.int32) % table.shape[0]
    gathered = table[idx]
    return gathered, jnp.zeros_like(table).at[idx].add(x[:, None])


def _conv_transpose(x, kernel):
    return jax.lax.conv_transpose(
        x, kernel, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _bf16_matmul(a, b):
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return jnp.matmul(a16, b16, preferred_element_type=jnp.float32)


def _spectral(x):
    """sort, top_k and rfft of an (8, 1024) array: a program that hit CUDA_ERROR_ILLEGAL_ADDRESS."""
    values, _ = jax.lax.top_k(x, 16)
    spectrum = jnp.abs(jnp.fft.rfft(x, axis=-1))
    return jnp.sort(x, axis=-1), values, spectrum


def _batched_solve(a, b):
    spd = a @ jnp.swapaxes(a, -1, -2) + 8 * jnp.eye(a.shape[-1])
    return jnp.linalg.solve(spd, b)


def _extra_programs() -> list[Program]:
    return [
        (
            "transformer_train_step",
            _transformer_step,
            [
                _f32(4, 32, 64),
                _f32(64, 192),
                _f32(64, 64),
                _f32(64, 256),
                _f32(256, 64),
                _f32(4, 32, 64),
            ],
        ),
        ("segment_sums", _segment_sums, [_f32(512, 8)]),
        ("gather_scatter", _gather_scatter, [_f32(256), _f32(100, 16)]),
        ("conv_transpose", _conv_transpose, [_f32(2, 16, 16, 8), _f32(3, 3, 8, 4)]),
        ("bf16_matmul", _bf16_matmul, [_f32(256, 512), _f32(512, 128)]),
        ("spectral_n1024", _spectral, [_f32(8, 1024)]),
        ("batched_solve", _batched_solve, [_f32(4, 16, 16), _f32(4, 16, 3)]),
    ]


def _spin(x, n):
    """A loop that keeps a worker busy for a while (n iterations): for the crash check."""
    return jax.lax.fori_loop(0, n[0], lambda i, c: jnp.sin(c) * 0.999 + 0.01, x)


def programs_to_check(quick: bool) -> list[Program]:
    programs = example_programs() + _extra_programs()
    if quick:
        keep = {"tiny_add_one", "mlp_small", "linalg_cholesky", "fft", "segment_sums"}
        programs = [p for p in programs if p[0] in keep]
    return programs


# -- measuring ---------------------------------------------------------------


class Budget:
    """Seconds left for the run; a step that would not fit is skipped and listed."""

    def __init__(self, seconds: float) -> None:
        self.start = time.perf_counter()
        self.seconds = seconds
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def allows(self, step: str, estimate: float) -> bool:
        if self.left() >= estimate:
            return True
        self.skipped.append(step)
        log(f"skipping {step}: needs about {estimate:.0f} s, {self.left():.0f} s left")
        return False


def relative_error(ours: Sequence[Any], reference: Sequence[Any]) -> float:
    """max |ours - reference| / max |reference| over all outputs (inf if shapes or NaNs differ)."""
    worst = 0.0
    if len(ours) != len(reference):
        return float("inf")
    for a, b in zip(ours, reference, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return float("inf")
        if b.dtype.kind in "iub":  # integers and booleans: exactly
            if not np.array_equal(a, b):
                return float("inf")
            continue
        wide = np.complex128 if b.dtype.kind == "c" else np.float64
        a_wide, b_wide = a.astype(wide), b.astype(wide)
        if not np.array_equal(np.isnan(a_wide), np.isnan(b_wide)):
            return float("inf")
        known = ~np.isnan(b_wide)
        if not known.any():
            continue
        scale = max(float(np.max(np.abs(b_wide[known]))), 1e-30)
        worst = max(worst, float(np.max(np.abs(a_wide[known] - b_wide[known]))) / scale)
    return worst


def gpu_memory_mib() -> int | None:
    """GPU memory in use on the first GPU, from nvidia-smi; None without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return int(done.stdout.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """Sets (or, for None, removes) environment variables for the block; workers inherit them."""
    with environment_variables(values):
        yield


def read_phase_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_startups(records: list[dict[str, Any]], ready_at: float) -> dict[str, Any]:
    """Per-phase medians and maxima of the workers' start-ups, and whether they overlapped."""
    startups = [r for r in records if r["kind"] == "startup"]
    if not startups:
        return {}
    phases = sorted(
        {k for r in startups for k in r} - {"kind", "pid", "time", "platform", "plugin"}
    )
    # A worker was spawned at (its record's time - the phases before it), roughly.
    spawned = [r["time"] - sum(r.get(p, 0.0) for p in phases) for r in startups]
    loaded = [r["time"] for r in startups]
    return {
        "workers": len(startups),
        "median_s": {
            p: round(statistics.median(r.get(p, 0.0) for r in startups), 4) for p in phases
        },
        "max_s": {p: round(max(r.get(p, 0.0) for r in startups), 4) for p in phases},
        "spawn_spread_s": round(max(spawned) - min(spawned), 4),
        "plugin_loaded_spread_s": round(max(loaded) - min(loaded), 4),
        # Every worker was spawned before the first one had its plugin loaded: they
        # started in parallel, not one after another.
        "spawned_in_parallel": max(spawned) < min(loaded),
        "plugin_loaded_to_ready_s": round(ready_at - max(loaded), 4),
    }


def summarize_compiles(records: list[dict[str, Any]]) -> dict[str, Any]:
    compiles = [r for r in records if r["kind"] == "compile" and r["outcome"] == "compiled"]
    sums = {}
    for phase in ("key", "lookup", "lock_wait", "slot_wait", "compile", "serialize", "publish"):
        sums[phase] = round(sum(r.get(phase, 0.0) for r in compiles), 3)
    return {"compiled": len(compiles), "summed_phase_s": sums}


# -- the steps ---------------------------------------------------------------


def serial_jax(programs: list[Program], inputs: list[list[np.ndarray]], device: Any) -> dict:
    """Compiles with jax.jit one after another; returns timings and the reference outputs."""
    jax.config.update("jax_enable_compilation_cache", False)
    lower_s = compile_s = 0.0
    per_program, references = {}, []
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime
    for (name, function, shapes), arguments in zip(programs, inputs, strict=True):
        start = time.perf_counter()
        lowered = jax.jit(function).lower(*shapes)
        middle = time.perf_counter()
        compiled = lowered.compile()
        end = time.perf_counter()
        lower_s += middle - start
        compile_s += end - middle
        per_program[name] = end - middle
        outputs = compiled(*[jax.device_put(a, device) for a in arguments])
        references.append([np.asarray(o) for o in jax.tree_util.tree_leaves(outputs)])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = usage.ru_utime + usage.ru_stime - cpu
    slowest = max(per_program, key=per_program.get)
    return {
        "summary": {
            "lower_s": round(lower_s, 3),
            "compile_s": round(compile_s, 3),
            "cpu_s": round(cpu_s, 3),
            "cores_busy": round(cpu_s / max(lower_s + compile_s, 1e-9), 2),
            "slowest": [slowest, round(per_program[slowest], 3)],
        },
        "per_program": per_program,
        "references": references,
    }


def compare_all(
    names: list[str], outputs: list[Any], references: list[Any] | None, rtol: float
) -> dict[str, Any]:
    errors, failed = {}, []
    for name, ours, reference in zip(
        names, outputs, references or [None] * len(names), strict=True
    ):
        if isinstance(ours, BaseException):
            failed.append(f"{name}: {type(ours).__name__}: {str(ours)[:300]}")
            continue
        if reference is None:
            continue
        error = relative_error(ours, reference)
        errors[name] = error
        if not error <= rtol:
            failed.append(f"{name}: relative error {error:.3g} > {rtol:g}")
    return {
        "ok": len(names) - len(failed),
        "failed": failed,
        "max_relative_error": max(errors.values(), default=None),
        "errors": errors,
    }


def in_process(programs, lowered, inputs, references, rtol, cache_dir) -> dict:
    start = time.perf_counter()
    executables, summed = [], 0.0
    for program in lowered:
        executable, statistics_ = compile_program(program, cache_dir=cache_dir)
        executables.append(executable)
        summed += statistics_.compile_seconds
    wall = time.perf_counter() - start
    outputs = []
    for executable, arguments in zip(executables, inputs, strict=True):
        try:
            outputs.append(executable.run(arguments))
        except Exception as error:  # reported per program
            outputs.append(error)
    result = compare_all([p[0] for p in programs], outputs, references, rtol)
    return {
        "compile_s": round(wall, 3),
        "summed_compile_s": round(summed, 3),
        **result,
    }, executables


def run_all(pool: Pool, lowered, inputs) -> list[Any]:
    futures = [pool.submit(p, a) for p, a in zip(lowered, inputs, strict=True)]
    outputs = []
    for future in futures:
        try:
            outputs.append(future.result())
        except Exception as error:  # reported per program
            outputs.append(error)
    return outputs


def pool_stage(
    label: str,
    size: int,
    platform: str,
    names: list[str],
    lowered: list[Any],
    inputs: list[Any],
    references: list[Any] | None,
    rtol: float,
    cache_dir: Path,
    slots: str | None,
) -> dict[str, Any]:
    """One Pool: start-up, compile_many into cache_dir, a run of every program; its figures."""
    phase_log = _SCRATCH / f"phases-{label}.jsonl"
    with environment(**{PHASE_LOG_ENV: str(phase_log), SLOTS_ENV: slots}):
        slots_in_force = compile_slots(platform)
        start = time.perf_counter()
        with Pool(size, platform=platform, cache_dir=cache_dir) as pool:
            ready_s = time.perf_counter() - start
            ready_at = time.time()
            compile_start = time.perf_counter()
            results = pool.compile_many(
                list(zip(names, lowered, strict=True)), return_exceptions=True
            )
            compile_s = time.perf_counter() - compile_start
            statistics_ = pool.statistics
            outputs = run_all(pool, lowered, inputs)
            memory = gpu_memory_mib()
    records = read_phase_log(phase_log)
    failed_compiles = [
        f"{n}: {r}" for n, r in zip(names, results, strict=True) if isinstance(r, BaseException)
    ]
    compared = compare_all(names, outputs, references, rtol)
    return {
        "label": label,
        "workers": size,
        "compile_slots": slots_in_force,
        "ready_s": round(ready_s, 3),
        "startup": summarize_startups(records, ready_at),
        "compile_many_s": round(compile_s, 3),
        "summed_compile_s": round(statistics_.compile_seconds, 3),
        "compiled": statistics_.compiled,
        "loaded": statistics_.loaded,
        "compile_failures": failed_compiles,
        "phases": summarize_compiles(records),
        "gpu_memory_mib": memory,
        **{k: v for k, v in compared.items() if k != "errors"},
    }


def crash_check(pool: Pool, lowered, inputs, references, rtol, spin, spin_inputs) -> dict:
    """SIGKILLs the worker running a long task while the others run every program."""
    victim = pool.submit(spin, spin_inputs, name="spin")
    others = [pool.submit(p, a) for p, a in zip(lowered, inputs, strict=True)]
    deadline = time.monotonic() + 60
    killed = None
    seen: dict[int, float] = {}
    while time.monotonic() < deadline and killed is None and not victim.done():
        for info in pool.worker_info:
            if info["task"] == "spin":
                # Given to a worker is not yet started there (a worker killed before
                # it takes a task up passes the task on): let it run a moment first.
                since = seen.setdefault(info["pid"], time.monotonic())
                if time.monotonic() - since >= 0.3:
                    os.kill(info["pid"], signal.SIGKILL)
                    killed = info["pid"]
                break
        time.sleep(0.005)
    try:
        victim.result(timeout=120)
        victim_error = None
    except Exception as error:
        victim_error = error
    outputs = []
    for future in others:
        try:
            outputs.append(future.result(timeout=300))
        except Exception as error:
            outputs.append(error)
    compared = compare_all([f"#{i}" for i in range(len(others))], outputs, references, rtol)
    return {
        "killed_pid": killed,
        "killed_task_error": None if victim_error is None else type(victim_error).__name__,
        "killed_task_failed_as_crash": isinstance(victim_error, WorkerCrashedError),
        "others_ok": compared["ok"],
        "others_total": len(others),
        "others_failed": compared["failed"][:10],
    }


def rounds_check(pool: Pool, names, lowered, inputs, references, rtol, rounds: int) -> dict:
    failures, replaced, errors = [], [], []
    pids = {w["pid"] for w in pool.worker_info}
    for index in range(rounds):
        compared = compare_all(names, run_all(pool, lowered, inputs), references, rtol)
        failures.append(len(compared["failed"]))
        errors.extend(f"round {index + 1}: {f}" for f in compared["failed"][:5])
        now = {w["pid"] for w in pool.worker_info}
        replaced.append(len(now - pids))
        pids = now
        log(f"round {index + 1}/{rounds}: {failures[-1]} failed, {replaced[-1]} workers replaced")
    return {"failures_per_round": failures, "replaced_per_round": replaced, "errors": errors[:20]}


def tiny_round_trips(pool: Pool, executable: Any, device: Any, calls: int = 300) -> dict:
    x = np.ones(4, np.float32)
    jitted = jax.jit(lambda v: v + 1)
    on_device = jax.device_put(x, device)

    def median_us(call: Callable[[], Any]) -> float:
        for _ in range(20):
            call()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return round(statistics.median(times) * 1e6, 1)

    program = lower(lambda v: v + 1, [_f32(4)], platform=executable.platform)
    return {
        "in_process_us": median_us(lambda: executable.run([x])),
        "pool_us": median_us(lambda: pool.run(program, [x])),
        "jax_jit_us": median_us(lambda: np.asarray(jitted(on_device))),
    }


# -- main --------------------------------------------------------------------


def _sizes(text: str | None, platform: str, quick: bool) -> list[int]:
    if text:
        return sorted({int(s) for s in text.split(",") if s.strip()})
    cores = os.cpu_count() or 1
    if quick or platform == "cpu":
        return [2]
    return [n for n in (4, 8, 16) if n <= cores] or [cores]


def _jax_device(platform: str) -> tuple[Any, str | None]:
    """JAX's device for the platform (for the reference outputs), or its default one and a note."""
    try:
        return jax.devices(platform)[0], None
    except RuntimeError as error:
        return jax.devices()[
            0
        ], f"JAX has no {platform} backend ({error}); references are from {jax.default_backend()}"


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--platform", default="cuda", help="platform to check (cuda; cpu rehearses)"
    )
    parser.add_argument(
        "--sizes", help="pool sizes, e.g. 4,8,16 (default: 4, 8, 16 up to the cores)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="repeated rounds through one pool")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    parser.add_argument(
        "--rtol", type=float, default=1e-3, help="relative error allowed vs jax.jit"
    )
    parser.add_argument("--quick", action="store_true", help="five programs, one small pool")
    return parser.parse_args(argv)


def _busy_program(platform: str) -> tuple[Any, list[np.ndarray]]:
    """A program (_spin) that keeps a worker busy for about two seconds, and its inputs."""
    spin = lower(_spin, [_f32(64), jax.ShapeDtypeStruct((1,), jnp.int32)], platform=platform)
    spin_executable, _ = compile_program(spin, cache_dir=_SCRATCH / "in-process")
    iterations = 1000
    while True:  # iterations for about two seconds of work
        begin = time.perf_counter()
        spin_executable.run([np.ones(64, np.float32), np.array([iterations], np.int32)])
        took = time.perf_counter() - begin
        if took > 0.2 or iterations >= 1 << 30:
            break
        iterations *= 4
    iterations = min(int(iterations * 2.0 / max(took, 1e-6)), (1 << 31) - 1)
    return spin, [np.ones(64, np.float32), np.array([iterations], np.int32)]


def _one_pool_checks(
    args: argparse.Namespace,
    size: int,
    checks: tuple[list[str], list[Any], list[Any], list[Any]],
    executable: Any,
    device: Any,
) -> dict[str, Any]:
    """Crash isolation, rounds of every program and small round trips through one Pool of
    size workers; checks are the programs' names, lowered programs, inputs and references."""
    names, lowered, inputs, references = checks
    found: dict[str, Any] = {}
    spin, spin_inputs = _busy_program(args.platform)
    with Pool(size, platform=args.platform, cache_dir=_SCRATCH / f"pool{size}") as pool:
        pool.compile_many([spin, *lowered])
        log("crash isolation: SIGKILL a busy worker")
        found["crash_isolation"] = crash_check(
            pool, lowered, inputs, references, args.rtol, spin, spin_inputs
        )
        log(f"{args.rounds} rounds of every program")
        found["rounds"] = rounds_check(
            pool, names, lowered, inputs, references, args.rtol, args.rounds
        )
        found["tiny_round_trip"] = tiny_round_trips(pool, executable, device)
        found["gpu_memory_mib_with_pool"] = gpu_memory_mib()
    return found


def _in_process_summary(in_proc: dict[str, Any], jax_compile_s: float) -> dict[str, Any]:
    """The summary's plugin, tolerance and in_process parts, from in_process's figures."""
    runtime = loaded_runtime()
    plugin = runtime.describe() if runtime is not None else None
    in_proc["ratio_vs_jax"] = round(in_proc["compile_s"] / max(jax_compile_s, 1e-9), 3)
    tolerance = {
        "max_relative_error": in_proc["max_relative_error"],
        "per_program": {k: float(f"{v:.3g}") for k, v in in_proc.pop("errors").items()},
    }
    return {"plugin": plugin, "tolerance": tolerance, "in_process": in_proc}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _arguments(argv)
    budget = Budget(args.budget)
    platform = args.platform
    summary: dict[str, Any] = {"platform": platform, "cores": os.cpu_count(), "rtol": args.rtol}
    device, note = _jax_device(platform)
    summary["jax"] = {"version": jax.__version__, "device": str(device), "note": note}

    programs = programs_to_check(args.quick)
    names = [p[0] for p in programs]
    inputs = [example_inputs(p[2]) for p in programs]
    log(f"lowering {len(programs)} programs for {platform}")
    start = time.perf_counter()
    lowered = [lower(f, shapes, platform=platform) for _, f, shapes in programs]
    summary["programs"] = len(programs)
    summary["lower_s"] = round(time.perf_counter() - start, 3)

    log("serial JAX compile (the baseline and the reference outputs)")
    baseline = serial_jax(programs, inputs, device)
    references = baseline.pop("references")
    jax_compile_s = baseline["summary"]["compile_s"]
    summary["serial_jax"] = baseline["summary"]

    log("in-process compile_program, serially")
    in_proc, executables = in_process(
        programs, lowered, inputs, references, args.rtol, _SCRATCH / "in-process"
    )
    summary.update(_in_process_summary(in_proc, jax_compile_s))

    summary["gpu_memory_mib_before_pools"] = gpu_memory_mib()
    sizes = _sizes(args.sizes, platform, args.quick)
    pools = []
    estimate = max(in_proc["compile_s"], 5.0)  # a pool compiles no slower than serially

    def stage_vs_jax(label: str, size: int, cache: Path, slots: str | None) -> dict:
        """A pool stage (pool_stage) with its compile time as a ratio of serial JAX's."""
        stage = pool_stage(
            label, size, platform, names, lowered, inputs, references, args.rtol, cache, slots
        )
        stage["ratio_vs_jax"] = round(stage["compile_many_s"] / max(jax_compile_s, 1e-9), 3)
        return stage

    for size in sizes:
        if not budget.allows(f"pool {size}", estimate):
            continue
        log(f"Pool({size}) compile_many into a fresh cache")
        stage = stage_vs_jax(
            f"pool{size}", size, _SCRATCH / f"pool{size}", os.environ.get(SLOTS_ENV)
        )
        stage["contention"] = round(
            stage["summed_compile_s"] / max(in_proc["summed_compile_s"], 1e-9), 3
        )
        pools.append(stage)
    summary["pools"] = pools
    largest = max(sizes)

    if budget.allows("slots off", estimate):
        log(f"Pool({largest}) with compile slots off")
        summary["slots_off"] = stage_vs_jax("slots-off", largest, _SCRATCH / "slots-off", "0")

    warm_dir = _SCRATCH / f"pool{largest}"
    if warm_dir.exists() and budget.allows("warm autotune", estimate):
        removed = DiskCache(warm_dir).clear()
        autotune = warm_dir / "autotune"
        files = sum(1 for _ in autotune.rglob("*.textproto")) if autotune.exists() else 0
        log(f"Pool({largest}) again: {removed} executables removed, {files} autotune results kept")
        stage = stage_vs_jax("warm-autotune", largest, warm_dir, os.environ.get(SLOTS_ENV))
        stage["autotune_results"] = files
        summary["warm_autotune"] = stage

    if budget.allows("crash isolation, rounds and round trips", 30.0):
        checks = (names, lowered, inputs, references)
        summary.update(_one_pool_checks(args, largest, checks, executables[0], device))

    summary["budget"] = {
        "limit_s": args.budget,
        "used_s": round(time.perf_counter() - budget.start, 1),
        "skipped": budget.skipped,
    }
    return summary


if __name__ == "__main__":
    try:
        result = main()
    finally:
        shutil.rmtree(_SCRATCH, ignore_errors=True)
    print(json.dumps(result))
