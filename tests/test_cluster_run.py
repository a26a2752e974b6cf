"""Running programs on a real Dask LocalCluster: two worker processes, one thread each.

The tests share one cluster; each makes its own ClusterPool on it. The
tests that kill a Dask worker come last, and wait for its replacement.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from conftest import CLI_COMMAND  # noqa: E402
from pool_helpers import (  # noqa: E402
    custom_call_program,
    handler_initializer,
    milliseconds,
    sleep_program,
)

from pool import (  # noqa: E402
    ClusterPool,
    NeverCompileError,
    TaskTimeoutError,
    WorkerCrashedError,
    lower,
)
from pool.cluster import NodeLostError, local_client  # noqa: E402
from pool.cluster.dask.node import node_answer, run_task  # noqa: E402
from pool.manifest import Manifest, load_manifest  # noqa: E402
from worker.bundle.writer import create_bundle  # noqa: E402
from worker.cache import DiskCache  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with local_client(2, threads_per_worker=1) as client:
        yield client


@pytest.fixture
def remote(cluster, handlers: str, tmp_path: Path):
    """A ClusterPool of one PJRT worker per node, with the test FFI handlers registered."""
    cluster.wait_for_workers(2, timeout=120)
    with ClusterPool(
        cluster,
        workers_per_node=1,
        cache_dir=str(tmp_path / "cache"),
        initializer=handler_initializer(handlers),
    ) as pool:
        yield pool


def f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _cases():
    """(function, input shapes, inputs): small and large outputs, ints, several outputs."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 16), dtype=np.float32)
    b = rng.standard_normal((16, 16), dtype=np.float32)
    n = np.arange(8, dtype=np.int32)
    x = rng.standard_normal(8, dtype=np.float32)
    return [
        (lambda x: x * 3.0 + 1.0, [f32(8)], [x]),
        (lambda a, b: jnp.tanh(a @ b), [f32(16, 16), f32(16, 16)], [a, b]),
        (
            lambda x, n: (jnp.sum(x * n), jnp.cumsum(n), x.astype(jnp.int8)),
            [f32(8), jax.ShapeDtypeStruct((8,), jnp.int32)],
            [x, n],
        ),
        # 4 MiB: a shared-memory segment on the node, its views handed to Dask.
        (lambda x: jnp.broadcast_to(x, (1024, 1024)) * 2.0, [f32(1024)], [x.repeat(128)]),
    ]


def _assert_equal(got: list[np.ndarray], want) -> None:
    want = [np.asarray(w) for w in jax.tree_util.tree_leaves(want)]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_results_equal_jax_jit_s_through_run_submit_map_and_dask_futures(remote, cluster) -> None:
    for function, shapes, inputs in _cases():
        program = lower(function, shapes)
        want = jax.jit(function)(*inputs)
        _assert_equal(remote.run(program, inputs), want)
        future = remote.submit(program, inputs)
        _assert_equal(future.result(timeout=120), want)
        assert future.dask_future.status == "finished"
        for outputs in remote.map(program, [inputs] * 5, max_in_flight=2):
            _assert_equal(outputs, want)
        # Inputs already on the cluster go to the node as Dask dependencies.
        scattered = cluster.scatter(inputs)
        _assert_equal(remote.run(program, scattered), want)
    # A run's Dask future is the next run's inputs, without a trip through here.
    double = lower(lambda x: x * 2.0, [f32(8)])
    first = remote.submit(double, [np.ones(8, np.float32)])
    second = remote.submit(double, first.dask_future)
    np.testing.assert_array_equal(second.result(timeout=120)[0], np.full(8, 4.0, np.float32))
    assert remote.follow(second.dask_future).result(timeout=120)[0][0] == 4.0
    # Bad inputs are refused here, with Pool's errors, before anything is sent.
    with pytest.raises(ValueError, match="shape"):
        remote.submit(double, [np.ones(3, np.float32)])
    with pytest.raises(TypeError, match=r"takes 1 argument \("):
        remote.submit(double, [])


def test_function_is_called_as_jax_jit_s_result_is(remote) -> None:
    def step(x, power, *, mode="add"):
        return {"y": x**power + 1.0 if mode == "add" else x**power - 1.0, "n": jnp.sum(x)}

    on_cluster = remote.function(step, static_argnums=1, static_argnames="mode")
    jitted = jax.jit(step, static_argnums=1, static_argnames="mode")
    x = np.linspace(0, 1, 8, dtype=np.float32)
    for power, mode in [(2, "add"), (3, "add"), (2, "sub")]:
        got, want = on_cluster(x, power, mode=mode), jitted(x, power, mode=mode)
        assert set(got) == {"y", "n"}
        _assert_equal([got["y"], got["n"]], [want["y"], want["n"]])
    got = on_cluster.submit(x, 2).result(timeout=120)
    _assert_equal([got["y"]], [jitted(x, 2)["y"]])


def test_function_submit_fetches_and_rebuilds_where_the_result_is_read(remote, monkeypatch):
    """Dask settles every future on its one callback thread: a PoolFunction's future fetches
    nothing there (so no result waits for another's fetch), only in the reading thread."""
    fetched_on: list[str] = []
    fetch = distributed.Future.result

    def result(self, *args, **kwargs):
        fetched_on.append(threading.current_thread().name)
        return fetch(self, *args, **kwargs)

    monkeypatch.setattr(distributed.Future, "result", result)
    double = remote.function(lambda x: {"y": x * 2.0})
    x = np.arange(8, dtype=np.float32)
    futures = [double.submit(x + i) for i in range(4)]
    done, _ = concurrent.futures.wait(futures, timeout=120)
    assert len(done) == 4
    time.sleep(0.2)  # Dask's callbacks of these futures have run
    assert fetched_on == []
    for i, future in enumerate(futures):
        np.testing.assert_array_equal(future.result(timeout=60)["y"], (x + i) * 2.0)
    assert set(fetched_on) == {threading.current_thread().name}


def test_map_yields_a_batch_refused_at_submit_in_its_place(remote) -> None:
    double = lower(lambda x: x * 2.0, [f32(4)])
    x = np.ones(4, np.float32)
    batches = [[x], [np.ones(3, np.float32)], [x + 1.0]]
    first, refused, third = remote.map(double, batches, return_exceptions=True)
    np.testing.assert_array_equal(first[0], x * 2.0)
    assert isinstance(refused, ValueError) and "shape" in str(refused)
    np.testing.assert_array_equal(third[0], (x + 1.0) * 2.0)
    # Without return_exceptions it raises in its turn, after the run before it.
    results = remote.map(double, batches)
    np.testing.assert_array_equal(next(results)[0], x * 2.0)
    with pytest.raises(ValueError, match="shape"):
        next(results)


def test_manifest_runs_through_a_cluster_pool(remote, tmp_path: Path) -> None:
    program = lower(lambda x: x - 5.0, [f32(8)])
    (spec,) = remote.compile_many([("minus_five", program)])
    manifest = Manifest([spec], str(tmp_path / "cache"))
    x = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(manifest.run("minus_five", [x], pool=remote)[0], x - 5.0)
    np.testing.assert_array_equal(remote.submit_spec(spec, [x]).result(timeout=120)[0], x - 5.0)
    # From a bundle, which each node opens at its path (the nodes share this filesystem).
    bundle = tmp_path / "app.bundle"
    create_bundle(bundle, [(spec, DiskCache(tmp_path / "cache", create=False), "")])
    from_bundle = load_manifest(bundle)
    np.testing.assert_array_equal(from_bundle.run("minus_five", [x], pool=remote)[0], x - 5.0)


def test_a_crash_fails_only_its_run_and_its_node_keeps_serving(remote, cluster) -> None:
    pids = cluster.run(os.getpid)
    crasher = custom_call_program("null_deref")
    good = lower(lambda x: x + 1.0, [f32(8)])
    x = np.arange(8, dtype=np.float32)
    goods = [remote.submit(good, [x]) for _ in range(6)]
    crash = remote.submit(crasher, [x])
    goods += [remote.submit(good, [x]) for _ in range(6)]
    with pytest.raises(WorkerCrashedError, match="SIGSEGV"):
        crash.result(timeout=120)
    for future in goods:
        np.testing.assert_array_equal(future.result(timeout=120)[0], x + 1.0)
    # Neither Dask worker died, and the node that ran the crash serves on.
    assert cluster.run(os.getpid) == pids
    (node,) = remote.router.holders(_identity(crasher))
    again = cluster.submit(
        run_task,
        remote.plugin_name,
        good,
        [x],
        "after",
        None,
        None,
        workers=[node],
        allow_other_workers=False,
    )
    np.testing.assert_array_equal(again.result(timeout=120)[0], x + 1.0)
    # A run past its timeout fails with the Pool's TaskTimeoutError; the next one runs.
    sleeper = sleep_program(1)
    with pytest.raises(TaskTimeoutError):
        remote.run(sleeper, [milliseconds(5000)], timeout=0.5)
    assert remote.run(sleeper, [milliseconds(1)])[0][0] == 1.0
    assert cluster.run(os.getpid) == pids


def _identity(program) -> str:
    from pool.executor.programs import program_id

    return program_id(program)


def test_never_compile_refuses_before_a_node_works(cluster, tmp_path: Path) -> None:
    cache = str(tmp_path / "warm")
    program = lower(lambda x: x * 7.0, [f32(8)])
    x = np.ones(8, np.float32)
    with ClusterPool(cluster, workers_per_node=1, cache_dir=cache, never_compile=True) as remote:
        with pytest.raises(NeverCompileError, match="must not compile"):
            remote.submit(program, [x])
        # No node's PJRT worker compiled or loaded anything.
        for statistics in cluster.run(node_answer, remote.plugin_name, "statistics").values():
            assert statistics.get("compiled", 0) == 0 and statistics.get("loaded", 0) == 0
        assert remote.cache_counters.misses == 0
    with ClusterPool(cluster, workers_per_node=1, cache_dir=cache) as warming:
        warming.compile_many([program])
    with ClusterPool(cluster, workers_per_node=1, cache_dir=cache, never_compile=True) as remote:
        np.testing.assert_array_equal(remote.run(program, [x])[0], x * 7.0)


def test_a_lost_result_is_computed_again_and_a_read_keeps_to_its_timeout(cluster, remote) -> None:
    program = sleep_program(1)
    remote.run(program, [milliseconds(1)])
    future = remote.submit(program, [milliseconds(3000)])
    concurrent.futures.wait([future], timeout=120)
    assert future.done()  # settled, not fetched
    ((holder,),) = cluster.who_has([future.dask_future]).values()
    os.kill(cluster.run(os.getpid, workers=[holder])[holder], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while future.dask_future.status != "lost":  # Dask computes it again (3 s)
        assert time.monotonic() < deadline, future.dask_future.status
        time.sleep(0.01)
    followed = remote.follow(future.dask_future)  # follows it while it is lost
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        future.result(timeout=0.5)
    assert time.monotonic() - started < 2.0
    assert float(future.result(timeout=120)[0][0]) == 3000.0
    assert float(followed.result(timeout=120)[0][0]) == 3000.0


def _kill_while_running(cluster, remote: ClusterPool, count: int):
    """Submits `count` sleeping runs named r0, r1, ...; SIGKILLs the Dask worker whose Pool
    began one first. Returns the futures and the name of the run it was killed in."""
    program = sleep_program(1)
    remote.run(program, [milliseconds(1)])  # every node's Pool started and the program loaded
    remote.run(program, [milliseconds(1)])
    futures = [remote.submit(program, [milliseconds(600 + i)], name=f"r{i}") for i in range(count)]

    name = remote.plugin_name

    def began(dask_worker) -> list[str]:
        pool = dask_worker.plugins[name].started
        return [] if pool is None else [i["task"] for i in pool.worker_info if i.get("started")]

    deadline = time.monotonic() + 120
    while True:
        running = {a: names for a, names in cluster.run(began).items() if names}
        if running:
            break
        assert time.monotonic() < deadline, "no run began"
        time.sleep(0.01)
    victim, (name,) = next(iter(running.items()))
    os.kill(cluster.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
    return futures, name


def test_a_killed_dask_worker_s_runs_finish_elsewhere_and_are_counted_once(cluster, remote) -> None:
    futures, _ = _kill_while_running(cluster, remote, 6)
    results = [future.result(timeout=300)[0] for future in futures]
    assert [float(r[0]) for r in results] == [600.0 + i for i in range(6)]
    time.sleep(0.5)  # a second settling of any future would have come by now
    assert remote.finished_runs == 2 + 6  # the two warm-up runs and the six, each once


def test_with_retry_lost_off_only_the_run_on_the_lost_worker_fails(
    cluster, handlers: str, tmp_path: Path
) -> None:
    cluster.wait_for_workers(2, timeout=120)
    with ClusterPool(
        cluster,
        workers_per_node=1,
        cache_dir=str(tmp_path),
        initializer=handler_initializer(handlers),
        retry_lost=False,
    ) as remote:
        futures, killed_in = _kill_while_running(cluster, remote, 6)
        for i, future in enumerate(futures):
            if f"r{i}" == killed_in:
                with pytest.raises(NodeLostError, match="was not run again"):
                    future.result(timeout=300)
            else:  # queued on the lost worker or on the other one: never begun, so run
                assert float(future.result(timeout=300)[0][0]) == 600.0 + i


@pytest.mark.parametrize("cancel_pending", [False, True])
def test_close_gives_up_on_runs_no_node_is_left_to_run(
    handlers: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cancel_pending: bool
) -> None:
    # A cluster of its own: a scheduler and one `dask worker` process without a nanny, so
    # that the worker killed stays gone and its runs can run nowhere (Dask waits for a worker
    # to join). close() used to wait for them forever.
    import subprocess
    import sys

    from conftest import repo_environment

    import pool.cluster.core

    monkeypatch.setattr(pool.cluster.core, "STUCK_SECONDS", 3.0)  # the test's time, not 20 s
    with (
        distributed.LocalCluster(
            n_workers=0, processes=True, host="127.0.0.1", dashboard_address=":0"
        ) as scheduler,
        distributed.Client(scheduler) as client,
    ):
        command = [sys.executable, "-m", "distributed.cli.dask_worker"]
        options = ["--no-nanny", "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"]
        worker = subprocess.Popen(
            [*command, scheduler.scheduler_address, *options], env=repo_environment()
        )
        try:
            client.wait_for_workers(1, timeout=120)
            remote = ClusterPool(
                client,
                workers_per_node=1,
                cache_dir=str(tmp_path),
                initializer=handler_initializer(handlers),
            )
            program = sleep_program(1)
            remote.run(program, [milliseconds(1)])
            futures = [remote.submit(program, [milliseconds(60_000)]) for _ in range(3)]
            name = remote.plugin_name

            def began(dask_worker) -> bool:
                pool = dask_worker.plugins[name].started
                return any(i.get("started") for i in pool.worker_info)

            deadline = time.monotonic() + 120
            while not any(client.run(began).values()):
                assert time.monotonic() < deadline, "no run began"
                time.sleep(0.01)
            worker.kill()  # the cluster's only worker: no node is left to run them
            worker.wait(timeout=60)
            closing = threading.Thread(
                target=remote.close, kwargs={"cancel_pending": cancel_pending}, daemon=True
            )
            started = time.monotonic()
            closing.start()
            closing.join(timeout=90)
            assert not closing.is_alive(), "close() still waits for runs no node can run"
            assert time.monotonic() - started < 60
            for future in futures:
                with pytest.raises(NodeLostError, match="no Dask worker is left to run it"):
                    future.result(timeout=5)
            assert remote.finished_runs == 1 + 3  # each counted once
        finally:
            worker.kill()
            worker.wait(timeout=60)


def test_run_command_on_the_cluster_once_and_as_a_batch(remote, cluster, tmp_path: Path) -> None:
    import json
    import subprocess

    from conftest import REPO

    program = lower(lambda x, y: (x * y, jnp.sum(x)), [f32(4), f32(4)])
    root = lower(jnp.sqrt, [f32(4)])
    specs = remote.compile_many([("product", program), ("root", root)])
    manifest = tmp_path / "m.json"
    Manifest(specs, str(tmp_path / "cache")).write(manifest)
    files = []
    for i in range(3):
        files.append(str(tmp_path / f"in{i}.npz"))
        np.savez(files[-1], np.full(4, i, np.float32), np.full(4, 2, np.float32))
    environment = dict(os.environ, PYTHONPATH=str(REPO))

    def command(
        *words: str, name: str = "product", of: Path = manifest, **variables: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI_COMMAND, "run", str(of), name, *words],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(environment, **variables),
            check=False,
        )

    address = cluster.scheduler.address
    done = command("--scheduler", address, "--batch", *files, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["counts"] == {"ran": 3, "failed": 0}
    assert [run["outputs"][0]["sum"] for run in report["runs"]] == [0.0, 8.0, 16.0]
    assert [run["outputs"][1]["sum"] for run in report["runs"]] == [0.0, 4.0, 8.0]
    once = command("--scheduler", address, "--inputs", files[2], "--json")
    assert once.returncode == 0, once.stderr[-3000:]
    assert json.loads(once.stdout)["outputs"][0]["sum"] == 16.0
    # Bad usage answers in one line with status 2, before anything runs.
    bad = command("--batch", *files)
    assert bad.returncode == 2 and "give --scheduler" in bad.stderr

    # .npy files of a program's one input, each read as its run goes; a file that does not
    # fit fails in its place, and a sum that is not finite is JSON's null.
    arrays = [np.full(4, 4.0, np.float32), np.ones(3, np.float32), np.full(4, -1.0, np.float32)]
    singles = [str(tmp_path / f"root{i}.npy") for i in range(3)]
    for path, array in zip(singles, arrays, strict=True):
        np.save(path, array)
    done = command("--scheduler", address, "--batch", *singles, "--json", name="root")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "NaN" not in done.stdout
    report = json.loads(done.stdout)
    assert report["counts"] == {"ran": 2, "failed": 1}
    assert report["runs"][0]["outputs"][0]["sum"] == 8.0
    assert "shape (3,)" in report["runs"][1]["error"]
    assert report["runs"][2]["outputs"][0]["sum"] is None

    # The remote tier named here (--remote, or PJRT_POOL_CACHE_REMOTE) is the nodes': a
    # manifest whose cache directory is empty runs from it.
    url = f"file://{tmp_path / 'remote'}/fleet"
    with ClusterPool(cluster, workers_per_node=1, cache_dir=str(tmp_path / "ci"), remote=url) as ci:
        published = ci.compile_many([("product", program)])
    empty = tmp_path / "empty.json"
    Manifest(published, str(tmp_path / "serving")).write(empty)
    done = command("--scheduler", address, "--batch", files[1], "--remote", url, of=empty)
    assert done.returncode == 0, done.stderr[-3000:]
    once = command(
        "--scheduler", address, "--inputs", files[2], "--json", of=empty, PJRT_POOL_CACHE_REMOTE=url
    )
    assert once.returncode == 0, once.stderr[-3000:]
    assert json.loads(once.stdout)["outputs"][0]["sum"] == 16.0
