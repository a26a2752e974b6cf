"""Benchmark: how long ``pjrt-pool bundle check`` takes, for the examples and hundreds more.

Usage::

    python benchmarks/bench_preflight.py [--extra N] [--rounds R]

The preflight must answer well under a second for a few hundred programs,
without deserializing anything. Method:

1. Compile the 33 examples (pool.examples) into a fresh temporary
   cache, and N more small programs (default 300: a sine with a different
   constant each, every one its own executable), in this process; write a
   manifest of each set and a bundle of each.
2. R times (default 7), in turn (benchmarks/harness.py), each in a fresh
   process timed from spawn to exit: ``python -c "import numpy"`` (the
   baseline), then ``pjrt-pool
   bundle check`` of each bundle, and of the examples' manifest and cache,
   on a host with the cache directory (the plugin's digest memoized there,
   as after warming or importing) and, for the large bundle, on one with no
   cache directory at all (the plugin library hashed in the process).
3. Report medians: each check's whole process, the time the check itself
   reports (opening and verifying the bundle, loading the plugin, judging
   every program), and ratios against the baseline of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from harness import Side, compare, report

from pool import compile_program, lower
from pool.examples import example_programs
from pool.manifest import Manifest
from worker.bundle.writer import create_bundle
from worker.cache import DiskCache
from worker.records import ProgramSpec

CHECK = "import sys; from pool.cli.main import main; sys.exit(main())"


def _warm(cache: Path, programs: list[tuple[str, object, list]], manifest: Path, bundle: Path):
    specs = []
    for name, function, shapes in programs:
        executable, _ = compile_program(lower(function, shapes), cache_dir=cache)
        specs.append(ProgramSpec.from_executable(name, executable))
    Manifest(specs, str(cache), "cpu").write(manifest)
    create_bundle(bundle, [(spec, DiskCache(cache, create=False), "") for spec in specs])
    return len(specs)


def _sine(constant: float):
    return lambda x: jnp.sin(x) * constant + constant


def fresh_process(command: list[str], env: dict[str, str]) -> Callable[[], dict[str, float]]:
    """A side's sample: a child's wall time from spawn to exit ("wall") and, for a check, the
    time the check itself reports ("check": opening and verifying, the plugin, judging)."""

    def measure() -> dict[str, float]:
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{command[3:]} failed ({done.returncode}):\n{done.stdout[-2000:]}")
        if "--json" not in command:
            return {"wall": wall}
        return {"wall": wall, "check": json.loads(done.stdout)["seconds"]}

    return measure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="pjrt-pool-preflight-"))
    try:
        cache = root / "cache"
        os.environ["PJRT_POOL_CACHE_DIR"] = str(cache)
        examples = _warm(
            cache, list(example_programs()), root / "examples.json", root / "examples.bundle"
        )
        x = [jax.ShapeDtypeStruct((16,), jnp.float32)]
        many = [(f"sine_{i}", _sine(1.0 + i / 64), x) for i in range(args.extra)]
        extra = _warm(cache, many, root / "many.json", root / "many.bundle") if many else 0
        home = root / "home"
        home.mkdir()
        unset = ("PJRT_POOL_CACHE_DIR", "PYTHONDONTWRITEBYTECODE")
        base = {k: v for k, v in os.environ.items() if k not in unset}
        with_cache = {**base, "PJRT_POOL_CACHE_DIR": str(cache)}
        no_cache = {**base, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
        python = sys.executable
        check = [python, "-c", CHECK, "bundle", "check", "--json"]
        kinds = {
            "python -c 'import numpy'": ([python, "-c", "import numpy"], base),
            f"bundle, {examples} examples": ([*check, str(root / "examples.bundle")], with_cache),
            f"manifest, {examples} examples": ([*check, str(root / "examples.json")], with_cache),
        }
        if extra:
            many_bundle = [*check, str(root / "many.bundle")]
            kinds[f"bundle, {extra} programs"] = (many_bundle, with_cache)
            kinds[f"bundle, {extra}, no cache dir"] = (many_bundle, no_cache)
        sides = [Side(kind, fresh_process(*how), measures=True) for kind, how in kinds.items()]
        samples = compare(sides, args.rounds)  # the warm-up round byte-compiles, pages in
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"pjrt-pool bundle check; python {sys.version.split()[0]}, jax {jax.__version__}")
    report(samples, "the whole process, spawn to exit")
    checks = samples.sides[1:]
    report(samples, "the check itself", figure="check", sides=checks, baseline=checks[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
