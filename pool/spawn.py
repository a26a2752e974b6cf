"""How the parent starts Python processes that run worker-side modules.

Children are fresh interpreters (never forks of a parent that imported JAX)
and must import the very `worker` package the parent imported, whatever the
current directory holds: the package's parent directory goes first on
PYTHONPATH, and -P keeps the current directory off sys.path.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import worker
from worker.plugin.startup import SPAWNED_AT_ENV


def python_command(module: str, *args: str) -> list[str]:
    """Returns the command line that runs `python -m module args...` in a child."""
    return [sys.executable, "-P", "-m", module, *args]


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"
"""glibc's tunable (2.35 and later; older ones ignore it) that makes malloc ask for
transparent huge pages (madvise MADV_HUGEPAGE) on the memory it maps for large blocks."""


def with_huge_pages(environment: dict[str, str]) -> dict[str, str]:
    """Returns `environment` with malloc's huge pages turned on, unless it says otherwise.

    A PJRT CPU plugin allocates every output and temporary buffer with malloc;
    a block over 32 MiB is always a fresh mapping, whose pages fault in 4 KiB
    at a time on every run: for a 64 MiB output about 20 of the 35 ms the
    plugin takes (benchmarks/bench_pool.py --parts c). With huge pages they
    fault in 2 MiB at a time. Where the system grants none (transparent huge
    pages set to never) nothing changes. A GLIBC_TUNABLES that already names
    the tunable (glibc.malloc.hugetlb=0 turns it off) is left as it is.
    """
    tunables = environment.get("GLIBC_TUNABLES", "")
    if HUGE_PAGES_TUNABLE + "=" in tunables:
        return environment
    entry = f"{HUGE_PAGES_TUNABLE}=1"
    return {**environment, "GLIBC_TUNABLES": f"{tunables}:{entry}" if tunables else entry}


JAX_CPU_DEVICES_ENV = "JAX_NUM_CPU_DEVICES"
"""JAX's variable for its jax_num_cpu_devices setting."""


def jax_cpu_devices_environment() -> dict[str, str]:
    """JAX's jax_num_cpu_devices as its variable, where this process's JAX has it set
    (jax.config.update: a child would not see it otherwise), else nothing.

    A worker on jaxlib's own CPU client makes its client with as many devices
    as JAX's would have (worker.plugin.jaxlib_cpu.client.jax_devices), since
    the count changes a CPU client's results: this gives it this process's.
    JAX is read only where this process imported it already.
    """
    jax = sys.modules.get("jax")
    value = getattr(getattr(jax, "config", None), "jax_num_cpu_devices", None)
    if isinstance(value, int) and value >= 0:
        return {JAX_CPU_DEVICES_ENV: str(value)}
    return {}


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Returns the environment for a child: this one, with the worker package importable, and
    JAX's CPU device count where this process's JAX set it (jax_cpu_devices_environment)."""
    environment = dict(os.environ)
    environment.update(jax_cpu_devices_environment())
    package_root = str(Path(worker.__file__).resolve().parent.parent)
    paths = [package_root, *environment.get("PYTHONPATH", "").split(os.pathsep)]
    environment["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    # Lets a worker time its interpreter's start (worker.phases: spawn_to_main).
    environment[SPAWNED_AT_ENV] = repr(time.time())
    if extra:
        environment.update(extra)
    return environment
