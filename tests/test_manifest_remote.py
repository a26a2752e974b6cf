"""A manifest with a remote cache tier behind its cache: run, checked, and a Pool told "none".

Host A compiles into its cache and publishes to the remote (moto's S3 server
or a file:// directory); host B, with an empty cache, runs the manifest's
program fetched from the remote (load_manifest(remote=), pjrt-pool run
--remote), checks it (pjrt-pool bundle check --remote: "loads", or for
another environment the key parts that differ) and a Pool(remote=False)
asks no remote even with PJRT_POOL_CACHE_REMOTE set.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cache_helpers import lowered
from conftest import pjrt_pool
from remote_helpers import Remote, closed_port

from pool.manifest import Manifest, load_manifest
from worker import compile_program
from worker.errors import NotInCacheError
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


def test_a_manifest_program_runs_from_the_remote_on_a_host_with_an_empty_cache(
    tmp_path, remote, monkeypatch, capsys
):
    from pool.cli.main import main

    manifest = published(tmp_path, remote, monkeypatch)
    key = load_manifest(manifest).spec("p").key
    with pytest.raises(NotInCacheError):
        load_manifest(manifest).run("p", [X])  # no remote: not in host B's cache
    loaded = load_manifest(manifest, remote=remote.url)
    assert loaded.remote == remote.url
    [out] = loaded.run("p", [X])
    np.testing.assert_allclose(out, expected(), rtol=1e-6)
    assert entries(tmp_path / "b") == [key]  # published into the cache: next time local

    # The command line, into another empty cache; the URL from --remote, then the variable.
    for cache, options, env in (
        ("c", ["--remote", remote.url], None),
        ("d", [], remote.url),
    ):
        if env is not None:
            monkeypatch.setenv("PJRT_POOL_CACHE_REMOTE", env)
        code = main(["run", str(manifest), "p", "--cache-dir", str(tmp_path / cache), *options])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "p: loaded from the cache" in out
        assert entries(tmp_path / cache) == [key]

    # remote=False: none, whatever PJRT_POOL_CACHE_REMOTE says.
    with pytest.raises(NotInCacheError, match="no executable with key"):
        load_manifest(manifest, str(tmp_path / "e"), remote=False).run("p", [X])
    with pytest.raises(ValueError, match="scheme 'ftp'"):
        load_manifest(manifest, remote="ftp://host/x")


def test_bundle_check_of_a_manifest_asks_the_remote(tmp_path, remote, monkeypatch, capsys):
    from pool.cli.main import main

    manifest = published(tmp_path, remote, monkeypatch)
    check = ["bundle", "check", str(manifest)]
    assert main(check) == 1
    assert "p: would miss (not in the cache" in capsys.readouterr().out
    assert main([*check, "--remote", remote.url]) == 0
    out = capsys.readouterr().out
    assert f"p: loads (from the remote {remote.url})" in out
    assert "1 of 1 program would load here" in out
    monkeypatch.setenv("PJRT_POOL_CACHE_REMOTE", remote.url)  # the default
    assert main(check) == 0
    assert not (tmp_path / "b").exists()  # a check writes nothing
    dead = f"http://127.0.0.1:{closed_port()}/cache"
    assert main([*check, "--remote", dead]) == 1
    assert f"nor in the remote {dead} (the remote could not be read" in capsys.readouterr().out

    # Another environment: the remote's entry is named with the key part that differs.
    elsewhere = pjrt_pool(*check, "--json", env={**remote.env, "PJRT_NPROC": "3"})
    assert elsewhere.returncode == 1, elsewhere.stderr
    [program] = json.loads(elsewhere.stdout)["programs"]
    assert program["status"] == "would miss"
    assert program["reason"] == "its entry was built elsewhere"
    assert [other["differences"] for other in program["elsewhere"]] == [[NPROC_DIFFERS]]


def test_bundle_check_names_the_remotes_other_builds(tmp_path, remote, monkeypatch):
    """The remote holds the program built for PJRT_NPROC=3 too: a check there says the remote
    holds it built here; one with PJRT_NPROC=4 names both builds and how each differs."""
    from pool import Pool

    manifest = published(tmp_path, remote, monkeypatch)
    with monkeypatch.context() as patch:
        patch.setenv("PJRT_NPROC", "3")
        with Pool(1, cache_dir=tmp_path / "nproc3", remote=remote.url) as pool:
            other = pool.compile(lowered(VARIANT)).key
    check = ["bundle", "check", str(manifest), "--remote", remote.url, "--json"]
    done = pjrt_pool(*check, env={**remote.env, "PJRT_NPROC": "3"})
    assert done.returncode == 1, done.stderr
    [program] = json.loads(done.stdout)["programs"]
    assert program["key"] == other
    assert f"the remote {remote.url} holds it built here as {other}" in program["reason"]
    done = pjrt_pool(*check, env={**remote.env, "PJRT_NPROC": "4"})
    [program] = json.loads(done.stdout)["programs"]
    differences = {item["key"]: item["differences"] for item in program["elsewhere"]}
    assert differences == {
        load_manifest(manifest).spec("p").key: [
            "environment.PJRT_NPROC: built with None, here '4'"
        ],
        other: ["environment.PJRT_NPROC: built with '3', here '4'"],
    }


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
