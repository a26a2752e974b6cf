"""Compile workers and run workers: the pool a TPU host gets, routed on the CPU.

A Pool whose compiles and runs go to different workers (pool.executor.roles):
on a TPU host, compile workers compile for the host's topology without the
chip and the device worker that holds it runs; Pool(n, run_workers=r) splits
a CPU pool the same way, which is how CI (without a TPU) tests the routing:
compiles land on compile workers, runs on the run worker, which loads what
they compiled from the cache, and a program's first run is compiled on a
compile worker first.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pool import DeviceStart, Pool, lower
from pool.errors import WorkerCrashedError, WorkerStartupError
from pool.executor.roles import Role, plan_workers
from pool.executor.tasks import Kind
from worker.plugin.topology import parse_topology


def programs(count: int) -> list:
    return [
        lower(lambda x, k=k: jnp.sin(x) * k, [jax.ShapeDtypeStruct((16,), jnp.float32)])
        for k in range(count)
    ]


def test_the_plan_of_each_kind_of_pool():
    assert [p.role for p in plan_workers(3, "cpu", None)] == [Role.ANY] * 3
    split = plan_workers(2, "cpu", None, run_workers=1)
    assert [p.role for p in split] == [Role.COMPILE, Role.COMPILE, Role.DEVICE]
    only = plan_workers(2, "tpu", parse_topology("v5e:1x1"))
    assert [(p.role, p.topology.name) for p in only] == [(Role.COMPILE, "v5e:1x1")] * 2
    with pytest.raises(ValueError, match="has no run workers"):
        plan_workers(2, "tpu", parse_topology("v5e:1x1"), run_workers=1)
    assert Role.COMPILE.takes(Kind.COMPILE) and not Role.COMPILE.takes(Kind.RUN)
    assert Role.DEVICE.takes(Kind.RUN) and not Role.DEVICE.takes(Kind.COMPILE)
    assert Role.ANY.takes(Kind.RUN) and Role.ANY.takes(Kind.COMPILE)


def test_compiles_go_to_compile_workers_and_runs_to_the_run_worker(tmp_path):
    batch = programs(5)
    x = np.linspace(0, 1, 16, dtype=np.float32)
    with Pool(2, run_workers=1, cache_dir=tmp_path) as pool:
        roles = [w["role"] for w in pool.worker_info]
        assert roles == ["compile", "compile", "device"]
        specs = pool.compile_many(batch)
        assert len({spec.key for spec in specs}) == 5
        assert pool.statistics.compiled == 5 and pool.statistics.loaded == 0
        # The run worker loads each program from the cache the compile workers filled.
        outputs = [f.result()[0] for f in [pool.submit(p, [x]) for p in batch]]
        for k, output in enumerate(outputs):
            np.testing.assert_allclose(output, np.sin(x) * k, rtol=1e-6)
        assert pool.statistics.compiled == 5 and pool.statistics.loaded == 5
        loaded = {w["role"]: w["loaded"] for w in pool.worker_info}
        assert loaded["device"] == 5


def test_a_new_programs_first_run_compiles_on_a_compile_worker_first(tmp_path):
    new = lower(lambda x: x * 7 + 1, [jax.ShapeDtypeStruct((16,), jnp.float32)])
    with Pool(1, run_workers=1, cache_dir=tmp_path) as pool:
        x = np.ones(16, np.float32)
        np.testing.assert_array_equal(pool.run(new, [x])[0], x * 8)
        # One compile (on the compile worker), one load (by the run worker): the run
        # worker compiled nothing.
        assert (pool.statistics.compiled, pool.statistics.loaded) == (1, 1)
        submitted = lower(lambda x: x - 3, [jax.ShapeDtypeStruct((16,), jnp.float32)])
        np.testing.assert_array_equal(pool.submit(submitted, [x]).result()[0], x - 3)
        assert (pool.statistics.compiled, pool.statistics.loaded) == (2, 2)


def test_a_failed_compile_fails_the_run_that_needed_it(tmp_path):
    bad = lower(lambda x: x + 1, [jax.ShapeDtypeStruct((4,), jnp.float32)])
    with Pool(1, run_workers=1, cache_dir=tmp_path) as pool:
        future = pool.submit(bad, [np.ones(4, np.float32)], compile_options=b"")
        with pytest.raises(WorkerCrashedError):  # an empty CompileOptionsProto aborts it
            future.result(timeout=120)
        np.testing.assert_array_equal(pool.run(bad, [np.ones(4, np.float32)])[0], 2)


def test_runs_never_wait_behind_a_long_compile_queue(tmp_path):
    """With compiles queued for the compile worker, a run of a compiled program goes to
    the run worker at once."""
    ready = programs(1)[0]
    queue = programs(12)[1:]
    x = np.ones(16, np.float32)
    with Pool(1, run_workers=1, cache_dir=tmp_path) as pool:
        pool.run(ready, [x])
        compiles = [pool.submit_compile(p) for p in queue]
        result = pool.submit(ready, [x]).result(timeout=60)
        np.testing.assert_array_equal(result[0], np.sin(x) * 0)
        waiting = sum(not c.done() for c in compiles)
        assert waiting > 0, "the run was answered only after every compile"
        for compiled in compiles:
            compiled.result(timeout=120)


def test_only_run_workers_preload(tmp_path):
    """What a pool preloads is to run: its compile workers (on a TPU host, without a chip to
    load onto) preload nothing, and the run worker holds it all at start."""
    from pool.manifest import Manifest

    batch = programs(3)
    with Pool(1, cache_dir=tmp_path) as pool:
        specs = pool.compile_many([(f"sin_times_{k}", p) for k, p in enumerate(batch)])
    manifest = Manifest(specs, str(tmp_path), "cpu")
    with Pool(2, run_workers=1, cache_dir=tmp_path, preload=manifest) as pool:
        loaded = {w["role"]: w["loaded"] for w in pool.worker_info}
        assert loaded == {"compile": 0, "device": 3}
        x = np.ones(16, np.float32)
        np.testing.assert_allclose(pool.submit_spec(specs[2], [x]).result()[0], np.sin(x) * 2)


def test_a_split_pool_compiles_while_its_device_worker_starts(tmp_path):
    """The pool a TPU host gets, with device_start=AT_ONCE (compile workers beside a device
    worker that opens the chip as the pool starts), takes compiles as soon as its compile
    workers are up: compile_many finishes while the device worker is still starting, and
    runs wait for it. Here the device worker's start is held by a gate the test opens;
    before, Pool() itself waited for it (and timed out)."""
    gate = tmp_path / "gate"

    def hold_the_device_worker(gate: str) -> None:  # a closure: pickled by value
        """In the device worker only, wait until the gate file exists (what a TPU host's
        device worker does while it opens the chip, 5-10 s there)."""
        import os
        import time

        if os.environ.get("PJRT_POOL_WORKER_ROLE") == "device":
            while not os.path.exists(gate):
                time.sleep(0.01)

    batch = programs(3)
    x = np.linspace(0, 1, 16, dtype=np.float32)
    with Pool(
        1,
        run_workers=1,
        cache_dir=tmp_path / "cache",
        initializer=hold_the_device_worker,
        initargs=(str(gate),),
        start_timeout=60,
        device_start=DeviceStart.AT_ONCE,
    ) as pool:
        specs = pool.compile_many(batch)
        assert len(specs) == 3 and pool.statistics.compiled == 3
        states = {w["role"]: w["state"] for w in pool.worker_info}
        assert states == {"compile": "idle", "device": "starting"}
        future = pool.submit(batch[1], [x])  # queued until the device worker is up
        assert not future.done()
        gate.touch()
        np.testing.assert_allclose(future.result(timeout=60)[0], np.sin(x), rtol=1e-6)
        assert (pool.statistics.compiled, pool.statistics.loaded) == (3, 1)


# -- device workers started when first needed (DeviceStart.WHEN_NEEDED, the default) -------


def device_worker(pool: Pool) -> dict:
    return next(w for w in pool.worker_info if w["role"] == "device")


def wait_for_device_state(pool: Pool, leaving: str, seconds: float = 30.0) -> dict:
    """Polls worker_info until the device worker's state is no longer `leaving`."""
    deadline = time.monotonic() + seconds
    while (info := device_worker(pool))["state"] == leaving:
        assert time.monotonic() < deadline, f"the device worker stayed {leaving!r}"
        time.sleep(0.01)
    return info


def test_compile_many_from_a_fresh_pool_runs_before_its_device_worker_starts(tmp_path):
    """On a TPU host the device worker's opening of the chip slows the compiles beside it:
    by default it is not started while a fresh pool's compile_many runs (worker_info says
    "not started", with no process), and starts once the compiles are done."""
    batch = programs(4)
    seen = []
    with Pool(2, run_workers=1, cache_dir=tmp_path) as pool:
        assert (device_worker(pool)["state"], device_worker(pool)["pid"]) == ("not started", None)
        assert device_worker(pool).keys() == pool.worker_info[0].keys()  # a row as any other
        pool.compile_many(batch, progress=lambda *_: seen.append(device_worker(pool)["state"]))
        assert seen == ["not started"] * 4  # as each compile finished
        started = wait_for_device_state(pool, "not started")
        assert started["pid"] is not None and started["state"] in ("starting", "idle")
        x = np.ones(16, np.float32)
        np.testing.assert_allclose(pool.run(batch[2], [x])[0], np.sin(x) * 2, rtol=1e-6)
        assert (pool.statistics.compiled, pool.statistics.loaded) == (4, 1)


def test_a_run_starts_the_device_worker_at_once_while_compiles_are_queued(tmp_path):
    """A run needs the device worker: it starts as the run is submitted, not once the
    compiles queued before it are done (the run's own compile among them)."""
    batch = programs(12)
    x = np.ones(16, np.float32)
    with Pool(1, run_workers=1, cache_dir=tmp_path) as pool:
        compiles = [pool.submit_compile(p) for p in batch[2:]]
        assert device_worker(pool)["state"] == "not started"
        run = pool.submit(batch[1], [x])
        wait_for_device_state(pool, "not started", seconds=10)
        assert not all(c.done() for c in compiles), "it started only once the compiles ended"
        np.testing.assert_allclose(run.result(timeout=60)[0], np.sin(x), rtol=1e-6)


def test_a_pool_closed_before_it_needed_its_device_worker_never_starts_it(tmp_path):
    with Pool(1, run_workers=1, cache_dir=tmp_path) as pool:
        pool.compile_many(programs(2))
    assert [(w["role"], w["state"]) for w in pool.worker_info] == [
        ("compile", "dead"),
        ("device", "not started"),
    ]


def test_a_device_worker_that_fails_to_start_when_needed_fails_the_runs_waiting(tmp_path):
    """A device worker started at the first run fails as one started with the pool did: the
    pool goes on compiling, and the run fails once the worker's starts in a row failed."""

    def fail_in_the_device_worker() -> None:
        import os

        if os.environ.get("PJRT_POOL_WORKER_ROLE") == "device":
            raise RuntimeError("no device here")

    batch = programs(2)
    with Pool(1, run_workers=1, cache_dir=tmp_path, initializer=fail_in_the_device_worker) as pool:
        specs = pool.compile_many(batch)  # the pool started: its device worker was not needed
        with pytest.raises(WorkerStartupError, match="no device here"):
            pool.run(batch[0], [np.ones(16, np.float32)])
        assert pool.compile(batch[1]) == specs[1]
