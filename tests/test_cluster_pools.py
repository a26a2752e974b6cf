"""ClusterPools on a real Dask LocalCluster: closing, several on one cluster, their settings.

Two worker processes of one thread each. The last tests use a cluster of
their own, whose scheduler steals no work (a run stays on the node it was
routed to) and allows no failures (a run whose worker is lost fails at
once); the test that kills a Dask worker comes last.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

import dask  # noqa: E402
from pool_helpers import (  # noqa: E402
    fast_math_options,
    handler_initializer,
    milliseconds,
    scale_program,
    sleep_program,
)

from pool import ClusterPool, NeverCompileError, PoolClosedError, PoolError  # noqa: E402
from pool.cluster import NodeLostError, local_client  # noqa: E402
from pool.cluster.dask.node import node_answer, run_task  # noqa: E402
from pool.cluster.routing import home_of  # noqa: E402
from pool.executor.programs import program_id  # noqa: E402
from worker.cache import DiskCache  # noqa: E402
from worker.cache.remote import RemoteCounters  # noqa: E402

pytestmark = pytest.mark.slow

X = np.arange(8, dtype=np.float32)


@pytest.fixture(scope="module")
def cluster():
    with local_client(2, threads_per_worker=1) as client:
        yield client


def _pjrt_plugins(client) -> list[list[str]]:
    """Each node's pjrt-pool plugins (by name), sorted by node."""

    def names(dask_worker) -> list[str]:
        return sorted(name for name in dask_worker.plugins if name.startswith("pjrt-pool"))

    return [found for _, found in sorted(client.run(names).items())]


def _sleeping_pool(client, handlers: str, tmp_path: Path) -> tuple[ClusterPool, object]:
    """A ClusterPool of one PJRT worker per node, warm, and its program that sleeps."""
    program = sleep_program(1)
    pool = ClusterPool(
        client,
        workers_per_node=1,
        cache_dir=str(tmp_path),
        initializer=handler_initializer(handlers),
    )
    pool.run(program, [milliseconds(1)])
    return pool, program


def _set_node_environment(client, name: str, value: str | None) -> None:
    """Sets (or, for None, removes) a variable in every node's environment."""

    def set_variable(name: str, value: str | None) -> None:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value.replace("{pid}", str(os.getpid()))

    client.run(set_variable, name, value)


def test_a_closed_cluster_pool_refuses_calls_and_leaves_no_node_pool(cluster, tmp_path) -> None:
    program = scale_program(3.0)
    pool = ClusterPool(cluster, workers_per_node=1, cache_dir=str(tmp_path))
    np.testing.assert_array_equal(pool.run(program, [X])[0], X * 3.0 + 1.0)
    pool.close()
    pool.close()  # again: nothing
    for call in (
        lambda: pool.run(program, [X]),
        lambda: pool.submit_compile(program),
        lambda: pool.map(program, [[X]]),
    ):
        with pytest.raises(PoolClosedError, match="closed"):
            call()
    assert _pjrt_plugins(cluster) == [[], []]
    # A task of the closed pool that reaches a node anyway is refused there: no Pool starts.
    late = cluster.submit(run_task, pool.plugin_name, program, [X], "late", None, None, pure=False)
    with pytest.raises(PoolClosedError, match="no pjrt-pool plugin"):
        pool.follow(late).result(timeout=60)
    assert _pjrt_plugins(cluster) == [[], []]


def test_close_waits_for_runs_and_with_cancel_pending_runs_none_not_begun(
    cluster, handlers: str, tmp_path: Path
) -> None:
    program = sleep_program(1)
    options = {
        "workers_per_node": 1,
        "cache_dir": str(tmp_path),
        "initializer": handler_initializer(handlers),
    }
    pool = ClusterPool(cluster, **options)
    pool.run(program, [milliseconds(1)])
    futures = [pool.submit(program, [milliseconds(300 + i)]) for i in range(4)]
    pool.close()
    assert all(future.done() for future in futures)
    assert [float(f.result()[0][0]) for f in futures] == [300.0 + i for i in range(4)]

    pool = ClusterPool(cluster, **options)
    pool.run(program, [milliseconds(1)])
    futures = [pool.submit(program, [milliseconds(2000 + i)]) for i in range(6)]
    time.sleep(1.0)  # one run began on each node; the others wait for a thread
    started = time.monotonic()
    pool.close(cancel_pending=True)
    assert time.monotonic() - started < 4.0  # the two running (2 s each), not all six (6 s)
    assert all(future.done() for future in futures)
    closed = [f for f in futures if isinstance(f.exception(), PoolClosedError)]
    ran = [f for f in futures if f.exception() is None]
    assert len(closed) >= 4 and len(closed) + len(ran) == 6
    assert all(float(f.result()[0][0]) >= 2000.0 for f in ran)


def test_close_after_cancelled_runs_while_a_done_callback_holds_dask_stops_the_node_pools(
    cluster, handlers: str, tmp_path: Path
) -> None:
    """A user's done-callback holds Dask's one callback thread, so the runs cancelled
    meanwhile are not settled here yet when close() waits: it neither raises nor leaves the
    plugin and the node Pools running."""
    pool, program = _sleeping_pool(cluster, handlers, tmp_path)
    holding, release = threading.Event(), threading.Event()

    def slow(_future) -> None:
        holding.set()
        release.wait(10)  # bounded: the test sets it once close() returned

    first = pool.submit(program, [milliseconds(300)])
    first.add_done_callback(slow)
    try:
        assert holding.wait(60), "the first run never ended"
        queued = [pool.submit(program, [milliseconds(2000 + i)]) for i in range(4)]
        assert all(future.cancel() for future in queued)
        pool.close()
    except BaseException:
        with contextlib.suppress(Exception):  # the module's cluster, as the next tests need it
            cluster.unregister_worker_plugin(pool.plugin_name)
        raise
    finally:
        release.set()
    assert all(future.cancelled() for future in queued)
    assert _pjrt_plugins(cluster) == [[], []]  # every node's Pool closed
    pool.close()  # again: nothing


def test_a_node_s_event_loop_serves_while_its_pool_closes(
    cluster, handlers: str, tmp_path: Path
) -> None:
    """The node's Pool closes in a thread: Pool.close waits for the running run, and the Dask
    worker's event loop (heartbeats, client.run) goes on meanwhile."""
    pool, program = _sleeping_pool(cluster, handlers, tmp_path)
    future = pool.submit(program, [milliseconds(6000)])
    time.sleep(1.0)  # it runs
    closing = threading.Thread(target=pool.close, kwargs={"cancel_pending": True})
    closing.start()
    time.sleep(0.5)  # its node's Pool is closing, waiting for the run
    started = time.monotonic()
    cluster.run(os.getpid)
    answered = time.monotonic() - started
    closing.join(timeout=120)
    assert not closing.is_alive()
    assert answered < 2.0, f"a node's event loop was held {answered:.1f} s"
    assert float(future.result(timeout=60)[0][0]) == 6000.0  # the running run finished


def test_cluster_pools_on_one_cluster_keep_their_own_options_and_node_pools(
    cluster, tmp_path: Path
) -> None:
    first = ClusterPool(
        cluster, workers_per_node=1, cache_dir=str(tmp_path / "a"), retry_lost=False
    )
    np.testing.assert_array_equal(first.run(scale_program(1.0), [X])[0], X + 1.0)
    second = ClusterPool(
        cluster,
        workers_per_node=1,
        cache_dir=str(tmp_path / "b"),
        never_compile=True,
        retry_lost=False,
    )
    with pytest.raises(NeverCompileError):
        second.run(scale_program(2.0), [X])
    # The first one's node Pools are its own still: they compile, into its directory.
    np.testing.assert_array_equal(first.run(scale_program(2.0), [X])[0], X * 2.0 + 1.0)
    second.close()
    np.testing.assert_array_equal(first.run(scale_program(3.0), [X])[0], X * 3.0 + 1.0)
    assert len(DiskCache(tmp_path / "a").list_entries()) == 3
    assert not list((tmp_path / "b").rglob("*.pjx"))
    compiled = sum(
        figures.get("compiled", 0)
        for figures in cluster.run(node_answer, first.plugin_name, "statistics").values()
    )
    assert compiled == 3  # the same node Pools all along: none was replaced and restarted

    def plugins(dask_scheduler) -> list[str]:
        return sorted(dask_scheduler.plugins)

    run_once = [n for n in cluster.run_on_scheduler(plugins) if n.startswith("pjrt-pool-run")]
    assert len(run_once) == 1  # the first one's scheduler plugin stays
    first.close()
    assert _pjrt_plugins(cluster) == [[], []]


def test_settings_are_checked_as_the_cluster_pool_is_made(cluster) -> None:
    lock = threading.Lock()
    cases = [
        ({"task_timeout": -5}, ValueError, "task_timeout"),
        ({"workers_per_node": 0}, ValueError, "workers_per_node"),
        ({"platform": 3}, TypeError, "platform"),
        ({"remote": "ftp://host/x"}, ValueError, "scheme"),
        ({"initializer": lambda: lock}, TypeError, "initializer"),
        ({"retry_lost": "no"}, TypeError, "retry_lost"),
    ]
    for options, error, text in cases:
        with pytest.raises(error, match=text):
            ClusterPool(cluster, **options)
    assert _pjrt_plugins(cluster) == [[], []]  # nothing was registered


def test_functions_lower_for_the_nodes_platform(cluster) -> None:
    with ClusterPool(cluster, workers_per_node=1) as pool:
        assert pool.platform == "cpu"  # the nodes' default, asked: no node Pool started
        assert pool.function(lambda x: x * 2.0).lower(X).platform == "cpu"
    with ClusterPool(cluster, workers_per_node=1, platform="cpu") as pool:
        assert pool.platform == "cpu"


def test_a_compile_goes_where_the_runs_of_its_options_go(cluster, tmp_path: Path) -> None:
    options = fast_math_options()
    addresses = sorted(cluster.nthreads())
    program = next(  # one whose home differs with the options, so that routing by the
        p  # program alone would compile it on the node its runs do not go to
        for p in (scale_program(float(i)) for i in range(64))
        if home_of(program_id(p, options), addresses) != home_of(program_id(p), addresses)
    )
    with ClusterPool(cluster, workers_per_node=1, cache_dir=str(tmp_path)) as pool:
        pool.submit_compile(program, compile_options=options).result(timeout=120)
        pool.run(program, [X], compile_options=options)
        figures = cluster.run(node_answer, pool.plugin_name, "statistics").values()
        # Compiled once, then run where it is loaded: no node loaded it again.
        assert sum(f.get("compiled", 0) + f.get("loaded", 0) for f in figures) == 1


def test_a_node_exception_this_process_cannot_rebuild_comes_as_a_pool_error(cluster) -> None:
    def raise_a_node_only_class() -> None:
        import sys
        import types

        from pool.cluster.carried import CarriedError

        module = types.ModuleType("pjrt_pool_node_only")

        class NodeOnlyError(Exception):
            pass

        NodeOnlyError.__module__ = module.__name__
        NodeOnlyError.__qualname__ = "NodeOnlyError"
        module.NodeOnlyError = NodeOnlyError  # type: ignore[attr-defined]
        sys.modules[module.__name__] = module
        raise CarriedError.of(NodeOnlyError("only the node knows this class"))

    with ClusterPool(cluster, workers_per_node=1) as pool:
        future = pool.follow(cluster.submit(raise_a_node_only_class, pure=False))
        with pytest.raises(PoolError, match="NodeOnlyError: only the node knows this class"):
            future.result(timeout=60)


def test_remote_false_turns_the_nodes_own_remote_off(cluster, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    _set_node_environment(cluster, "PJRT_POOL_CACHE_REMOTE", f"file://{remote}")
    try:
        program = scale_program(5.0)
        with ClusterPool(
            cluster, workers_per_node=1, cache_dir=str(tmp_path / "off"), remote=False
        ) as off:
            np.testing.assert_array_equal(off.run(program, [X])[0], X * 5.0 + 1.0)
            assert off.remote_counters == RemoteCounters()
        assert not remote.exists()
        with ClusterPool(cluster, workers_per_node=1, cache_dir=str(tmp_path / "on")) as on:
            on.run(program, [X])  # the nodes' own remote: published there
            assert on.remote_counters.published == 1
        assert len(list(remote.glob("records/*/*.json"))) == 1
    finally:
        _set_node_environment(cluster, "PJRT_POOL_CACHE_REMOTE", None)


@pytest.fixture(scope="module")
def strict():
    """A cluster that keeps runs where they are routed and lets none be lost twice."""
    settings = {
        "distributed.scheduler.work-stealing": False,
        "distributed.scheduler.allowed-failures": 0,
    }
    with dask.config.set(settings), local_client(2, threads_per_worker=1) as client:
        yield client


def test_never_compile_keeps_runs_on_the_nodes_whose_cache_has_the_program(
    strict, handlers: str, tmp_path: Path
) -> None:
    # Each node its own cache directory: cache_dir is left to PJRT_POOL_CACHE_DIR on the nodes.
    _set_node_environment(strict, "PJRT_POOL_CACHE_DIR", str(tmp_path / "{pid}"))
    try:
        program = sleep_program(1)
        options = {"workers_per_node": 1, "initializer": handler_initializer(handlers)}
        with ClusterPool(strict, **options) as warming:
            warming.compile_many([program])  # into its home node's cache alone
        with ClusterPool(strict, never_compile=True, spread_at=1, **options) as serving:
            futures = [serving.submit(program, [milliseconds(200 + i)]) for i in range(6)]
            # Past spread_at the other node was checked, refused it, and got none of them.
            results = [float(f.result(timeout=120)[0][0]) for f in futures]
            assert results == [200.0 + i for i in range(6)]
            assert len(serving.router.holders(program_id(program))) == 1
            # A program its home lacks is refused at submit, before any PJRT worker works.
            with pytest.raises(NeverCompileError, match="must not compile"):
                serving.submit(scale_program(9.0), [X])
    finally:
        _set_node_environment(strict, "PJRT_POOL_CACHE_DIR", None)


def test_a_run_lost_past_the_allowed_failures_says_so(strict, handlers: str, tmp_path) -> None:
    program = sleep_program(1)
    with ClusterPool(
        strict,
        workers_per_node=1,
        cache_dir=str(tmp_path),
        initializer=handler_initializer(handlers),
    ) as pool:
        pool.run(program, [milliseconds(1)])
        future = pool.submit(program, [milliseconds(5000)])
        time.sleep(1.0)  # it runs, on the program's node (no stealing here)
        (node,) = pool.router.holders(program_id(program))
        os.kill(strict.run(os.getpid, workers=[node])[node], signal.SIGKILL)
        with pytest.raises(NodeLostError) as lost:
            future.result(timeout=120)
    text = str(lost.value)
    assert "allowed-failures" in text and "was not run again" in text
    assert "retry_lost=True" not in text  # it is on: nothing to advise keeping
