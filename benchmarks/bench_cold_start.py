"""Benchmark: a fresh process that runs one warmed program, against the floor.

Usage::

    python benchmarks/bench_cold_start.py [--rounds N] [--program transformer|mlp_medium]

The question (issue 19): how much does a production job cost that starts a
fresh interpreter, runs one warmed program from a manifest or a bundle and
reads its result, compared with the floor: a fresh ``python -c "import
numpy"`` plus that program's own in-process run time? The goal is at most
1.5x the floor, or 1.2x the floor plus the first-run cost that is inherent
to the plugin.

Method (one run measures everything, interleaved, so the ratios hold on a
noisy machine):

1. The parent lowers the program (by default a 4-layer transformer
   training step; ``--program mlp_medium`` takes that example) and compiles
   it into a fresh temporary cache, writes a manifest and, if this version
   of pjrt-pool has them, a bundle.
2. --rounds times (default 15), in turn, each in a fresh process timed from
   spawn to exit by this process:

   numpy      ``python -c "import numpy"``: the interpreter and numpy
   manifest   load_manifest(manifest).run(name, inputs), reading the result
   bundle     the same from the bundle, with the cache directory present
              (the plugin's digest is memoized there, as on a host that
              warmed or imported)
   bundle-ro  the same on a host with no cache directory at all (HOME an
              empty directory): nothing to read a memo from, so the plugin
              library is hashed (SHA-256) in the process
   plain      the plainest load-and-run: the native module loaded by file
              path (no pjrt-pool Python at all), the plugin, a client,
              deserialize, two executions: its first execution against its
              second is what the plugin itself costs on a first run, and its
              whole time is what any loader of this plugin pays

   Each child (numpy's aside) also reports, measured inside itself, its
   imports, load, first run and second (warm) run, and so the rest of its
   wall time: the interpreter's start and exit (with the plugin's
   teardown); the program's in-process run time is the median of the
   manifest children's warm runs.
3. The report gives medians, and the ratios: each kind's wall time against
   the floor (numpy + warm run), against the floor plus the plain child's
   first-run extra, and against the plain child.

Inputs are constants of the program's types (their values do not change
the time). The pool and worker packages are byte-compiled first, as an
installation does (a process that compiles its modules from source each time
measures the compiler). Every directory is a fresh temporary one, removed
at exit.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pool import compile_program, lower
from pool.manifest import Manifest
from worker.records import ProgramSpec

LAYERS, BATCH, SEQUENCE, WIDTH, HIDDEN = 4, 4, 64, 128, 512


def _transformer_step(x, target, *params):
    """One SGD step of a 4-layer transformer encoder; returns the loss and new weights."""

    def loss(weights):
        h = x
        for layer in range(LAYERS):
            w_qkv, w_o, w_1, w_2 = weights[4 * layer : 4 * layer + 4]
            normed = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
            q, k, v = jnp.split(normed @ w_qkv, 3, axis=-1)
            scores = jax.nn.softmax(q @ k.transpose(0, 2, 1) / np.sqrt(WIDTH), axis=-1)
            h = h + (scores @ v) @ w_o
            h = h + jax.nn.gelu(h @ w_1) @ w_2
        return jnp.mean((h - target) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return (value, *(p - 0.01 * g for p, g in zip(params, grads, strict=True)))


def _program(name: str) -> tuple[Any, list[jax.ShapeDtypeStruct]]:
    f32 = jnp.float32
    if name == "transformer":
        layer = [(WIDTH, 3 * WIDTH), (WIDTH, WIDTH), (WIDTH, HIDDEN), (HIDDEN, WIDTH)]
        shapes = [(BATCH, SEQUENCE, WIDTH)] * 2 + layer * LAYERS
        return _transformer_step, [jax.ShapeDtypeStruct(s, f32) for s in shapes]
    from pool.examples import example_programs

    for example, function, shapes in example_programs():
        if example == name:
            return function, shapes
    raise SystemExit(f"no program {name}: transformer, or one of the examples")


RUN = """
import sys, time
started = time.perf_counter()
from pool.manifest import load_manifest
import numpy as np
imported = time.perf_counter()
manifest = load_manifest(sys.argv[1])
spec = manifest.spec(sys.argv[2])
inputs = [np.full(t.shape, 0.01, t.dtype) for t in spec.input_types]
manifest.executable(sys.argv[2])
loaded = time.perf_counter()
outputs = manifest.run(sys.argv[2], inputs)
total = float(outputs[0].sum())
first = time.perf_counter()
manifest.run(sys.argv[2], inputs)
warm = time.perf_counter()
print(f"{imported - started} {loaded - imported} {first - loaded} {warm - first} {total}")
"""

PLAIN_CLIENT = """
import importlib.util, json, sys, time
started = time.perf_counter()
import numpy as np
spec = importlib.util.spec_from_file_location("_pjrt", sys.argv[1])
native = importlib.util.module_from_spec(spec)
spec.loader.exec_module(native)
imported = time.perf_counter()
plugin = native.Plugin.load(sys.argv[2])
client = native.Client(plugin, {})
"""
"""The plainest loader's start: the native module by file path (argv[1]), the plugin
(argv[2]) and a client, no pjrt-pool Python at all; PLAIN and bench_preload's go on."""

PLAIN = (
    PLAIN_CLIENT
    + """with open(sys.argv[3], "rb") as file:
    executable = client.deserialize(file.read())
setup = json.loads(sys.argv[4])
inputs = [np.full(shape, 0.01, np.float32) for shape in setup["inputs"]]
outputs = [np.empty(size, np.uint8) for size in setup["outputs"]]
codes = setup["codes"]
loaded = time.perf_counter()
executable.execute(inputs, codes, outputs, True)
first = time.perf_counter()
executable.execute(inputs, codes, outputs, True)
warm = time.perf_counter()
print(f"{imported - started} {loaded - imported} {first - loaded} {warm - first} 0")
"""
)


def _timed(command: list[str], env: dict[str, str]) -> tuple[float, list[float]]:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"child failed ({command[:3]}...):\n{done.stderr[-3000:]}")
    fields = [float(value) for value in done.stdout.split()] if done.stdout.strip() else []
    return wall, fields


def _setup(root: Path, name: str) -> dict[str, Any]:
    cache = root / "cache"
    os.environ["PJRT_POOL_CACHE_DIR"] = str(cache)
    function, shapes = _program(name)
    program = lower(function, shapes)
    executable, _ = compile_program(program, cache_dir=cache)
    spec = ProgramSpec.from_executable(name, executable)
    manifest = root / "manifest.json"
    Manifest([spec], str(cache), "cpu").write(manifest)
    made: dict[str, Any] = {"cache": cache, "manifest": manifest, "spec": spec}
    try:
        from worker.bundle.writer import create_bundle
        from worker.cache import DiskCache
    except ImportError:  # a version of pjrt-pool without bundles
        made["bundle"] = None
    else:
        made["bundle"] = root / "app.bundle"
        create_bundle(made["bundle"], [(spec, DiskCache(cache, create=False), "")])
    # The plainest load-and-run needs the plugin's serialized bytes and the native module.
    from worker import _pjrt
    from worker.cache.entry import decode
    from worker.dtypes import code_of_dtype
    from worker.plugin.runtime import get_runtime

    entry = decode((cache / "entries" / f"{spec.key}.pjx").read_bytes())
    (root / "payload.bin").write_bytes(entry.payload)
    made["plain"] = [
        _pjrt.__file__,
        get_runtime().location.path,
        str(root / "payload.bin"),
        json.dumps(
            {
                "inputs": [list(t.shape) for t in spec.input_types or ()],
                "outputs": list(spec.output_bytes),
                "codes": [code_of_dtype(t.dtype) for t in spec.input_types or ()],
            }
        ),
    ]
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--program", default="transformer")
    args = parser.parse_args(argv)
    import pool
    import worker

    for package in (pool, worker):
        compileall.compile_dir(str(Path(package.__file__).parent), quiet=1)
    root = Path(tempfile.mkdtemp(prefix="pjrt-pool-cold-"))
    try:
        made = _setup(root, args.program)
        home = root / "home"
        home.mkdir()
        unset = ("PJRT_POOL_CACHE_DIR", "PYTHONDONTWRITEBYTECODE")
        base = {k: v for k, v in os.environ.items() if k not in unset}
        with_cache = {**base, "PJRT_POOL_CACHE_DIR": str(made["cache"])}
        no_cache = {**base, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
        plain_env = {**base, "XLA_FLAGS": "--xla_cpu_enable_fast_min_max=false"}
        python = sys.executable
        kinds: dict[str, tuple[list[str], dict[str, str]]] = {
            "numpy": ([python, "-c", "import numpy"], base),
            "manifest": ([python, "-c", RUN, str(made["manifest"]), args.program], with_cache),
            "plain": ([python, "-c", PLAIN, *made["plain"]], plain_env),
        }
        if made["bundle"] is not None:
            kinds["bundle"] = ([python, "-c", RUN, str(made["bundle"]), args.program], with_cache)
            kinds["bundle-ro"] = ([python, "-c", RUN, str(made["bundle"]), args.program], no_cache)
        results: dict[str, list[tuple[float, list[float]]]] = {kind: [] for kind in kinds}
        for command, env in kinds.values():  # page the plugin in, fill the OS's caches
            _timed(command, env)
        for _ in range(args.rounds):
            for kind, (command, env) in kinds.items():
                results[kind].append(_timed(command, env))
        report(results, args.program, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def report(results: dict[str, list[tuple[float, list[float]]]], program: str, rounds: int) -> None:
    def median(kind: str, field: int | None = None) -> float:
        values = [wall if field is None else fields[field] for wall, fields in results[kind]]
        return statistics.median(values)

    warm_run = median("manifest", 3)
    numpy_wall = median("numpy")
    floor = numpy_wall + warm_run
    first_extra = median("plain", 2) - median("plain", 3)
    print(
        f"cold start of one warmed program ({program}), {rounds} fresh processes per kind, "
        f"medians; python {sys.version.split()[0]}, jax {jax.__version__}"
    )
    print(f"  python -c 'import numpy'            {numpy_wall * 1e3:8.1f} ms")
    print(f"  the program's warm in-process run   {warm_run * 1e3:8.1f} ms")
    print(f"  floor (the two summed)              {floor * 1e3:8.1f} ms")
    print(
        f"  first-run extra in the plugin       {first_extra * 1e3:8.1f} ms  (plain: first run "
        f"{median('plain', 2) * 1e3:.1f} ms, later {median('plain', 3) * 1e3:.1f} ms)"
    )
    plain = median("plain")
    print(
        "  kind        wall ms   x floor  x floor+extra  x plain   (inside: imports, load, "
        "first run, start+exit ms)"
    )
    for kind in results:
        if kind == "numpy":
            continue
        wall = median(kind)
        inside = [median(kind, field) for field in range(4)]
        rest = statistics.median(w - sum(f[:4]) for w, f in results[kind])
        shown = " ".join(f"{value * 1e3:6.1f}" for value in (*inside[:3], rest))
        print(
            f"  {kind:10} {wall * 1e3:8.1f}  {wall / floor:7.2f}x  "
            f"{wall / (floor + first_extra):11.2f}x  {wall / plain:6.2f}x     {shown}"
        )
    summary = {
        kind: {"wall_ms": round(median(kind) * 1e3, 2), "x_floor": round(median(kind) / floor, 3)}
        for kind in results
    }
    summary["floor_ms"] = round(floor * 1e3, 2)  # type: ignore[assignment]
    summary["first_run_extra_ms"] = round(first_extra * 1e3, 2)  # type: ignore[assignment]
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
