"""Workers ask for huge pages for the plugin's large buffers, unless the user said otherwise.

A CPU plugin mallocs each output; a block over 32 MiB is a fresh mapping on
every run, and its 4 KiB page faults were most of a 64 MiB output's cost
(benchmarks/bench_pool.py --parts c). pool.spawn.with_huge_pages turns on glibc's
glibc.malloc.hugetlb tunable in every worker's environment.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pool import Pool, lower
from pool.spawn import with_huge_pages

SIDE = 4096  # a float32 SIDE x SIDE output is 64 MiB


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


def _huge_page_faults() -> int:
    """Faults the kernel tried to serve with a transparent huge page (granted or not)."""
    counters = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    return int(counters.get("thp_fault_alloc", 0)) + int(counters.get("thp_fault_fallback", 0))


def test_the_tunable_is_added_to_what_the_user_set_and_never_overrides_it():
    assert with_huge_pages({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == (
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    )
    own = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0", "OTHER": "x"}
    assert with_huge_pages(own) == own


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "missing"
    return text.split("[", 1)[1].split("]", 1)[0]


@pytest.mark.slow
@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages")
def test_a_workers_large_outputs_use_huge_pages_and_stay_right(monkeypatch):
    program = lower(
        lambda v: jnp.broadcast_to(v, (SIDE, SIDE)) * 2.0,
        [jax.ShapeDtypeStruct((SIDE,), jnp.float32)],
    )
    x = np.arange(SIDE, dtype=np.float32)
    with Pool(1) as pool:
        (pid,) = (info["pid"] for info in pool.worker_info)
        assert "glibc.malloc.hugetlb=1" in _environ(pid)["GLIBC_TUNABLES"]
        pool.run(program, [x])  # the load, and a first run
        before = _huge_page_faults()
        for _ in range(3):
            (out,) = pool.run(program, [x])
            np.testing.assert_array_equal(out[7], x * 2.0)
            del out
        # Each run's 64 MiB buffer is 32 huge pages; under "always" this process's own
        # arrays may add some, never take any away.
        assert _huge_page_faults() - before >= 3 * 16


def test_a_user_who_turned_the_tunable_off_keeps_it_off(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    program = lower(lambda v: v * 2.0, [jax.ShapeDtypeStruct((4,), jnp.float32)])
    with Pool(1) as pool:
        (pid,) = (info["pid"] for info in pool.worker_info)
        assert _environ(pid)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
        assert pool.run(program, [np.ones(4, np.float32)])[0].tolist() == [2.0] * 4
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
