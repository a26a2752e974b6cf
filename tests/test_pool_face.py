"""The face a Pool and a ClusterPool share (pool.face), and what it newly guarantees.

PoolFace writes submit_compile, compile, compile_many, map, function and
the with block once, on primitives each pool implements. Pool.map means what
ClusterPool.map means: the outputs in order, at most max_in_flight runs
submitted ahead of the one waited for, and a failing batch failing in its
place. ClusterPool.compile means what Pool.compile means. A pool whose
workers have roles (compile workers and workers that run) takes the same
calls.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pool_helpers import (
    expected_scale,
    handler_initializer,
    milliseconds,
    scale_program,
    sleep_program,
)

import pool as package
from pool import Pool, PoolClosedError, PoolError, ProgramSpec, TaskTimeoutError
from pool.face import PoolFace

WRITTEN_ONCE = ("submit_compile", "compile", "compile_many", "map", "function", "__enter__")


@pytest.fixture(scope="module")
def two(handlers: str) -> Iterator[Pool]:
    """A Pool of two workers that can run sleep_program."""
    with Pool(workers=2, initializer=handler_initializer(handlers)) as pool:
        yield pool


def _counting(pulled: list[int]) -> Iterator[list[np.ndarray]]:
    """Endless batches of scale_program's input, each noted in `pulled` as it is read."""
    for i in itertools.count():
        pulled.append(i)
        yield [np.full(8, i, np.float32)]


def test_pool_and_cluster_pool_share_the_methods_of_one_face() -> None:
    distributed = pytest.importorskip("distributed")
    assert distributed is not None
    from pool import ClusterPool

    assert package.Pool is Pool and Pool.__module__ == "pool.face"
    for kind in (Pool, ClusterPool):
        assert issubclass(kind, PoolFace)
        assert not kind.__abstractmethods__
        for name in WRITTEN_ONCE:
            assert getattr(kind, name) is getattr(PoolFace, name), (kind, name)


def test_map_yields_the_outputs_in_order(two: Pool) -> None:
    sleeper = sleep_program()
    sleeps = [80.0, 1.0, 50.0, 1.0, 20.0, 1.0, 5.0]  # later runs finish first
    batches = ([milliseconds(ms)] for ms in sleeps)
    got = [float(outputs[0][0]) for outputs in two.map(sleeper, batches)]
    assert got == sleeps
    spec = two.compile(sleeper)  # a ProgramSpec's executable, as submit_spec runs it
    got = [float(outputs[0][0]) for outputs in two.map(spec, [[milliseconds(3.0)]] * 5)]
    assert got == [3.0] * 5


def test_a_failing_batch_fails_in_its_place(two: Pool) -> None:
    sleeper = sleep_program()
    batches = [
        [milliseconds(1.0)],
        [np.ones(3, np.float32)],  # refused at submit: the wrong shape
        [milliseconds(4000.0)],  # fails in a worker: past the timeout
        [milliseconds(2.0)],
    ]
    first, refused, late, last = two.map(sleeper, batches, timeout=1.0, return_exceptions=True)
    assert float(first[0][0]) == 1.0 and float(last[0][0]) == 2.0
    assert isinstance(refused, ValueError) and "shape" in str(refused)
    assert isinstance(late, TaskTimeoutError)
    # Without return_exceptions it raises in its turn, after the run before it.
    results = two.map(sleeper, batches, timeout=1.0)
    assert float(next(results)[0][0]) == 1.0
    with pytest.raises(ValueError, match="shape"):
        next(results)


def test_map_submits_at_most_max_in_flight_ahead(two: Pool) -> None:
    program = scale_program(2.0)
    pulled: list[int] = []
    results = two.map(program, _counting(pulled), max_in_flight=3)
    assert pulled == []  # nothing is submitted before the first read
    np.testing.assert_array_equal(next(results)[0], expected_scale(2.0, np.zeros(8)))
    assert len(pulled) == 3
    np.testing.assert_array_equal(next(results)[0], expected_scale(2.0, np.ones(8)))
    assert len(pulled) == 4
    results.close()  # leaving early cancels what has not run; the pool goes on
    # By default, four runs per worker that runs programs.
    pulled.clear()
    results = two.map(program, _counting(pulled))
    next(results)
    assert len(pulled) == 4 * 2
    results.close()
    ones = np.ones(8, np.float32)
    np.testing.assert_array_equal(two.run(program, [ones])[0], expected_scale(2.0, ones))
    with pytest.raises(ValueError, match="max_in_flight"):
        two.map(program, [], max_in_flight=0)


def test_map_refuses_a_closed_pool_and_a_wait_in_a_done_callback(handlers: str) -> None:
    sleeper = sleep_program()
    pool = Pool(workers=1, initializer=handler_initializer(handlers))
    refused: list[BaseException] = []
    called = threading.Event()

    def map_there(_future: object) -> None:
        try:
            pool.map(sleeper, [[milliseconds(1.0)]])
        except BaseException as error:
            refused.append(error)
        called.set()

    future = pool.submit(sleeper, [milliseconds(200.0)])
    future.add_done_callback(map_there)  # runs on the manager thread
    future.result(timeout=60)
    assert called.wait(30)
    assert len(refused) == 1 and isinstance(refused[0], PoolError), refused
    assert "done-callback" in str(refused[0])
    pool.close()
    with pytest.raises(PoolClosedError, match="closed"):
        pool.map(sleeper, [[milliseconds(1.0)]])


def test_a_pool_of_compile_workers_and_run_workers_takes_the_same_calls() -> None:
    program = scale_program(3.0)
    x = np.arange(8, dtype=np.float32)
    with Pool(1, run_workers=1) as pool:
        assert [worker["role"] for worker in pool.worker_info] == ["compile", "device"]
        for i, outputs in enumerate(pool.map(program, [[x + i] for i in range(6)])):
            np.testing.assert_array_equal(outputs[0], expected_scale(3.0, x + i))
        spec = pool.compile(program)
        assert pool.compile_many([program]) == [spec]
        by_spec = pool.submit_spec(spec, [x]).result()
        np.testing.assert_array_equal(by_spec[0], expected_scale(3.0, x))
        triple = pool.function(lambda v: v * 3.0)
        np.testing.assert_array_equal(triple(x), x * 3.0)


@pytest.mark.slow
def test_a_cluster_pool_compiles_as_a_pool_does(tmp_path: Path) -> None:
    pytest.importorskip("distributed")
    from pool import ClusterPool
    from pool.cluster import local_client

    program = scale_program(5.0)
    x = np.arange(8, dtype=np.float32)
    with (
        local_client(1, threads_per_worker=1) as client,
        ClusterPool(client, workers_per_node=1, cache_dir=str(tmp_path)) as cluster,
    ):
        spec = cluster.compile(program, name="five")
        assert isinstance(spec, ProgramSpec) and spec.name == "five"
        assert cluster.statistics.compiled == 1
        [outputs] = cluster.map(spec, [[x]])
        np.testing.assert_array_equal(outputs[0], expected_scale(5.0, x))
    with pytest.raises(PoolClosedError):
        cluster.compile(program)
