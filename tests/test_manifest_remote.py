"""A manifest with a remote cache tier behind its cache: run, checked, and a Pool told "none".

Host A compiles into its cache and publishes to the remote (moto's S3 server
or a file:// directory); host B, with an empty cache, runs the manifest's
program fetched from the remote (load_manifest(remote=), pjrt-pool run
--remote), checks it (pjrt-pool bundle check --remote: "loads", or for
another environment the key parts that differ) and a Pool(remote=False)
asks no remote even with PJRT_POOL_CACHE_REMOTE set.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cache_helpers import lowered
from remote_helpers import Remote

from pool.manifest import Manifest
from worker import compile_program
from worker.records import ProgramSpec

X = np.linspace(-1, 1, 4, dtype=np.float32)
VARIANT = 7
NPROC_DIFFERS = "environment.PJRT_NPROC: built with None, here '3'"


def expected() -> np.ndarray:
    scale = np.float32(VARIANT + 2)
    return np.sin(X) * scale + scale


def published(tmp_path: Path, remote: Remote, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Host A's program, compiled and published to the remote; its manifest names an empty
    cache (host B's). The remote is reachable, but PJRT_POOL_CACHE_REMOTE is unset."""
    for name, value in remote.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("PJRT_POOL_CACHE_REMOTE")
    executable, _ = compile_program(lowered(VARIANT), cache_dir=tmp_path / "a", remote=remote.url)
    manifest = tmp_path / "m.json"
    spec = ProgramSpec.from_executable("p", executable)
    Manifest([spec], str(tmp_path / "b"), "cpu").write(manifest)
    return manifest


def entries(cache: Path) -> list[str]:
    return sorted(path.stem for path in (cache / "entries").glob("*.pjx"))


def test_a_pool_with_remote_false_asks_no_remote(tmp_path, remote, monkeypatch):
    """Its workers get no PJRT_POOL_CACHE_REMOTE: they compile what the remote holds."""
    from pool import Pool

    published(tmp_path, remote, monkeypatch)
    monkeypatch.setenv("PJRT_POOL_CACHE_REMOTE", remote.url)
    with Pool(1, cache_dir=tmp_path / "f", remote=False) as pool:
        spec = pool.compile(lowered(VARIANT))
        assert pool.statistics.compiled == 1
        assert pool.remote_counters.hits == pool.remote_counters.misses == 0
        [out] = pool.submit_spec(spec, [X]).result()
    np.testing.assert_allclose(out, expected(), rtol=1e-6)
    with pytest.raises(TypeError, match=r"None \(the environment's\) or False"):
        Pool(1, remote=True)
