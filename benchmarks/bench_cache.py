"""Benchmark a fresh process loading the example programs from our disk cache vs JAX's.

Usage::

    python benchmarks/bench_cache.py [--repeat N]

The question: once a cache is warm, how long does a *new* process take to get
executables for all of pool.examples' programs, from pjrt-pool's disk cache
compared with JAX's persistent compilation cache? The target is that our
warm load is faster than JAX's.

Method (one run measures both, so the ratio holds on a noisy machine):

1. The parent lowers every program with pool.lower and writes the
   LoweredPrograms (code, text, input types, platform) to a JSON file. Our
   children read that file: lowering is what a parent does once, not part
   of loading, and a pool worker receives programs already lowered.
2. Warm both caches, one child process each, in fresh temporary
   directories: an "ours" child runs compile_program on every program
   (compiling and publishing), a "jax" child runs
   ``jax.jit(fn).lower(*shapes).compile()`` for every program with
   jax_compilation_cache_dir set, jax_persistent_cache_min_compile_time_secs
   0 (the default, 1 s, would skip almost every program) and
   jax_persistent_cache_min_entry_size_bytes -1 (no size restriction and no
   filesystem override; the default 0 permits one).
3. Time --repeat fresh children of each kind (default 5), alternating the
   kinds (benchmarks/harness.py), and take medians. Each child reports, measured inside itself:
   import (``import worker`` for ours, which does not import JAX, just as
   a pool worker does not; ``import jax`` for JAX), read (ours: parsing the
   programs file; JAX: importing and building the example functions), init (loading the
   plugin and creating its client: worker.get_runtime(); JAX:
   jax.devices()), LAPACK (jaxlib's ``_lapack.initialize()``, which imports
   scipy.linalg: both sides need it once per process for the linalg
   programs, JAX while lowering the first one and pjrt-pool while loading
   it, so both children call it before their loop and it is shown on its
   own) and the load loop. The parent also reports the wall time of the
   whole child, interpreter start-up included.

   Our load loop: compile_program(program) for each program, checked to
   be a cache hit (CompileStatistics.loaded). It includes computing the
   cache key, reading and verifying the entry, deserializing, and
   registering the LAPACK handlers with the plugin on the first linalg
   program.

   JAX's load loop: ``jax.jit(fn).lower(*shapes)`` then ``.compile()`` for
   each program, checked to be a persistent-cache hit (JAX's monitoring
   events). JAX cannot compile without lowering in a fresh process, so
   lower+compile is what a JAX user pays; ``.compile()`` alone (cache key,
   read, deserialize) is timed separately as the like-for-like figure. The
   target is judged against that stricter figure, compile only.

4. Signed entries: a third kind of child, "signed", is ours with a signing
   secret (PJRT_POOL_CACHE_SECRET) loading from its own cache, warmed with
   the same secret; its children alternate with the others, and the report
   gives its load loop against the unsigned one (the cost of signing).
5. Load markers (the files that let a later process quarantine an entry
   whose load crashed): each ours child times, after its loop, looking for
   dead loaders' markers and creating and removing its own, once per
   program, exactly as a load does; the report gives that against the loop.

Every directory is a fresh temporary one, removed at exit; the user's default
caches (ours and JAX's) are never touched. Exit status is 0 whether or not
the target is met; the summary says which.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import Side, compare, ratio_line, report

SCRIPT = Path(__file__).resolve()
CHILD_TIMEOUT = 600.0
SECRET = "bench-cache-signing-secret-0123456789abcdef"
"""The signing secret of the "signed" children (a benchmark's, not a real one)."""


# -- children ----------------------------------------------------------------


def initialize_lapack() -> float:
    """Binds jaxlib's LAPACK kernels to SciPy's LAPACK; returns the seconds it took.

    Both kinds of child pay this once per process before their loop (it
    imports scipy.linalg, about 0.3 s here): JAX does it while lowering the
    first linalg program, pjrt-pool while loading or compiling it. Doing it
    up front keeps it out of both loops, where it would land in JAX's
    lowering but in our load.
    """
    start = time.perf_counter()
    try:
        from jaxlib.cpu import _lapack
    except ImportError:  # no CPU LAPACK kernels in this jaxlib: nothing to pay
        return 0.0
    _lapack.initialize()
    return time.perf_counter() - start


def time_load_markers(keys: Sequence[str]) -> float:
    """Seconds the load markers of one load per key take: the dead-loader check, then the
    marker's creation and removal (as worker.compile.entries.load_entry does around deserialize)."""
    from worker.cache import open_cache

    cache = open_cache()
    start = time.perf_counter()
    for key in keys:
        cache.loads.dead(key)
        with cache.loads.loading(key):
            pass
    return time.perf_counter() - start


def _phases(
    start: float, imported: float, read: float, initialized: float, lapack: float, done: float
) -> dict[str, float]:
    """A child's seconds per phase, from the times (time.perf_counter()) each phase ended:
    imports, reading the programs, initializing the plugin (less LAPACK's), the loop."""
    return {
        "import": imported - start,
        "read": read - imported,
        "init": initialized - read - lapack,
        "lapack": lapack,
        "loop": done - initialized,
    }


def child_ours(programs_file: str, expect: str) -> dict[str, Any]:
    """Loads (or, warming, compiles) every program with compile_program; no JAX imported."""
    start = time.perf_counter()
    import worker
    from worker import ArrayType, LoweredProgram, compile_program, get_runtime

    imported = time.perf_counter()
    records = json.loads(Path(programs_file).read_text())
    programs = [
        LoweredProgram(
            code=base64.b64decode(record["code"]),
            text=record["text"],
            input_types=tuple(ArrayType.from_json(t) for t in record["input_types"]),
            platform=record["platform"],
        )
        for record in records
    ]
    read = time.perf_counter()
    get_runtime(programs[0].platform)
    lapack = initialize_lapack()
    initialized = time.perf_counter()
    stats = worker.CompileStatistics()
    keys = []
    for program in programs:
        executable, one = compile_program(program)
        stats = stats.add(one)
        keys.append(executable.key)
    done = time.perf_counter()
    markers = time_load_markers(keys)
    wanted = {"hit": (0, len(programs)), "miss": (len(programs), 0)}[expect]
    if (stats.compiled, stats.loaded) != wanted:
        raise RuntimeError(f"expected every program to {expect} the cache, got: {stats}")
    if "jax" in sys.modules:
        raise RuntimeError("loading imported jax, which a worker never does")
    return {
        **_phases(start, imported, read, initialized, lapack, done),
        "load_seconds": stats.load_seconds,
        "markers": markers,
    }


def child_jax(cache_dir: str, expect: str) -> dict[str, Any]:
    """Lowers and compiles every example with JAX's persistent cache in cache_dir."""
    start = time.perf_counter()
    import jax
    from jax import monitoring

    imported = time.perf_counter()
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    events: dict[str, int] = {}

    def count(event: str, **_: Any) -> None:
        events[event] = events.get(event, 0) + 1

    monitoring.register_event_listener(count)
    from pool.examples import example_programs  # JAX and the programs, no compiler of ours

    programs = example_programs()
    read = time.perf_counter()
    jax.devices()
    lapack = initialize_lapack()
    initialized = time.perf_counter()
    lowering = compiling = 0.0
    for _, function, shapes in programs:
        before = time.perf_counter()
        lowered = jax.jit(function).lower(*shapes)
        middle = time.perf_counter()
        lowered.compile()
        after = time.perf_counter()
        lowering += middle - before
        compiling += after - middle
    done = time.perf_counter()
    hits = events.get("/jax/compilation_cache/cache_hits", 0)
    misses = events.get("/jax/compilation_cache/cache_misses", 0)
    wanted = {"hit": (len(programs), 0), "miss": (0, len(programs))}[expect]
    if (hits, misses) != wanted:
        raise RuntimeError(
            f"expected every program to {expect} JAX's cache, got {hits} hits, {misses} misses"
        )
    return {
        **_phases(start, imported, read, initialized, lapack, done),
        "lower": lowering,
        "compile": compiling,
    }


# -- parent ------------------------------------------------------------------


def write_programs(path: Path) -> int:
    """Lowers every example program and writes the LoweredPrograms as JSON; returns the count."""
    from pool import lower
    from pool.examples import example_programs

    records = []
    for _, function, shapes in example_programs():
        program = lower(function, shapes)
        records.append(
            {
                "code": base64.b64encode(program.code).decode(),
                "text": program.text,
                "input_types": [t.to_json() for t in program.input_types or ()],
                "platform": program.platform,
            }
        )
    path.write_text(json.dumps(records))
    return len(records)


def run_child(kind: str, expect: str, paths: dict[str, Path]) -> dict[str, Any]:
    """Runs one child; returns what it measured plus its whole wall time ("wall")."""
    if kind in ("ours", "signed"):
        argument = str(paths["programs"])
        environment = {**os.environ, "PJRT_POOL_CACHE_DIR": str(paths[kind])}
        environment.pop("PJRT_POOL_CACHE_SECRET", None)
        environment.pop("PJRT_POOL_CACHE_KEY_FILE", None)
        if kind == "signed":
            environment["PJRT_POOL_CACHE_SECRET"] = SECRET
        kind = "ours"
    else:
        argument = str(paths["jax"])
        # Its own pjrt-pool directory too, though this child never imports pjrt-pool.
        environment = {**os.environ, "PJRT_POOL_CACHE_DIR": str(paths["scratch"] / "unused")}
    command = [sys.executable, str(SCRIPT), "--child", kind, "--expect", expect, argument]
    start = time.perf_counter()
    done = subprocess.run(
        command, env=environment, capture_output=True, text=True, timeout=CHILD_TIMEOUT
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(
            f"the {kind} child (expecting cache {expect}es) exited with {done.returncode}:\n"
            f"{done.stderr[-3000:]}"
        )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall"] = wall
    return result


def child(kind: str, paths: dict[str, Path]) -> Side:
    """A side whose sample is a fresh child of `kind` loading every program from its warm
    cache: what the child measured, and its whole wall time."""
    labels = {
        "jax": "JAX's persistent cache",
        "ours": "pjrt-pool",
        "signed": "pjrt-pool, signed entries",
    }
    return Side(labels[kind], lambda: run_child(kind, "hit", paths), measures=True)


def report_loads(samples: Any, count: int) -> None:
    """Prints the medians and ratios: the whole process and its phases against JAX's, then
    the load loop against JAX's .compile() alone (the target: faster), signing's cost and
    the load markers'."""
    jax_, ours, signed = samples.sides
    report(samples, f"fresh processes loading {count} programs from a warm cache", unit="s")
    for figure, what in (
        ("import", "imports (worker / jax)"),
        ("init", "the plugin and client / jax.devices()"),
        ("lapack", "LAPACK kernels: initialize()"),
    ):
        report(samples, what, figure=figure, sides=(jax_, ours))
    compiled = samples.median(jax_, "compile")
    print("the load loop, against JAX's .compile() alone (its lowering apart)")
    ratio_line("JAX .compile() from its cache", compiled, compiled)
    ratio_line("JAX lower + compile", samples.median(jax_, "loop"), compiled)
    loop = samples.median(ours, "loop")
    ratio_line("pjrt-pool compile_program, all hits", loop, compiled, goal=1)
    ratio_line("  of which reading and deserializing", samples.median(ours, "load_seconds"),
               compiled)  # fmt: skip
    ratio_line("pjrt-pool, signed entries", samples.median(signed, "loop"), compiled)
    print("the load markers (one per program), against pjrt-pool's load loop")
    ratio_line("load loop", loop, loop)
    ratio_line("load markers", samples.median(ours, "markers"), loop)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark (or, with --child, one child); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="fresh children per kind")
    parser.add_argument("--child", choices=("ours", "jax"), help=argparse.SUPPRESS)
    parser.add_argument("--expect", choices=("hit", "miss"), help=argparse.SUPPRESS)
    parser.add_argument("location", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        if args.child == "ours":
            result = child_ours(args.location, args.expect)
        else:
            result = child_jax(args.location, args.expect)
        print(json.dumps(result))
        return 0

    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    scratch = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    # The parent lowers, which memoizes the plugin's probe in the default cache directory.
    os.environ["PJRT_POOL_CACHE_DIR"] = str(scratch / "parent")
    paths = {
        "scratch": scratch,
        "programs": scratch / "programs.json",
        "ours": scratch / "ours-cache",
        "signed": scratch / "signed-cache",
        "jax": scratch / "jax-cache",
    }
    try:
        count = write_programs(paths["programs"])
        size = paths["programs"].stat().st_size
        print(f"lowered {count} programs into {paths['programs'].name} ({size / 1024:.0f} KiB)")
        for kind in ("ours", "signed", "jax"):
            warm = run_child(kind, "miss", paths)
            print(f"warmed the {kind} cache in a child: {warm['wall']:.2f} s")
        sides = [child("jax", paths), child("ours", paths), child("signed", paths)]
        report_loads(compare(sides, args.repeat, warmup=0), count)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
