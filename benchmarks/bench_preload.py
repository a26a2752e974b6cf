"""Benchmark: a Pool that starts loaded, against two plain processes loading half each.

Usage::

    python benchmarks/bench_preload.py [--rounds N]

The goal: ``Pool(2, preload=manifest, prime=True)`` of the
example programs (pool/examples), constructed until it is ready (every
worker holds every program, loaded and primed), in at most 1.3x the time of
two plain processes started at once that each load and prime half of them.

Setup (not timed): the examples are lowered and compiled into a fresh
temporary cache, and a manifest of them is written; for the plain loader
each entry's serialized executable is written to a file of its own. Then
--rounds times (default 7), alternated (benchmarks/harness.py), each in fresh
processes:

  pool    a fresh ``python -c`` that constructs the Pool (the time inside it,
          from the call to its return, is the figure; its whole time from
          spawn to ready is shown too), from the cache the manifest names
  plain   two fresh processes spawned together, each the plainest loader of
          the plugin (bench_start.py's): the native module loaded by
          file path, the plugin, a client, jaxlib's LAPACK FFI handlers
          registered as the worker registers them (worker.plugin.kernels:
          the handlers whose name ends in ``_ffi``, with the plugin's "Host"
          FFI platform), once its half holds a linalg program, then for each
          program: read, deserialize, one execution on zeros. Its figure is
          the time from spawning both to the last one's "ready" line.

Each plain child also reports its phases (imports, plugin and client, LAPACK
registration, deserializing, priming), and each pool child what its workers
said (the slowest worker's time to Ready, and the loading the pool's
preload_statistics sums over both workers). Medians over the rounds;
ratios are of medians from the same run.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_start import PLAIN_CLIENT
from harness import Samples, Side, compare, ratio_line

from pool.examples import example_programs

GOAL = 1.3

POOL = """
import sys, time
started = time.perf_counter()
from pool import Pool
imported = time.perf_counter()
pool = Pool(2, preload=sys.argv[1], prime=True, cache_dir=sys.argv[2])
ready = time.perf_counter()
loading = pool.preload_statistics.load_seconds
print(f"{imported - started} {ready - imported} {loading}", flush=True)
pool.close()
"""

PLAIN = (
    PLAIN_CLIENT
    + """plugged = time.perf_counter()
with open(sys.argv[3]) as file:
    programs = json.load(file)
registering = deserializing = priming = 0.0
executables = []
for program in programs:
    with open(program["payload"], "rb") as file:
        data = file.read()
    if registering == 0.0 and b"lapack_" in data:
        begun = time.perf_counter()
        from jaxlib.cpu import _lapack
        _lapack.initialize()
        for name, capsule in _lapack.registrations().items():
            if isinstance(capsule, (tuple, list)):  # (capsule, api_version): older jaxlibs
                if capsule[-1] == 1:
                    plugin.register_ffi_handler(name, capsule[0], "Host", 0)
            elif name.endswith("_ffi"):
                plugin.register_ffi_handler(name, capsule, "Host", 0)
        registering = time.perf_counter() - begun
    begun = time.perf_counter()
    executable = client.deserialize(data)
    loaded = time.perf_counter()
    inputs = [np.zeros(shape, dtype) for shape, dtype in program["inputs"]]
    outputs = [np.empty(size, np.uint8) for size in program["outputs"]]
    executable.execute(inputs, program["codes"], outputs, True)
    deserializing += loaded - begun
    priming += time.perf_counter() - loaded
    executables.append(executable)
print(
    f"{imported - started} {plugged - imported} {registering} {deserializing} {priming}",
    flush=True,
)
"""
)


def setup(root: Path) -> dict[str, Any]:
    """Compiles the examples into a fresh cache; writes the manifest and the plain halves."""
    cache = root / "cache"
    os.environ["PJRT_POOL_CACHE_DIR"] = str(cache)
    from pool import compile_program, lower
    from pool.manifest import Manifest
    from worker import _pjrt
    from worker.cache.entry import decode
    from worker.dtypes import code_of_dtype
    from worker.plugin.runtime import get_runtime
    from worker.records import ProgramSpec

    specs = []
    for name, function, shapes in example_programs():
        executable, _ = compile_program(lower(function, shapes), cache_dir=cache)
        specs.append(ProgramSpec.from_executable(name, executable))
    manifest = root / "manifest.json"
    Manifest(specs, str(cache), "cpu").write(manifest)
    halves = []
    for half in (specs[0::2], specs[1::2]):
        programs = []
        for spec in half:
            entry = decode((cache / "entries" / f"{spec.key}.pjx").read_bytes())
            payload = root / f"{spec.key}.bin"
            payload.write_bytes(entry.payload)
            types = spec.input_types or ()
            programs.append(
                {
                    "payload": str(payload),
                    "inputs": [[list(t.shape), str(t.dtype)] for t in types],
                    "codes": [code_of_dtype(t.dtype) for t in types],
                    "outputs": list(spec.output_bytes),
                }
            )
        path = root / f"half{len(halves)}.json"
        path.write_text(json.dumps(programs))
        halves.append(str(path))
    return {
        "cache": str(cache),
        "manifest": str(manifest),
        "count": len(specs),
        "plain": [_pjrt.__file__, get_runtime().location.path],
        "halves": halves,
    }


POOL_FIGURES = ("import", "constructed", "loading")
"""What a pool child prints: its import of pool, Pool(...) until ready, both workers'
loading (preload_statistics)."""

PLAIN_FIGURES = ("imports", "plugin and client", "LAPACK", "deserialize", "prime")
"""What a plain child prints, per phase."""


def _pool(command: list[str], env: dict[str, str]) -> dict[str, float]:
    """A pool child: its wall time from spawn to ready, and the figures it printed."""
    start = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout is not None
    line = child.stdout.readline()
    wall = time.perf_counter() - start
    _, error = child.communicate()
    if child.returncode != 0 or not line:
        raise SystemExit(f"pool child failed:\n{error.decode()[-3000:]}")
    printed = (float(value) for value in line.split())
    return {"wall": wall, **dict(zip(POOL_FIGURES, printed, strict=True))}


def _plain(commands: list[list[str]], env: dict[str, str]) -> dict[str, float]:
    """Two plain children spawned together: the time to the last one's ready line, and the
    per-phase figures of the slower one."""
    start = time.perf_counter()
    children = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for command in commands
    ]
    lines = []
    for child in children:
        assert child.stdout is not None
        lines.append(child.stdout.readline())
    wall = time.perf_counter() - start
    for child, line in zip(children, lines, strict=True):
        _, error = child.communicate()
        if child.returncode != 0 or not line:
            raise SystemExit(f"plain child failed:\n{error.decode()[-3000:]}")
    slower = max(([float(value) for value in line.split()] for line in lines), key=sum)
    return {"wall": wall, **dict(zip(PLAIN_FIGURES, slower, strict=True))}


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    import pool
    import worker

    trees = [Path(package.__file__).parent for package in (pool, worker)]
    for tree in trees:  # as an installation does: no child compiles our modules
        compileall.compile_dir(str(tree), quiet=1)
    root = Path(tempfile.mkdtemp(prefix="pjrt-pool-preload-"))
    try:
        made = setup(root)
        unset = ("PJRT_POOL_CACHE_DIR", "PYTHONDONTWRITEBYTECODE")
        base = {k: v for k, v in os.environ.items() if k not in unset}
        plain_env = {**base, "XLA_FLAGS": "--xla_cpu_enable_fast_min_max=false"}
        python = sys.executable
        pool_args = [made["manifest"], made["cache"]]
        halves = [[python, "-c", PLAIN, *made["plain"], half] for half in made["halves"]]
        sides = [
            Side("plain", lambda: _plain(halves, plain_env), measures=True),
            Side("pool", lambda: _pool([python, "-c", POOL, *pool_args], base), measures=True),
        ]
        samples = compare(sides, args.rounds)  # the warm-up round pages the plugin in
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report_preload(samples, made["count"])
    return 0


def report_preload(samples: Samples, count: int) -> None:
    """Prints the medians and the ratios against the plain processes, with the goal."""
    plain = samples.median("plain")
    rounds = len(samples.of("plain"))
    print(
        f"a Pool(2) preloading and priming {count} example programs, against two plain "
        f"processes loading half each (medians of {rounds} rounds of fresh processes)"
    )
    ratio_line("plain: spawn to both ready", plain, plain)
    ratio_line("Pool(...) constructed", samples.median("pool", "constructed"), plain, goal=GOAL)
    ratio_line("the pool's whole process, spawn to ready", samples.median("pool"), plain)
    ratio_line("  its import of pool", samples.median("pool", "import"), plain)
    ratio_line("  both workers' loading", samples.median("pool", "loading"), plain)
    for figure in PLAIN_FIGURES:
        ratio_line(f"  the slower plain process: {figure}", samples.median("plain", figure), plain)


if __name__ == "__main__":
    sys.exit(main())
