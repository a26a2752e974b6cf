"""A Pool's cache directory is resolved once, when the Pool is made, and reaches every worker
one way (its PJRT_POOL_CACHE_DIR).

A replacement worker started after the working directory or
PJRT_POOL_CACHE_DIR changed compiled into another directory than the pool's
first workers: the relative --cache-dir on its command line, or the
variable it inherited, was resolved again in it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from pool_helpers import scale_program

from pool import Pool


def _replace_the_worker(pool: Pool) -> None:
    """Kills the pool's one worker and waits for its replacement to be idle."""
    (first,) = pool.worker_info
    os.kill(first["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        (now,) = pool.worker_info
        if now["pid"] != first["pid"] and now["state"] == "idle":
            return
        time.sleep(0.05)
    raise AssertionError(f"no replacement worker: {pool.worker_info}")


def _entries(directory: Path) -> int:
    entries = directory / "entries"
    return len(list(entries.iterdir())) if entries.is_dir() else 0


@pytest.mark.parametrize("given", ["relative", "environment"])
def test_replacement_workers_use_the_directory_the_pool_resolved(
    given: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, later = tmp_path / "first", tmp_path / "later"
    first.mkdir()
    later.mkdir()
    monkeypatch.chdir(first)
    monkeypatch.setenv("PJRT_POOL_CACHE_DIR", str(first / "cache"))
    options = {"cache_dir": "cache"} if given == "relative" else {}
    x = np.ones(8, np.float32)
    # Lowered first: lower() keeps what it learns of the plugin in this process's own
    # default cache (pool.lowering.plugin_info), whatever a Pool uses.
    programs = scale_program(2.0), scale_program(3.0)
    with Pool(1, **options) as pool:
        pool.run(programs[0], [x])
        # What the Pool was given now names another directory.
        monkeypatch.chdir(later)
        monkeypatch.setenv("PJRT_POOL_CACHE_DIR", str(later / "cache"))
        _replace_the_worker(pool)
        assert pool.run(programs[1], [x])[0][0] == 4.0
    assert _entries(first / "cache") == 2
    assert not (later / "cache").exists()
