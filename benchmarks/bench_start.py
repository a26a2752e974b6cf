"""Benchmark: a serving process's start, against the plainest loader and against the floor.

Usage::

    python benchmarks/bench_start.py [--rounds N] [--program transformer|mlp_medium]

How much does a production job cost that starts a fresh interpreter, runs
one warmed program from a manifest or a bundle and reads its result? The
parent lowers the program (by default a 4-layer transformer training step;
``--program mlp_medium`` takes that example), compiles it into a fresh
temporary cache, and writes a manifest and a bundle. Then --rounds times
(default 7), every kind in turn (benchmarks/harness.py), each a fresh
process timed from spawn to exit, its CPU time (user and system) taken too:

  numpy         ``python -c "import numpy"``: the interpreter and numpy
  plain         the plainest load-and-run: the native module loaded by file
                path (no pjrt-pool Python at all), the plugin, a client,
                deserialize, two executions: what any loader of this plugin
                pays (the baseline)
  manifest      load_manifest(manifest).run(name, inputs), twice, with the cache
  bundle        the same from the bundle, the cache directory present (the
                plugin's digest memoized there, as on a host that warmed or
                imported)
  bundle-ro     the same on a host with no cache directory (HOME empty)
  primed        load_manifest(bundle, prime=True) on that host, then two runs
  cli           ``pjrt-pool run BUNDLE NAME`` on that host (one run, printed)

and prints, with their goals: each kind's wall time against plain's (1.05x;
1.10x with no cache directory) and its CPU time, which a busy machine
disturbs least; each kind against the floor (numpy's process plus the
program's warm run in process) and against the floor plus the plugin's own
first-run extra (plain's first run less its second); each child's own
figures (imports, load, first run, warm run); and the first request after
priming against the warm run (1.2x).

Inputs are constants of the program's types (their values do not change
the time). The pool and worker packages are byte-compiled first, as an
installation does (a process that compiles its modules from source each
time measures the compiler). Every directory is a fresh temporary one,
removed at exit.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from harness import Samples, Side, compare, ratio_line, report

from pool import compile_program, lower
from pool.manifest import Manifest
from worker import _pjrt
from worker.bundle.writer import create_bundle
from worker.cache import DiskCache
from worker.cache.entry import decode
from worker.dtypes import code_of_dtype
from worker.plugin.runtime import get_runtime
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


def setup(root: Path, name: str) -> dict[str, Any]:
    """Compiles the program into a cache under root, with a manifest, a bundle and what the
    plainest loader needs (the native module, the plugin, the serialized executable)."""
    cache = root / "cache"
    os.environ["PJRT_POOL_CACHE_DIR"] = str(cache)
    function, shapes = _program(name)
    program = lower(function, shapes)
    executable, _ = compile_program(program, cache_dir=cache)
    spec = ProgramSpec.from_executable(name, executable)
    manifest = root / "manifest.json"
    Manifest([spec], str(cache), "cpu").write(manifest)
    made: dict[str, Any] = {"cache": cache, "manifest": manifest, "spec": spec}
    made["bundle"] = root / "app.bundle"
    create_bundle(made["bundle"], [(spec, DiskCache(cache, create=False), "")])
    # The plainest load-and-run needs the plugin's serialized bytes and the native module.
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


FIGURES = ("imports", "load", "first", "warm")
"""What a loader child prints, in seconds, measured inside itself."""

PRIMED = RUN.replace("load_manifest(sys.argv[1])", "load_manifest(sys.argv[1], prime=True)")
CLI = "import sys; from pool.cli.main import main; sys.exit(main())"


def fresh_process(command: list[str], env: dict[str, str], reports: bool) -> Callable[[], Any]:
    """A side's sample: a child's wall time from spawn to exit ("wall"), its CPU time ("cpu":
    user and system, its threads' included), and (reports) the figures it printed."""

    def measure() -> dict[str, float]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)  # children run one at a time
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise SystemExit(f"child failed ({command[:3]}...):\n{done.stderr[-3000:]}")
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        figures = {"wall": wall, "cpu": cpu}
        if reports:
            printed = [float(value) for value in done.stdout.split()[: len(FIGURES)]]
            figures.update(zip(FIGURES, printed, strict=True))
        return figures

    return measure


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--program", default="transformer")
    args = parser.parse_args(argv)
    import pool
    import worker

    for package in (pool, worker):  # as an installation does: no child compiles our modules
        compileall.compile_dir(str(Path(package.__file__).parent), quiet=1)
    root = Path(tempfile.mkdtemp(prefix="pjrt-pool-start-"))
    try:
        made = setup(root, args.program)
        home = root / "home"
        home.mkdir()
        unset = ("PJRT_POOL_CACHE_DIR", "PYTHONDONTWRITEBYTECODE", "XDG_CACHE_HOME")
        base = {k: v for k, v in os.environ.items() if k not in unset}
        with_cache = {**base, "PJRT_POOL_CACHE_DIR": str(made["cache"])}
        no_cache = {**base, "HOME": str(home)}
        plain_env = {**base, "XLA_FLAGS": "--xla_cpu_enable_fast_min_max=false"}
        python, name = sys.executable, args.program
        manifest, bundle = str(made["manifest"]), str(made["bundle"])
        kinds = {
            "plain": ([python, "-c", PLAIN, *made["plain"]], plain_env),
            "numpy": ([python, "-c", "import numpy"], base),
            "manifest": ([python, "-c", RUN, manifest, name], with_cache),
            "bundle": ([python, "-c", RUN, bundle, name], with_cache),
            "bundle-ro": ([python, "-c", RUN, bundle, name], no_cache),
            "primed": ([python, "-c", PRIMED, bundle, name], no_cache),
            "cli": ([python, "-c", CLI, "run", bundle, name], no_cache),
        }
        sides = [
            Side(kind, fresh_process(command, env, kind not in ("numpy", "cli")), measures=True)
            for kind, (command, env) in kinds.items()
        ]
        # The warm-up round pages the plugin in and fills the OS's caches.
        samples = compare(sides, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"start of a serving process ({name}); python {sys.version.split()[0]}, "
          f"jax {jax.__version__}")  # fmt: skip
    report_start(samples)
    return 0


def report_start(samples: Samples) -> None:
    """Prints the medians and the ratios against their goals."""
    loaders = ["plain", "manifest", "bundle", "bundle-ro", "primed", "cli"]
    goals = {"manifest": 1.05, "bundle": 1.05, "bundle-ro": 1.10}
    report(samples, "wall time, spawn to exit", sides=loaders, goals=goals)
    report(samples, "CPU time, user and system", figure="cpu", sides=loaders)
    warm = samples.median("manifest", "warm")
    floor = samples.median("numpy") + warm
    extra = samples.median("plain", "first") - samples.median("plain", "warm")
    print("against the floor: python -c 'import numpy' and the program's warm run in process")
    ratio_line("floor", floor, floor)
    for kind in loaders:
        ratio_line(kind, samples.median(kind), floor)
    print("against the floor and the plugin's own first-run extra (plain's first run less its "
          "second)")  # fmt: skip
    ratio_line("floor + first-run extra", floor + extra, floor + extra)
    for kind in loaders:
        ratio_line(kind, samples.median(kind), floor + extra)
    print("inside each child, against plain's: " + ", ".join(FIGURES))
    for figure in FIGURES:
        for kind in loaders[:-1]:
            ratio_line(f"{kind}: {figure}", samples.median(kind, figure),
                       samples.median("plain", figure))  # fmt: skip
    primed_first, primed_warm = samples.median("primed", "first"), samples.median("primed", "warm")
    print("priming (two runs on zeros at load): the first request against the warm run")
    ratio_line("primed: first request", primed_first, primed_warm, goal=1.2)
    ratio_line("bundle-ro (not primed): first run", samples.median("bundle-ro", "first"),
               samples.median("bundle-ro", "warm"))  # fmt: skip
    ratio_line("primed: its load, against bundle-ro's", samples.median("primed", "load"),
               samples.median("bundle-ro", "load"))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
