"""The remote cache tier behind a Pool and a ClusterPool: what one host compiled, another runs.

Host A is a Pool with its own cache directory that compiles and publishes;
host B is a Pool (or a ClusterPool on a LocalCluster of processes) with
another, empty cache directory and the same remote, often in never-compile
mode: it must fetch, never compile, and never refuse what the remote holds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cache_helpers import lowered

from pool import Pool
from worker.errors import NeverCompileError

X = np.array([0.5, 1.0, 1.5, 2.0], np.float32)


def expected(variant: int) -> np.ndarray:
    scale = variant + 2.0
    return np.sin(X) * scale + scale


@pytest.fixture
def store(remote, monkeypatch):
    """The remote's store reachable from this process and its children (AWS_ENDPOINT_URL and
    credentials for S3), named to the pools only by remote= (not PJRT_POOL_CACHE_REMOTE)."""
    for name, value in remote.env.items():
        if name != "PJRT_POOL_CACHE_REMOTE":
            monkeypatch.setenv(name, value)
    monkeypatch.delenv("PJRT_POOL_CACHE_REMOTE", raising=False)
    return remote


def publish(tmp_path: Path, remote_url: str, variant: int) -> str:
    """Host A: compiles a program in its own cache and publishes it; returns its key."""
    with Pool(workers=1, cache_dir=str(tmp_path / "cache-a"), remote=remote_url) as host_a:
        return host_a.compile(lowered(variant)).key


@pytest.mark.slow
def test_a_never_compile_pool_runs_what_only_the_remote_holds(tmp_path, store):
    """Before: the parent's never-compile check looked at the local cache only and refused
    at submit a program the workers would have fetched from the remote."""
    publish(tmp_path, store.url, 21)
    with Pool(
        workers=1, cache_dir=str(tmp_path / "cache-b"), remote=store.url, never_compile=True
    ) as host_b:
        (out,) = host_b.run(lowered(21), [X])
        assert host_b.statistics.compiled == 0
    np.testing.assert_allclose(out, expected(21), rtol=1e-6)
    assert any((tmp_path / "cache-b" / "entries").rglob("*.pjx"))  # published locally too


@pytest.mark.slow
def test_a_never_compile_pool_still_refuses_what_the_remote_lacks(tmp_path, store):
    publish(tmp_path, store.url, 22)
    with Pool(
        workers=1, cache_dir=str(tmp_path / "cache-b"), remote=store.url, never_compile=True
    ) as host_b:
        with pytest.raises(NeverCompileError, match="is not in the cache"):
            host_b.run(lowered(23), [X])
        (out,) = host_b.run(lowered(22), [X])  # the pool goes on
    np.testing.assert_allclose(out, expected(22), rtol=1e-6)


@pytest.mark.slow
def test_a_cluster_pool_fetches_from_the_remote_and_never_compiles(tmp_path):
    """A ClusterPool(remote=, never_compile=True) on two Dask worker processes."""
    from pool.cluster import ClusterPool, local_client

    url = f"file://{tmp_path / 'remote'}/fleet"
    publish(tmp_path, url, 24)
    with local_client(2) as client:
        with pytest.raises(ValueError, match="scheme"):
            ClusterPool(client, remote="ftp://nowhere/prefix")
        with ClusterPool(
            client,
            workers_per_node=1,
            cache_dir=str(tmp_path / "cache-b"),
            remote=url,
            never_compile=True,
        ) as cluster:
            outs = [cluster.run(lowered(24), [X])[0] for _ in range(4)]
            assert cluster.statistics.compiled == 0
            with pytest.raises(NeverCompileError):
                cluster.run(lowered(25), [X])
    for out in outs:
        np.testing.assert_allclose(out, expected(24), rtol=1e-6)


@pytest.mark.slow
def test_a_refusal_names_how_the_remotes_builds_differ(tmp_path, store, monkeypatch):
    """Host C (PJRT_NPROC=8, another environment) misses the key host A published: its
    NeverCompileError says the remote holds the program built elsewhere, and how."""
    key_a = publish(tmp_path, store.url, 26)
    assert (
        [n for n in store.names() if n.startswith("programs/")]
        == [n for n in store.names() if n.startswith("programs/") and n.endswith(key_a)]
        != []
    )
    monkeypatch.setenv("PJRT_NPROC", "8")
    with (
        Pool(
            workers=1, cache_dir=str(tmp_path / "cache-c"), remote=store.url, never_compile=True
        ) as host_c,
        pytest.raises(NeverCompileError) as refused,
    ):
        host_c.run(lowered(26), [X])
    message = str(refused.value)
    assert "The remote holds it built elsewhere (1 entry)" in message, message
    assert f"entry {key_a}: environment.PJRT_NPROC: built with None, here '8'" in message, message
    assert key_a in refused.value.differences
