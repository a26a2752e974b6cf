"""Measure a worker's peak memory for one large output, against the output's size.

Usage::

    python scripts/output_memory.py [--mib N] [--plugin PATH]

A program that returns an N MiB float32 array (default 256) from a scalar
runs once in a Pool(1) (compiled and run once before, at 1 MiB, so that the
compiler's own memory is in the baseline). The worker's peak resident set
(VmHWM in /proc/PID/status, which counts the shared memory it touched as well
as its private memory) is read before and after, and the growth is printed
as a multiple of the output's size, with what the worker had mapped of the
output segment.

Why it is 2: XLA:CPU writes the output into a buffer of its own, and the
worker copies it into the shared-memory segment the parent maps (worker/
server.py, Executable.run_into), holding both for a while. PJRT's C API has
no way to have Execute write into memory the caller provides. The one route
it offers, donating an input made with PJRT_Client_CreateViewOfDeviceBuffer
over that memory to a program whose output aliases it, does not reach it on
either CPU plugin (PJRT API 0.81 and 0.115): Execute consumes the donated
view and writes the output into a fresh buffer, while a donated buffer the
plugin allocated is reused, so the aliasing itself works (measured by
scripts/view_donation.py). It would also need every program to carry an
aliased parameter per output.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

_SCRATCH = tempfile.mkdtemp(prefix="output-memory-")
os.environ["PJRT_POOL_CACHE_DIR"] = str(Path(_SCRATCH) / "cache")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pool import Pool, lower  # noqa: E402


def peak_rss(pid: int) -> int:
    """A process's peak resident set size (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def filled(mib: int):
    """A program returning `mib` MiB of float32, each element the scalar input."""
    n = mib << 18
    return lower(lambda s: jnp.full((n,), s, jnp.float32), [jax.ShapeDtypeStruct((), jnp.float32)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="output size in MiB (default 256)")
    parser.add_argument("--plugin", help="PJRT plugin library (default: the platform's default)")
    args = parser.parse_args(argv)
    atexit.register(shutil.rmtree, _SCRATCH, ignore_errors=True)
    if args.plugin:
        os.environ["PJRT_POOL_PLUGIN_CPU"] = args.plugin
    small, large = filled(1), filled(args.mib)
    with Pool(1) as pool:
        pid = pool.worker_info[0]["pid"]
        pool.run(small, [np.float32(1)])
        pool.compile(large)  # the compiler's peak goes into the baseline
        pool.run(small, [np.float32(1)])
        before = peak_rss(pid)
        (out,) = pool.run(large, [np.float32(3)])
        after = peak_rss(pid)
        assert float(out[-1]) == 3.0 and out.nbytes == args.mib << 20
        plugin = pool.worker_info[0]["plugin"]
    growth = after - before
    print(f"plugin: {plugin.get('path')} (PJRT API {plugin.get('api_version', '?')})")
    print(f"output: {args.mib} MiB; worker peak RSS {before >> 20} MiB before, {after >> 20} after")
    print(f"peak growth: {growth >> 20} MiB = {growth / (args.mib << 20):.2f}x the output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
