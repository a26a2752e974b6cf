"""RayClusterPool on a real local Ray cluster: a head and two worker nodes, each a `ray start`.

The module's cluster (LocalRayCluster: separate processes on loopback,
started in bounded time, stopped after, nothing of it left running) has two
nodes of one CPU each; the second also declares {"TPU": 1}, which stands for
a TPU host. Each test makes its own RayClusterPool on it. The faults come
last: an actor killed mid-compile_many, then a node killed (the module's
cluster has one node left after it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from conftest import CLI_COMMAND, repo_environment  # noqa: E402
from pool_helpers import handler_initializer, milliseconds, scale_program, sleep_program  # noqa: E402

from pool import (  # noqa: E402
    PoolClosedError,
    WorkerCrashedError,
    lower,
)
from pool.cluster import LocalRayCluster, RayClusterPool, connect_ray  # noqa: E402
from pool.cluster.ray.nodes import Role  # noqa: E402
from pool.executor.programs import program_id  # noqa: E402
from pool.manifest import Manifest, load_manifest  # noqa: E402
from worker.bundle.writer import create_bundle  # noqa: E402
from worker.cache import DiskCache  # noqa: E402

pytestmark = pytest.mark.slow

X = np.linspace(-2, 2, 8, dtype=np.float32)


@pytest.fixture(scope="module")
def cluster():
    with (
        LocalRayCluster([{"cpus": 1}, {"cpus": 1, "resources": {"TPU": 1}}]) as local,
        connect_ray(local.address),
    ):
        yield local
    sessions = set(local.sessions())
    assert not [pid for pid in _pids() if _session(pid) in sessions]  # nothing of it left


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _pool(tmp_path: Path, **options) -> RayClusterPool:
    return RayClusterPool(workers_per_node=1, cache_dir=str(tmp_path / "cache"), **options)


def _node_statistics(pool: RayClusterPool) -> list[dict]:
    return pool._node_answers("statistics")


def test_results_are_jax_jit_s_through_run_submit_map_function_and_object_refs(
    cluster, tmp_path: Path
) -> None:
    rng = np.random.default_rng(0)
    n = np.arange(8, dtype=np.int32)
    cases = [
        (lambda x: x * 3.0 + 1.0, [f32(8)], [X]),
        (
            lambda x, n: (jnp.sum(x * n), jnp.cumsum(n), x.astype(jnp.int8)),
            [f32(8), jax.ShapeDtypeStruct((8,), jnp.int32)],
            [X, n],
        ),
        (lambda x: jnp.broadcast_to(x, (1024, 1024)) * 2.0, [f32(1024)], [X.repeat(128)]),
        (lambda x: jnp.tanh(x) * jnp.exp(-x), [f32(64)], [rng.standard_normal(64, np.float32)]),
    ]
    with _pool(tmp_path) as pool:
        assert sorted(pool.nodes().values()) == [Role.RUN.value] * 2  # the head hosts none
        for function, shapes, inputs in cases:
            program = lower(function, shapes)
            want = [np.asarray(w) for w in jax.tree_util.tree_leaves(jax.jit(function)(*inputs))]
            for got in (
                pool.run(program, inputs),
                pool.submit(program, inputs).result(timeout=120),
                *pool.map(program, [inputs] * 3, max_in_flight=2),
                pool.run(program, [ray.put(a) for a in inputs]),  # data already on the cluster
            ):
                assert [(g.dtype, g.shape) for g in got] == [(w.dtype, w.shape) for w in want]
                for g, w in zip(got, want, strict=True):
                    np.testing.assert_array_equal(g, w)  # bit for bit: the same CPU plugin
        double = lower(lambda x: x * 2.0, [f32(8)])
        first = pool.submit(double, [np.ones(8, np.float32)])
        second = pool.submit(double, first.object_ref)  # a run's ObjectRef as the next inputs
        np.testing.assert_array_equal(second.result(timeout=120)[0], np.full(8, 4.0, np.float32))
        assert pool.follow(second.object_ref).result(timeout=120)[0][0] == 4.0
        power = pool.function(lambda x, p: x**p + 1.0, static_argnums=1)
        np.testing.assert_array_equal(power(X, 3), np.asarray(jax.jit(lambda x: x**3 + 1.0)(X)))
        with pytest.raises(ValueError, match="shape"):  # refused here, with Pool's errors
            pool.submit(double, [np.ones(3, np.float32)])
        assert pool.finished_runs >= 4 * 6 + 3


def test_each_program_compiles_once_across_the_nodes(cluster, tmp_path: Path) -> None:
    programs = [scale_program(float(i)) for i in range(10)]
    with _pool(tmp_path) as pool:
        homes = {pool._route(p) for p in programs}
        assert len(homes) == 2  # both nodes take part
        specs = pool.compile_many(programs)
        again = pool.compile_many(programs)  # each to the node that compiled it
        assert [s.key for s in again] == [s.key for s in specs]
        assert pool.statistics.compiled == 10
        compiled = [figures.get("compiled", 0) for figures in _node_statistics(pool)]
        assert sum(compiled) == 10 and all(compiled)  # none twice, on both nodes
        for program in programs:  # runs go where the program is loaded: nothing loads again
            pool.run(program, [X])
        assert sum(f.get("compiled", 0) + f.get("loaded", 0) for f in _node_statistics(pool)) <= 10


def test_a_plugin_crash_fails_its_run_and_the_actor_serves_on(cluster, tmp_path: Path) -> None:
    program = scale_program(2.0)
    with _pool(tmp_path) as pool:
        pool.run(program, [X])
        actors = {node.node_id: node.facts.pid for node in pool._nodes.all()}
        with pytest.raises(WorkerCrashedError, match="SIGABRT"):
            pool.run(program, [X], compile_options=b"")  # aborts the CPU plugin
        np.testing.assert_array_equal(pool.run(program, [X])[0], X * 2.0 + 1.0)
        # The crash killed a PJRT worker, never an actor.
        assert {node.node_id: node.facts.pid for node in pool._nodes.all()} == actors
        assert all(_alive(pid) for pid in actors.values())


def test_kept_values_stay_in_their_node_s_actor(cluster, tmp_path: Path) -> None:
    def step(params, x):
        return params * 0.5 + x, jnp.sum(params)

    jitted = jax.jit(step)
    with _pool(tmp_path) as pool:
        train = pool.function(step, keep=0)
        params, want = X, X
        for _ in range(4):
            params, total = train(params, X)
            want, want_total = jitted(want, X)
            assert float(total) == float(want_total)
        np.testing.assert_array_equal(np.asarray(params), np.asarray(want))
        np.testing.assert_array_equal(params.fetch(), np.asarray(want))
        assert type(params).__name__ == "DeviceValue" and params.shape == (8,)
        holder = pool._node_holding(params._memory)
        assert pool.router.holders(program_id(train.lower(params, X)))[-1] == holder
        other = RayClusterPool(workers_per_node=1)  # another pool's value is refused
        try:
            with pytest.raises(ValueError, match="another pool"):
                other.function(step, keep=0)(params, X)
        finally:
            other.close()


@pytest.mark.skipif(
    not __import__("importlib").util.find_spec("libtpu"), reason="needs libtpu (the tpu extra)"
)
def test_a_tpu_host_holds_its_chips_and_cpu_nodes_compile_for_it(cluster, tmp_path) -> None:
    from pool import Pool
    from worker.errors import DeviceUnavailableError

    programs = [lower(lambda x, i=i: x * i + 1, [f32(8)], platform="tpu") for i in range(3)]
    assert ray.available_resources().get("TPU") == 1
    with _pool(tmp_path, platform="tpu", topology="v5e:1x1") as pool:
        roles = pool.nodes()
        assert sorted(roles.values()) == sorted([Role.COMPILE.value, Role.TPU_HOST.value])
        assert ray.available_resources().get("TPU", 0) == 0  # the host's actor holds its chip
        specs = pool.compile_many(programs)
        (host,) = [n for n, role in roles.items() if role == Role.TPU_HOST.value]
        by_node = {n.node_id: n for n in pool._nodes.all()}
        assert ray.get(by_node[host].actor.answer.remote("statistics")) == {}  # compiled none
        assert pool.statistics.compiled == 3
        # A run goes to the TPU host, whose Pool holds the chip: here there is none.
        with pytest.raises(DeviceUnavailableError, match="no TPU is attached"):
            pool.run(programs[0], [X])
        assert pool.router.holders(program_id(programs[0])) == [host]
    deadline = time.monotonic() + 30
    while ray.available_resources().get("TPU", 0) != 1:  # given back with the actor
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # The keys a TPU host's own compile workers compute for the same topology.
    with Pool(1, platform="tpu", topology="v5e:1x1", cache_dir=str(tmp_path / "local")) as local:
        assert [s.key for s in local.compile_many(programs)] == [s.key for s in specs]


def test_a_manifest_and_a_bundle_run_through_the_cluster(cluster, tmp_path: Path) -> None:
    program = lower(lambda x: x - 5.0, [f32(8)])
    with _pool(tmp_path) as pool:
        (spec,) = pool.compile_many([("minus_five", program)])
        manifest = Manifest([spec], str(tmp_path / "cache"))
        np.testing.assert_array_equal(manifest.run("minus_five", [X], pool=pool)[0], X - 5.0)
        # From a bundle, which each node opens at its path (the nodes share this filesystem).
        bundle = tmp_path / "app.bundle"
        create_bundle(bundle, [(spec, DiskCache(tmp_path / "cache", create=False), "")])
        from_bundle = load_manifest(bundle)
        np.testing.assert_array_equal(from_bundle.run("minus_five", [X], pool=pool)[0], X - 5.0)


def test_each_node_s_pool_starts_as_the_pool_is_made(cluster, tmp_path: Path) -> None:
    # Before any call: each actor starts its Pool as it is made, so that the PJRT workers
    # start while the client lowers and sends (they used to start with the first call).
    with _pool(tmp_path) as pool:
        deadline = time.monotonic() + 120
        while not all(pool._node_answers("worker_info")):
            assert time.monotonic() < deadline, "a node's Pool did not start before a call"
            time.sleep(0.1)
        assert len(pool.nodes()) == 2 and pool.finished_runs == 0


def test_close_leaves_no_actor_and_no_pjrt_worker(cluster, tmp_path: Path) -> None:
    pool = _pool(tmp_path)
    pool.run(scale_program(5.0), [X])
    actors = [node.facts.pid for node in pool._nodes.all()]
    workers = [w["pid"] for answer in pool._node_answers("worker_info") for w in answer]
    assert workers and all(map(_alive, [*actors, *workers]))
    pool.close()
    pool.close()  # again: nothing
    with pytest.raises(PoolClosedError):
        pool.run(scale_program(5.0), [X])
    deadline = time.monotonic() + 30
    while any(map(_alive, [*actors, *workers])):
        assert time.monotonic() < deadline, "an actor or a PJRT worker outlived close()"
        time.sleep(0.2)


def test_warm_and_run_on_the_cluster_from_the_command_line(cluster, tmp_path: Path) -> None:
    spec, cache, manifest = tmp_path / "spec.py", tmp_path / "cache", tmp_path / "m.json"
    spec.write_text(
        "import jax, jax.numpy as jnp\n"
        "def programs():\n"
        "    s = [jax.ShapeDtypeStruct((8,), jnp.float32)]\n"
        "    return [(f'p{i}', (lambda i: lambda x: x * i + 1)(i), s) for i in range(6)]\n"
    )
    where = ["--ray", cluster.address, "--workers", "1", "--cache-dir", str(cache)]
    done = _cli("warm", str(spec), *where, "--json", "--manifest", str(manifest))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["counts"] == {"compiled": 6}
    inputs = tmp_path / "x.npy"
    np.save(inputs, X)
    done = _cli(
        "run", str(manifest), "p3", "--ray", cluster.address, "--batch", str(inputs), "--json"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["counts"] == {"ran": 1, "failed": 0} and report["ray"] == cluster.address
    assert report["runs"][0]["outputs"][0]["sum"] == pytest.approx(float((X * 3 + 1).sum()))


def _cli(*words: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI_COMMAND, *words],
        capture_output=True,
        text=True,
        timeout=600,
        env=repo_environment(empty_unsets=False),
        check=False,
    )


def _medium_program(seed: int):
    # Twenty unrolled matmuls: a second or two to compile, long enough to kill an actor mid-way.
    def body(x):
        return jax.lax.fori_loop(0, 20, lambda i, v: jnp.tanh(v @ v) + seed, x, unroll=True)

    return lower(body, [f32(16, 16)])


def test_an_actor_killed_mid_compile_many_is_retried_and_reported_once(
    cluster, tmp_path: Path
) -> None:
    programs = [(f"m{i}", _medium_program(i)) for i in range(8)]
    with _pool(tmp_path) as pool:
        done: list = []
        compiling = threading.Thread(target=lambda: done.append(pool.compile_many(programs)))
        compiling.start()
        deadline = time.monotonic() + 120
        victim = None
        while victim is None:  # a node whose Pool is compiling
            assert time.monotonic() < deadline
            for node in pool._nodes.all():
                info = ray.get(node.actor.answer.remote("worker_info"))
                if any(w.get("task") for w in info):
                    victim = node
                    break
            time.sleep(0.05)
        os.kill(victim.facts.pid, signal.SIGKILL)
        compiling.join(timeout=300)
        assert not compiling.is_alive()
        (specs,) = done
        assert [s.name for s in specs] == [name for name, _ in programs]  # each reported once
        assert len({s.key for s in specs}) == 8
        statistics = pool.statistics
        assert statistics.compiled + statistics.loaded == 8
        assert victim.node_id not in pool.nodes()  # dropped: no new actor there for a while


def test_a_lost_node_s_runs_finish_elsewhere_and_its_kept_values_say_they_are_lost(
    cluster, handlers: str, tmp_path: Path
) -> None:
    program = sleep_program(1)
    options = {"initializer": handler_initializer(handlers), "spread_at": 1}
    with _pool(tmp_path, **options) as pool:
        keep = pool.function(lambda x: (x * 2.0, jnp.sum(x)), keep=0)
        value, _ = keep(X)
        victim = pool._node_holding(value._memory)
        pool.run(program, [milliseconds(1)])
        runs = [pool.submit(program, [milliseconds(1500 + i)]) for i in range(4)]
        holders = pool.router.holders(program_id(program))
        assert sorted(holders) == sorted(pool.nodes())  # spread_at=1: runs on both nodes
        time.sleep(0.5)  # they run
        cluster.kill_node(_index_of(cluster, victim))
        # Each run ends once, with its outputs: those on the lost node ran again on the other.
        assert [float(r.result(timeout=180)[0][0]) for r in runs] == [1500.0 + i for i in range(4)]
        assert victim not in pool.nodes()
        with pytest.raises(WorkerCrashedError, match="1 value"):
            np.asarray(value)
        with pytest.raises(WorkerCrashedError, match="1 value"):
            keep(value)
        np.testing.assert_array_equal(np.asarray(keep(X)[0]), X * 2.0)  # on the node left


def _index_of(cluster: LocalRayCluster, node_id: str) -> int:
    """The index (add_node's) of the worker node with this Ray node id."""
    nodes = sorted(
        (n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")),
        key=lambda n: n["NodeManagerPort"],
    )
    (found,) = [n for n in nodes if n["NodeID"] == node_id]
    return int(found["Resources"].get("TPU", 0))  # node 1 is the one that declares a TPU
