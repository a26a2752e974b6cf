"""Compiling on a real Dask LocalCluster with two worker processes on loopback."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

distributed = pytest.importorskip("distributed")

from conftest import CLI_COMMAND, repo_environment  # noqa: E402
from pool_helpers import scale_program  # noqa: E402

from pool import Pool  # noqa: E402
from pool.cluster import ClusterPool, local_client  # noqa: E402
from pool.warm.report import Outcome  # noqa: E402
from pool.warm.spec_file import load_spec  # noqa: E402
from pool.warm.warming import warm  # noqa: E402
from worker.cache import DiskCache  # noqa: E402

SPEC = str(Path(__file__).resolve().parent / "specs" / "warm_spec.py")


@pytest.fixture(scope="module")
def cluster():
    with local_client(2, threads_per_worker=2) as client:
        yield client


def _good_and_crash(spec_programs):
    """The spec's 20 good programs and its crashing one (the others take minutes or fail
    before compiling, which the local warm tests cover)."""
    return [p for p in spec_programs if p.name.startswith("good_") or p.name == "crash"]


@pytest.mark.slow
def test_warm_across_two_nodes_into_a_shared_cache(cluster, tmp_path: Path) -> None:
    programs = _good_and_crash(load_spec(SPEC).programs)
    addresses_before = sorted(cluster.nthreads())
    first = warm(programs, scheduler=cluster.scheduler.address, workers=1, cache_dir=tmp_path)
    outcomes = {p.name: p.outcome for p in first.programs}
    assert outcomes.pop("crash") is Outcome.WORKER_CRASH
    assert set(outcomes.values()) == {Outcome.COMPILED} and len(outcomes) == 20
    # Each program compiled exactly once, across both nodes.
    assert first.statistics.compiled == 20 and first.statistics.loaded == 0
    assert len(DiskCache(tmp_path).list_entries()) == 20
    crash = next(p for p in first.programs if p.name == "crash")
    assert "SIGABRT" in (crash.error or "")
    # The plugin crash killed a PJRT worker, not a Dask worker.
    assert sorted(cluster.nthreads()) == addresses_before

    second = warm(programs, scheduler=cluster.scheduler.address, workers=1, cache_dir=tmp_path)
    assert second.statistics.compiled == 0 and second.statistics.loaded == 20
    assert {p.outcome for p in second.programs if p.name != "crash"} == {Outcome.LOADED}


@pytest.mark.slow
def test_both_nodes_take_part_and_routing_is_stable(cluster, tmp_path: Path) -> None:
    programs = [scale_program(float(i)) for i in range(12)]
    with ClusterPool(cluster, workers_per_node=1, cache_dir=str(tmp_path)) as remote:
        routes = [remote._route(p) for p in programs]
        assert len(set(routes)) == 2  # 12 programs spread over both nodes
        assert routes == [remote._route(p) for p in programs]  # same node every time
        specs = remote.compile_many(programs)
        assert remote.statistics.compiled == 12
        # Again: each program goes back to the node whose Pool still holds it, and
        # nothing compiles twice. Dask may still run a task on the other node
        # (allow_other_workers, so that a busy or lost node never stalls it),
        # which then loads it from the shared cache: a rare load, never most.
        assert [s.key for s in specs] == [s.key for s in remote.compile_many(programs)]
        assert remote.statistics.compiled == 12 and remote.statistics.loaded <= 2
    # The same keys as a local pool computes: one cache serves both.
    with Pool(workers=1, cache_dir=tmp_path) as local:
        assert [s.key for s in local.compile_many(programs)] == [s.key for s in specs]
        assert local.statistics.compiled == 0


def test_routing_never_sees_an_empty_cluster_while_the_client_refreshes(cluster) -> None:
    # The Client refreshes its cached scheduler identity in the background with
    # one that lists no workers; routing read that cache and, now and then,
    # failed a compile with "the Dask cluster has no workers" (seen in CI).
    import dask

    programs = [scale_program(float(i)) for i in range(4)]
    with (
        dask.config.set({"distributed.client.scheduler-info-interval": "1ms"}),
        distributed.Client(cluster.scheduler.address) as client,
    ):
        remote = ClusterPool(client, workers_per_node=1)
        routes = {remote._route(programs[i % 4]) for i in range(400)}
        assert len(routes) == 2


@pytest.mark.slow
def test_warm_command_with_a_local_cluster(tmp_path: Path) -> None:
    spec = tmp_path / "spec.py"
    spec.write_text(
        "import jax, jax.numpy as jnp\n"
        "def programs():\n"
        "    s = [jax.ShapeDtypeStruct((8,), jnp.float32)]\n"
        "    return [(f'p{i}', (lambda i: lambda x: x * i + 1)(i), s) for i in range(6)]\n"
    )
    done = subprocess.run(
        [
            *CLI_COMMAND,
            "warm",
            str(spec),
            "--scheduler",
            "local:2",
            "--workers",
            "1",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=repo_environment(empty_unsets=False),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["counts"] == {"compiled": 6}


def _medium_program(seed: int):
    import jax
    import jax.numpy as jnp

    from pool import lower

    # Twenty unrolled matmuls: a second or two to compile, long enough to kill a node mid-way.
    def body(x):
        return jax.lax.fori_loop(0, 20, lambda i, v: jnp.tanh(v @ v) + seed, x, unroll=True)

    return lower(body, [jax.ShapeDtypeStruct((16, 16), jnp.float32)])


@pytest.mark.slow
def test_a_lost_dask_worker_s_programs_run_elsewhere_and_are_reported_once(tmp_path: Path) -> None:
    import time

    programs = [_medium_program(i) for i in range(8)]
    with local_client(2, threads_per_worker=1) as client:
        remote = ClusterPool(client, workers_per_node=1, cache_dir=str(tmp_path))
        futures = [remote.submit_compile(p, name=f"m{i}") for i, p in enumerate(programs)]
        deadline = time.monotonic() + 120
        while not any(client.processing().values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        victim = next(address for address, keys in client.processing().items() if keys)
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, 9)
        results = [future.result(timeout=300) for future in futures]
        assert [r.spec.name for r in results] == [f"m{i}" for i in range(8)]
        assert len({r.spec.key for r in results}) == 8


def test_runs_stay_on_a_program_s_nodes_until_their_queue_is_long() -> None:
    from pool.cluster.routing import Router, home_of

    nodes = ["tcp://a:1", "tcp://b:1", "tcp://c:1"]
    router = Router(lambda: list(nodes), spread_at=2)
    identity = "f" * 64
    home = home_of(identity, sorted(nodes))
    assert [router.choose(identity) for _ in range(2)] == [home, home]
    spread = router.choose(identity)  # home has 2 in flight, the others none
    assert spread != home and router.holders(identity) == [home, spread]
    assert router.in_flight() == {home: 2, spread: 1}
    for address in (home, home, spread):
        router.done(address)
    # Idle again: the runs go to the nodes holding the program, not to the third.
    assert {router.choose(identity) for _ in range(2)} <= {home, spread}
    assert len(router.holders(identity)) == 2
    with pytest.raises(ValueError, match="spread_at"):
        Router(lambda: nodes, spread_at=0)


@pytest.mark.slow
def test_warm_on_a_cluster_with_a_remote_fills_it_for_another_host(cluster, tmp_path: Path) -> None:
    """warm(scheduler=, remote=): the nodes publish what they compile; another host's
    never-compile Pool then runs the programs from the remote alone."""
    import numpy as np

    from pool import Pool

    url = f"file://{tmp_path / 'remote'}/fleet"
    programs = [p for p in load_spec(SPEC).programs if p.name.startswith("good_")][:3]
    report = warm(
        programs,
        scheduler=cluster.scheduler.address,
        workers=1,
        cache_dir=tmp_path / "nodes",
        remote=url,
    )
    assert report.statistics.compiled == 3, report.summary()
    # The nodes' remote counters are the report's, as a local warm's are.
    assert report.remote is not None and report.remote.published == 3, report.summary()
    assert "3 published" in report.summary()
    records = list((tmp_path / "remote" / "fleet" / "records").glob("*/*.json"))
    assert len(records) == 3
    specs = [p.spec for p in report.programs]
    with Pool(1, cache_dir=str(tmp_path / "other"), remote=url, never_compile=True) as other:
        for spec in specs:
            inputs = [np.zeros(t.shape, t.dtype) for t in spec.input_types]
            other.submit_spec(spec, inputs).result()
        assert other.remote_counters.hits == 3  # nothing was local: each came from the remote
    assert len(list((tmp_path / "other" / "entries").rglob("*.pjx"))) == 3


def test_a_cluster_pool_takes_an_empty_keep_and_refuses_any_other(cluster, tmp_path) -> None:
    with ClusterPool(cluster, workers_per_node=1, cache_dir=str(tmp_path)) as remote:
        for keep in ((), [], False):
            remote.function(lambda x: x * 2, keep=keep)
        with pytest.raises(TypeError, match="takes no keep="):
            remote.function(lambda x: x * 2, keep=[0])
