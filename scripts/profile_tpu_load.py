"""Where a TPU entry's load goes: pjrt-pool's load, profiled, against JAX's persistent cache.

Usage (on a TPU host; each command a process of its own, since one process at
a time may hold the chip)::

    JAX_PLATFORMS=cpu python scripts/profile_tpu_load.py fill DIR     # deviceless compiles
    python scripts/profile_tpu_load.py load DIR        # load them on the chip, cProfile
    python scripts/profile_tpu_load.py jax-fill JDIR   # JAX compiles into its own cache
    python scripts/profile_tpu_load.py jax-load JDIR   # JAX served from that cache
    python scripts/profile_tpu_load.py tiny            # Executable.run of x + 1 in-process

The programs are the first six of scripts/train_steps.py. `load` prints each
load's time, the functions that took it (by their own time) and the entries'
sizes; `jax-load` times jax.jit(...).lower(...).compile() served from JAX's
persistent cache, tracing and lowering included (what a JAX user waits for);
`tiny` is the in-process half of the round trip that tpu_check.py's pool and
roundtrip steps compare.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_seconds
from train_steps import train_steps

from pool import compile_program, lower

STEPS = 6


def fill(cache: str) -> None:
    for name, function, shapes in train_steps()[:STEPS]:
        started = time.perf_counter()
        program = lower(function, shapes, platform="tpu")
        compile_program(program, topology="v5e:1x1", cache_dir=cache)
        print(f"compiled {name} in {time.perf_counter() - started:.2f} s", flush=True)


def load(cache: str) -> None:
    programs = [(n, lower(f, s, platform="tpu")) for n, f, s in train_steps()[:STEPS]]
    tiny = lower(lambda x: x + 1, [jax.ShapeDtypeStruct((4,), jnp.float32)], platform="tpu")
    compile_program(tiny, disk_cache=False)  # the chip's opening, untimed
    profile, times = cProfile.Profile(), []
    for name, program in programs:
        started = time.perf_counter()
        profile.enable()
        _, statistics_ = compile_program(program, cache_dir=cache)
        profile.disable()
        times.append(time.perf_counter() - started)
        print(f"{name}: {times[-1] * 1e3:.1f} ms ({statistics_})", flush=True)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
    print(text.getvalue())
    print(f"load median {statistics.median(times) * 1e3:.1f} ms")
    sizes = sorted(p.stat().st_size for p in Path(cache, "entries").rglob("*") if p.is_file())
    print("entry sizes (MB):", [round(size / 1e6, 1) for size in sizes])


def jax_cache(cache: str, label: str) -> None:
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    times = []
    for name, function, shapes in train_steps()[:STEPS]:
        started = time.perf_counter()
        jax.jit(function).lower(*shapes).compile()
        times.append(time.perf_counter() - started)
        print(f"{label} {name}: {times[-1] * 1e3:.1f} ms", flush=True)
    print(f"{label} median {statistics.median(times) * 1e3:.1f} ms")


def tiny_run() -> None:
    tiny = lower(lambda x: x + 1, [jax.ShapeDtypeStruct((4,), jnp.float32)], platform="tpu")
    executable, _ = compile_program(tiny, disk_cache=False)
    x = np.ones(4, np.float32)
    for _ in range(50):
        executable.run([x])
    median = median_seconds(lambda _: executable.run([x]), 300)
    print(f"Executable.run of x + 1, median of 300: {median * 1e3:.3f} ms")


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "tiny":
        tiny_run()
    elif mode in ("fill", "load", "jax-fill", "jax-load") and len(sys.argv) == 3:
        cache = sys.argv[2]
        if mode == "fill":
            fill(cache)
        elif mode == "load":
            load(cache)
        else:
            jax_cache(cache, mode)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
