"""A Pool that starts loaded: Pool(preload=manifest or bundle, prime=True) has every worker
load the programs before the constructor returns, a program missing from the cache is
reported there, and Pool(remote=URL) gives the workers the remote tier."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pool_helpers import children_of
from test_bundle import make_bundle

from pool import Pool, lower
from pool.errors import WorkerStartupError
from pool.manifest import Manifest, load_manifest
from worker.errors import NotInCacheError

F32 = jnp.float32


def _mlp(x, w):
    return (jnp.tanh(x @ w),)


def _affine(x):
    return (x * 3.0 + 1.0,)


def _sum(x, y):
    return (jnp.sum(x * y, axis=0),)


PROGRAMS = {
    "mlp": (_mlp, [jax.ShapeDtypeStruct((8, 16), F32), jax.ShapeDtypeStruct((16, 4), F32)]),
    "affine": (_affine, [jax.ShapeDtypeStruct((32,), F32)]),
    "sum": (_sum, [jax.ShapeDtypeStruct((4, 8), F32), jax.ShapeDtypeStruct((4, 8), F32)]),
}


def _warm(directory: Path) -> tuple[Path, Path]:
    """Compiles PROGRAMS into a cache (as pjrt-pool warm does) and writes their manifest."""
    cache = directory / "warm-cache"
    with Pool(1, cache_dir=cache) as pool:
        specs = pool.compile_many(
            [(name, lower(function, types)) for name, (function, types) in PROGRAMS.items()]
        )
    path = directory / "warm.json"
    Manifest(specs, str(cache), "cpu").write(path)
    return path, cache


def _inputs(name: str, seed: int = 0) -> list[np.ndarray]:
    generator = np.random.default_rng(seed)
    return [generator.standard_normal(t.shape).astype(np.float32) for t in PROGRAMS[name][1]]


def _expected(name: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(out) for out in jax.jit(PROGRAMS[name][0])(*inputs)]


def test_a_preloaded_pool_runs_each_program_without_loading_it(tmp_path):
    manifest, cache = _warm(tmp_path)
    loaded = load_manifest(manifest)
    with Pool(2, cache_dir=cache, preload=manifest, prime=True) as pool:
        # The constructor returned: every worker holds every program already.
        assert [w["loaded"] for w in pool.worker_info] == [len(PROGRAMS)] * 2
        assert pool.preload_statistics.loaded == 2 * len(PROGRAMS)
        assert pool.preload_statistics.compiled == 0
        futures = []
        for name in PROGRAMS:
            for seed in range(4):  # both workers take some of them
                inputs = _inputs(name, seed)
                futures.append((name, inputs, pool.submit_spec(loaded.spec(name), inputs)))
        for name, inputs, future in futures:
            for got, want in zip(future.result(), _expected(name, inputs), strict=True):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # No task loaded (nor compiled) anything: the loads were all at the start.
        assert pool.statistics.loaded == 0 and pool.statistics.compiled == 0
        assert [w["loaded"] for w in pool.worker_info] == [len(PROGRAMS)] * 2


def test_a_preloaded_programs_first_run_goes_hot(tmp_path):
    manifest, cache = _warm(tmp_path)
    loaded = load_manifest(manifest)
    with Pool(1, cache_dir=cache, preload=manifest) as pool:
        assert pool.worker_info[0]["hot_runs"] == 0
        for count, name in enumerate(PROGRAMS, 1):
            inputs = _inputs(name)
            got = pool.submit_spec(loaded.spec(name), inputs).result()
            for out, want in zip(got, _expected(name, inputs), strict=True):
                np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
            # Its very first run went as a HotRun, on the slot the worker gave at Ready.
            assert pool.worker_info[0]["hot_runs"] == count
        assert pool.statistics.loaded == 0


def test_a_lowered_program_that_was_preloaded_is_not_loaded_again(tmp_path):
    manifest, cache = _warm(tmp_path)
    with Pool(1, cache_dir=cache, preload=manifest) as pool:
        for name, (function, types) in PROGRAMS.items():
            program = lower(function, types)
            for seed in range(3):  # the first as a full Run, then hot
                inputs = _inputs(name, seed)
                got = pool.run(program, inputs)
                for out, want in zip(got, _expected(name, inputs), strict=True):
                    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
            assert pool.compile(program, name=name).key == load_manifest(manifest).spec(name).key
        # The preloaded executables ran them: no task loaded or compiled anything.
        assert pool.statistics.loaded == 0 and pool.statistics.compiled == 0
        assert pool.worker_info[0]["hot_runs"] == 2 * len(PROGRAMS)


def test_preload_names_restricts_what_is_loaded(tmp_path):
    manifest, cache = _warm(tmp_path)
    with Pool(1, cache_dir=cache, preload=load_manifest(manifest), preload_names=["sum"]) as pool:
        assert pool.worker_info[0]["loaded"] == 1
        inputs = _inputs("sum")
        (got,) = load_manifest(manifest).run("sum", inputs, pool)
        np.testing.assert_allclose(got, _expected("sum", inputs)[0], rtol=1e-5)
        assert pool.statistics.loaded == 0


def _ghost_manifest(tmp_path: Path, manifest: Path) -> Path:
    """The warm manifest plus a program "ghost" whose key is in no cache."""
    data = json.loads(manifest.read_text())
    ghost = dict(data["programs"][0], name="ghost", key="ab" * 32)
    data["programs"].append(ghost)
    path = tmp_path / "ghost.json"
    path.write_text(json.dumps(data))
    return path


def test_never_compile_reports_a_program_missing_from_the_cache_at_start(tmp_path):
    manifest, cache = _warm(tmp_path)
    ghost = _ghost_manifest(tmp_path, manifest)
    started = time.monotonic()
    with pytest.raises(NotInCacheError, match="ghost") as raised:
        Pool(2, cache_dir=cache, preload=ghost, never_compile=True, start_timeout=60)
    assert time.monotonic() - started < 60
    assert "ab" * 32 in str(raised.value)
    assert children_of(os.getpid()) == []


def _crash_while_loading():
    """An initializer that makes the worker die (SIGKILL) when it loads anything by key."""

    def install() -> None:  # a closure: cloudpickle sends it by value to the workers
        import signal

        import worker.serve.server as server

        def crash(*_: object, **__: object) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        server.load_cached_executable = crash

    return install


def test_a_worker_that_dies_preloading_fails_the_start_and_stops_the_others(tmp_path):
    manifest, cache = _warm(tmp_path)
    started = time.monotonic()
    with pytest.raises(WorkerStartupError, match="while starting"):
        Pool(2, cache_dir=cache, preload=manifest, initializer=_crash_while_loading())
    assert time.monotonic() - started < 60
    assert children_of(os.getpid()) == []


def test_a_bundle_path_preloads_into_the_pools_cache(tmp_path):
    manifest, _ = _warm(tmp_path)
    bundle = make_bundle(manifest, tmp_path / "programs.bundle")
    fresh = tmp_path / "fresh-cache"  # holds nothing: the bundle's entries are imported
    specs = load_manifest(bundle)
    with Pool(1, cache_dir=fresh, preload=bundle, prime=True) as pool:
        assert pool.worker_info[0]["loaded"] == len(PROGRAMS)
        for name in PROGRAMS:
            inputs = _inputs(name)
            got = pool.submit_spec(specs.spec(name), inputs).result()
            for out, want in zip(got, _expected(name, inputs), strict=True):
                np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        assert pool.statistics.loaded == 0


def test_a_bundle_url_preloads_into_the_pools_cache(tmp_path):
    """preload= takes a bundle's URL as load_manifest does (before: a URL was read as a
    manifest's, and its entries never reached the pool's cache)."""
    manifest, _ = _warm(tmp_path)
    (tmp_path / "store").mkdir()
    bundle = make_bundle(manifest, tmp_path / "store" / "programs.bundle")
    url = f"file://{bundle}"
    fresh = tmp_path / "fresh-cache"
    with Pool(1, cache_dir=fresh, preload=url) as pool:
        assert pool.worker_info[0]["loaded"] == len(PROGRAMS)
        specs = load_manifest(url)
        for name in PROGRAMS:
            inputs = _inputs(name)
            got = pool.submit_spec(specs.spec(name), inputs).result()
            for out, want in zip(got, _expected(name, inputs), strict=True):
                np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        assert pool.statistics.loaded == 0 and pool.statistics.compiled == 0


def test_a_remote_of_no_known_scheme_is_refused_at_construction():
    with pytest.raises(ValueError, match="scheme"):
        Pool(1, remote="bogus://x")
    assert children_of(os.getpid()) == []


def test_the_workers_get_the_remote_and_the_parent_keeps_its_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("PJRT_POOL_CACHE_REMOTE", raising=False)
    root = tmp_path / "remote"
    with Pool(1, remote=f"file://{root}") as pool:
        spec = pool.compile(lower(_affine, PROGRAMS["affine"][1]))
    assert "PJRT_POOL_CACHE_REMOTE" not in os.environ
    records = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert f"records/{spec.key}/unsigned.json" in records, records
