"""The worker pool with real worker processes and the real default plugin."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from concurrent.futures import Future

import jax
import numpy as np
import pytest
from pool_helpers import (
    alive,
    children_of,
    custom_call_program,
    expected_scale,
    handler_initializer,
    memfds_of,
    scale_program,
    shm_entries,
    spin_program,
    wait_until_started,
)

from pool import (
    CompileStatistics,
    PjrtError,
    Pool,
    PoolClosedError,
    ProgramQuarantinedError,
    ProgramSpec,
    TaskTimeoutError,
    WorkerCrashedError,
    WorkerStartupError,
    lower,
)
from worker import LoweredProgram


@pytest.fixture(scope="module")
def programs() -> list[LoweredProgram]:
    return [scale_program(float(i)) for i in range(6)]


def test_compile_many_run_and_submit(programs: list[LoweredProgram]) -> None:
    x = np.arange(8, dtype=np.float64)  # converted to the program's float32
    with Pool(workers=2) as pool:
        specs = pool.compile_many(programs)
        assert [type(s) for s in specs] == [ProgramSpec] * len(programs)
        assert all(s.output_bytes == (32,) for s in specs)
        assert len({s.key for s in specs}) == len(programs)
        outputs = pool.run(programs[3], [x])
        np.testing.assert_array_equal(outputs[0], expected_scale(3.0, x))
        future = pool.submit(programs[4], [x])
        assert isinstance(future, Future)
        np.testing.assert_array_equal(future.result(timeout=60)[0], expected_scale(4.0, x))
        assert pool.statistics.compiled == len(programs)


def test_compile_many_names_progress_and_errors(programs: list[LoweredProgram]) -> None:
    broken = LoweredProgram(b"not bytecode", "module @broken {}", (), "cpu")
    seen: list[tuple[int, int]] = []
    with Pool(workers=2) as pool:
        results = pool.compile_many(
            [("first", programs[0]), broken, ("third", programs[1])],
            progress=lambda done, total, outcome: seen.append((done, total)),
            return_exceptions=True,
        )
        assert results[0].name == "first" and results[2].name == "third"
        assert isinstance(results[1], PjrtError)
        assert sorted(seen) == [(1, 3), (2, 3), (3, 3)]
        with pytest.raises(PjrtError):
            pool.compile_many([programs[0], broken])


def test_errors_arrive_as_in_process_exceptions_and_the_worker_lives(
    programs: list[LoweredProgram],
) -> None:
    broken = LoweredProgram(b"garbage", "module @garbage {}", (), "cpu")
    with Pool(workers=1) as pool:
        pid = pool.worker_info[0]["pid"]
        with pytest.raises(PjrtError) as caught:
            pool.compile(broken)
        assert caught.value.code_name  # the PJRT code survives the trip
        assert "Raised in a pjrt-pool worker" in "".join(caught.value.__notes__)
        with pytest.raises(ValueError, match="shape"):
            pool.submit(programs[0], [np.ones(3)])
        with pytest.raises(TypeError, match=r"takes 1 argument \("):
            pool.submit(programs[0], [np.ones(8), np.ones(8)])
        with pytest.raises(TypeError, match="LoweredProgram"):
            pool.submit("not a program", [])  # type: ignore[arg-type]
        assert pool.run(programs[0], [np.ones(8)])[0].shape == (8,)
        assert pool.worker_info[0]["pid"] == pid


def test_large_outputs_view_shared_memory_kept_for_reuse_or_freed_with_the_arrays() -> None:
    size = 1 << 20  # 4 MiB of float32: past the arena, so a segment of its own
    program = lower(lambda x: x * 2.0, [jax.ShapeDtypeStruct((size,), np.float32)])
    x = np.arange(size, dtype=np.float32)

    def mapped() -> list[str]:
        return [line for line in memfds_of() if "fd " not in line]

    pool = Pool(workers=1)
    try:
        (out,) = pool.run(program, [x])
        np.testing.assert_array_equal(out, x * 2)
        assert out.flags.writeable
        # The array views a mapping of shared memory: no copy was made. On a first run
        # too, that is the segment the input was copied into (the worker wrote the
        # outputs over it), not a segment of the worker's.
        assert not [line for line in mapped() if "pjrt-pool-outputs" in line]
        assert len([line for line in mapped() if "pjrt-pool-segment" in line]) == 1
        del out
        gc.collect()
        # Kept for reuse, mapped (its pages stay faulted in): repeated runs make no new
        # memfds and no new mappings.
        counts = []
        for i in range(6):
            (again,) = pool.run(program, [x + i])
            np.testing.assert_array_equal(again, (x + i) * 2)
            del again
            gc.collect()
            counts.append((len(memfds_of()), len(mapped())))
        assert len(set(counts[2:])) == 1, counts
    finally:
        pool.close()
    gc.collect()
    assert memfds_of() == []

    # With no room to keep segments, a result's memory goes with its arrays (the
    # segment its input was copied into).
    def results() -> list[str]:
        return [line for line in mapped() if "-arena-" not in line]

    with Pool(workers=1, segment_cache_bytes=0) as pool:
        for i in range(3):
            (out,) = pool.run(program, [x + i])
            np.testing.assert_array_equal(out, (x + i) * 2)
            assert len(results()) == 1, results()
            del out
            gc.collect()
            assert results() == []


def test_small_outputs_are_independent_copies(programs: list[LoweredProgram]) -> None:
    with Pool(workers=1) as pool:
        first = pool.run(programs[2], [np.ones(8)])[0]
        second = pool.run(programs[2], [np.zeros(8)])[0]
        np.testing.assert_array_equal(first, expected_scale(2.0, np.ones(8)))
        np.testing.assert_array_equal(second, expected_scale(2.0, np.zeros(8)))


def test_thread_safe_submission(programs: list[LoweredProgram]) -> None:
    results: dict[tuple[int, int], np.ndarray] = {}
    with Pool(workers=2) as pool:

        def submitter(thread: int) -> None:
            for i in range(10):
                x = np.full(8, thread * 100 + i, dtype=np.float32)
                results[(thread, i)] = pool.submit(programs[thread % 6], [x]).result(timeout=60)[0]

        threads = [threading.Thread(target=submitter, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(results) == 40
    for (thread, i), value in results.items():
        expected = expected_scale(float(thread % 6), np.full(8, thread * 100 + i))
        np.testing.assert_array_equal(value, expected)


def test_programs_are_routed_to_the_worker_that_has_them(programs: list[LoweredProgram]) -> None:
    with Pool(workers=2) as pool:
        pool.compile(programs[5])
        for _ in range(10):
            pool.run(programs[5], [np.ones(8)])
        # One compile, and no worker ever had to load it: every run went to
        # the worker that compiled it.
        assert pool.statistics == CompileStatistics(
            pool.statistics.compile_seconds, 0.0, compiled=1, loaded=0
        )
        assert sorted(w["loaded"] for w in pool.worker_info) == [0, 1]


def test_statistics_and_cache_counters_sum_over_workers(programs: list[LoweredProgram]) -> None:
    with Pool(workers=2) as pool:
        pool.compile_many(programs)
    with Pool(workers=2) as pool:
        pool.compile_many(programs)
        assert pool.statistics.loaded == len(programs) and pool.statistics.compiled == 0
        assert pool.cache_counters.hits == len(programs)


def test_sigkill_mid_task_fails_only_that_task(programs: list[LoweredProgram]) -> None:
    spin = spin_program()
    with Pool(workers=2) as pool:
        pool.compile(spin)
        # The deadline only bounds a failed test: it is killed long before.
        doomed = pool.submit(spin, [np.ones(1)], timeout=120)
        busy = wait_until_started(pool, spin.name)
        others = [pool.submit(programs[i], [np.ones(8)]) for i in range(6)]
        os.kill(busy, signal.SIGKILL)
        with pytest.raises(WorkerCrashedError) as caught:
            doomed.result(timeout=60)
        assert "SIGKILL" in str(caught.value) and caught.value.returncode == -signal.SIGKILL
        assert caught.value.program == spin.name and spin.name in str(caught.value)
        for i, future in enumerate(others):
            np.testing.assert_array_equal(
                future.result(timeout=60)[0], expected_scale(i, np.ones(8))
            )
        assert busy not in [w["pid"] for w in pool.worker_info]
        assert not alive(busy)


def test_segfault_in_a_custom_call_is_isolated_and_quarantined(handlers: str) -> None:
    crasher = custom_call_program("null_deref")
    adder = custom_call_program("add_one")
    with Pool(workers=2, initializer=handler_initializer(handlers), max_crashes=2) as pool:
        np.testing.assert_array_equal(pool.run(adder, [np.ones(8)])[0], np.full(8, 2.0))
        for attempt in range(2):
            with pytest.raises(WorkerCrashedError) as caught:
                pool.run(crasher, [np.ones(8)])
            assert "SIGSEGV" in str(caught.value)
            assert ("quarantined" in str(caught.value)) == (attempt == 1)
        with pytest.raises(ProgramQuarantinedError, match="crashed 2 workers"):
            pool.submit(crasher, [np.ones(8)])
        np.testing.assert_array_equal(pool.run(adder, [np.ones(8)])[0], np.full(8, 2.0))


def test_timeout_kills_and_replaces_only_that_worker(programs: list[LoweredProgram]) -> None:
    spin = spin_program()
    with Pool(workers=2) as pool:
        pool.compile(spin)
        pids = {w["pid"] for w in pool.worker_info}
        started = time.monotonic()
        with pytest.raises(TaskTimeoutError, match="within 1 s"):
            pool.run(spin, [np.ones(1)], timeout=1.0)
        assert time.monotonic() - started < 30
        np.testing.assert_array_equal(
            pool.run(programs[1], [np.ones(8)])[0], expected_scale(1.0, np.ones(8))
        )
        assert len(pids - {w["pid"] for w in pool.worker_info}) == 1


def test_pool_level_task_timeout(programs: list[LoweredProgram]) -> None:
    spin = spin_program()
    with Pool(workers=1, task_timeout=1.0) as pool:
        with pytest.raises(TaskTimeoutError):
            pool.run(spin, [np.ones(1)])
        assert pool.run(programs[0], [np.ones(8)])[0].shape == (8,)


def test_initializer_failure_fails_start_up_with_its_traceback() -> None:
    def broken_initializer() -> None:
        raise RuntimeError("initializer refuses")

    with pytest.raises(WorkerStartupError, match="initializer refuses") as caught:
        Pool(workers=2, initializer=broken_initializer)
    assert "broken_initializer" in "".join(caught.value.__notes__)
    assert children_of(os.getpid()) == []


def test_close_twice_leaves_no_processes_threads_or_memory(programs: list[LoweredProgram]) -> None:
    threads_before = set(threading.enumerate())
    shm_before = shm_entries()
    pool = Pool(workers=2)
    pids = [w["pid"] for w in pool.worker_info]
    pool.run(programs[0], [np.ones(8)])
    pool.close()
    pool.close()
    assert children_of(os.getpid()) == []
    assert not any(alive(pid) for pid in pids)
    assert set(threading.enumerate()) == threads_before
    assert shm_entries() - shm_before == set()  # nothing new (others may remove theirs)
    gc.collect()
    assert memfds_of() == []
    with pytest.raises(PoolClosedError):
        pool.submit(programs[0], [np.ones(8)])


def test_workers_exit_when_the_parent_dies(tmp_path) -> None:
    from conftest import run_python

    script = f"""
        import os, sys, time
        sys.path.insert(0, {str(tmp_path)!r})
        from pool import Pool
        pool = Pool(workers=2)
        print(" ".join(str(w["pid"]) for w in pool.worker_info), flush=True)
        os.kill(os.getpid(), 9)
    """
    done = run_python(script, check=False)
    assert done.returncode == -signal.SIGKILL
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "workers outlived their parent"
        time.sleep(0.1)


@pytest.mark.slow
def test_fifty_mixed_tasks_with_three_kinds_of_crash(
    handlers: str, programs: list[LoweredProgram]
) -> None:
    """An abort at compile, a segfault at run and a SIGKILL fail exactly their own tasks."""
    shm_before = shm_entries()
    crasher = custom_call_program("null_deref")
    aborter = scale_program(99.0)
    spin = spin_program()
    x = np.arange(8, dtype=np.float32)
    pool = Pool(workers=2, initializer=handler_initializer(handlers))
    try:
        pool.compile(spin, name="spin")
        futures: list[tuple[str, Future]] = []
        for i in range(47):
            factor = i % 6
            futures.append((f"ok {factor}", pool.submit(programs[factor], [x + i])))
            if i == 10:
                futures.append(("abort", pool.submit_compile(aborter, compile_options=b"")))
            if i == 20:
                futures.append(("segfault", pool.submit(crasher, [x])))
            if i == 30:
                # The deadline only bounds a failed test (close() waits for the spin).
                spun = pool.submit(spin, [np.ones(1)], name="spin", timeout=120)
                futures.append(("kill", spun))
        # Killed once it has begun: one killed before that gives the task to another worker.
        os.kill(wait_until_started(pool, "spin"), signal.SIGKILL)

        failed = {}
        correct = 0
        for index, (kind, future) in enumerate(futures):
            error = future.exception(timeout=120)
            if error is not None:
                failed[kind] = error
                continue
            i = index - sum(1 for k, _ in futures[:index] if not k.startswith("ok"))
            expected = expected_scale(float(i % 6), x + i)
            np.testing.assert_array_equal(future.result()[0], expected)
            correct += 1
        assert correct == 47
        assert set(failed) == {"abort", "segfault", "kill"}
        assert all(isinstance(e, WorkerCrashedError) for e in failed.values())
        assert failed["abort"].returncode == -signal.SIGABRT
        assert "replica_count > 0" in failed["abort"].stderr_tail  # the plugin's reason
        assert failed["segfault"].returncode == -signal.SIGSEGV
        assert failed["kill"].returncode == -signal.SIGKILL
    finally:
        pool.close()
    del futures, failed
    gc.collect()
    assert children_of(os.getpid()) == []
    assert shm_entries() - shm_before == set()  # nothing new (others may remove theirs)
    assert memfds_of() == []


def test_compile_results_say_where_the_worker_spent_its_time(
    programs: list[LoweredProgram],
) -> None:
    with Pool(workers=1) as pool:
        compiled = pool.submit_compile(programs[0]).result()
        again = pool.submit_compile(programs[0]).result()
    with Pool(workers=1) as pool:
        loaded = pool.submit_compile(programs[0]).result()
    assert compiled.statistics.compiled == 1 and compiled.phases is not None
    assert {"key", "lookup", "compile", "serialize", "publish"} <= set(compiled.phases)
    assert compiled.phases["compile"] > 0
    assert again.phases is None  # the worker had it loaded: nothing was timed
    assert loaded.statistics.loaded == 1 and loaded.phases is not None
    assert "lookup" in loaded.phases and "compile" not in loaded.phases
