"""The pool under threads, interrupts and faults: right results, no hangs, bounded resources.

Each test reproduces a case that returned wrong numbers, hung or leaked
before the pool's dispatch was redesigned (one owner per worker, one
completion per task). Scenarios that hung run in a child process with a
timeout, so that a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, child
from pool_helpers import (
    alive,
    fast_math_options,
    handler_initializer,
    isnan_program,
    sds,
)

from pool import (
    LoweredProgram,
    Pool,
    ProgramQuarantinedError,
    WorkerCrashedError,
    compile_program,
    lower,
)

TESTS = Path(__file__).resolve().parent


# -- 1. arguments are copied when submit returns ------------------------------


@pytest.mark.parametrize("size", [64, 100_000], ids=["arena", "segment"])
def test_a_result_reflects_the_arguments_as_they_were_at_submit(size: int) -> None:
    program = lower(lambda x: x * 2.0, [sds(size)])
    buffer = np.zeros(size, np.float32)
    with Pool(workers=1) as pool:
        futures = []
        for i in range(100):
            buffer[:] = i
            futures.append(pool.submit(program, [buffer]))
        buffer[:] = -1
        wrong = [i for i, f in enumerate(futures) if not np.all(f.result(timeout=60)[0] == 2 * i)]
    assert wrong == []


# -- 2. compile options are part of a program's identity -----------------------


def test_compile_options_are_part_of_a_program_s_identity() -> None:
    program = isnan_program()
    x = np.array([np.nan, 1.0, np.nan, 1.0], np.float32)
    with Pool(workers=1) as pool:
        fast = pool.submit_compile(program, compile_options=fast_math_options()).result().spec
        plain = pool.compile(program)
        # The premise: fast math really computes something else for this program.
        np.testing.assert_array_equal(pool.submit_spec(fast, [x]).result()[0], [0, 0, 0, 0])
        np.testing.assert_array_equal(pool.run(program, [x])[0], [11, 0, 11, 0])
        np.testing.assert_array_equal(pool.submit_spec(plain, [x]).result()[0], [11, 0, 11, 0])
        fast_again = pool.submit_compile(program, compile_options=fast_math_options()).result().spec
    assert fast.key != plain.key and fast_again.key == fast.key
    executable, _ = compile_program(program, compile_options=fast_math_options())
    assert executable.key == fast.key
    executable, _ = compile_program(program)
    assert executable.key == plain.key


# -- 3. Ctrl-C inside Pool.run -------------------------------------------------


@pytest.mark.parametrize("ending", ["close", "terminate", "with", "exit"])
def test_ctrl_c_inside_run_leaves_a_pool_that_stops_promptly(ending: str) -> None:
    body = {
        "close": "pool.close()",
        "terminate": "pool.terminate()",
        "with": "pass",  # the with statement below closes the pool
        "exit": "sys.exit(0)",  # interpreter exit stops live pools
    }[ending]
    script = textwrap.dedent(f"""
        import sys, time
        import numpy as np
        sys.path.insert(0, {str(TESTS)!r})
        from pool_helpers import spin_program
        from pool import Pool
        program = spin_program()
        def scenario(pool):
            pool.compile(program)
            print("pids", *[w["pid"] for w in pool.worker_info], flush=True)
            try:
                pool.run(program, [np.ones(1, np.float32)])
            except KeyboardInterrupt:
                print("interrupted", flush=True)
        if {ending!r} == "with":
            try:
                with Pool(workers=1) as pool:
                    scenario(pool)
                    raise KeyboardInterrupt
            except KeyboardInterrupt:
                pass
        else:
            pool = Pool(workers=1)
            scenario(pool)
        started = time.monotonic()
        {body}
        print(f"stopped in {{time.monotonic() - started:.2f}} s", flush=True)
    """)
    environment = dict(os.environ, PYTHONPATH=str(REPO))
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("pids"), line + process.stderr.read()
        pids = [int(p) for p in line.split()[1:]]
        time.sleep(1.0)  # the run is under way in the worker
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"the pool did not stop after Ctrl-C ({ending}):\n{out}\n{err[-3000:]}")
    assert process.returncode == 0, err[-3000:]
    assert "interrupted" in out
    assert ("stopped in" in out) == (ending != "exit")  # exit: atexit stops the pool
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a worker outlived its pool"
        time.sleep(0.05)


# -- 4. close() while another thread is inside run ------------------------------


def test_close_from_another_thread_returns_when_the_run_ends(handlers: str) -> None:
    done = child(
        """
        program = sleep_program()
        pool = Pool(workers=1, initializer=handler_initializer(handlers))
        pool.run(program, [milliseconds(1)])
        results = []
        runner = threading.Thread(
            target=lambda: results.append(pool.run(program, [milliseconds(1500)])[0][0])
        )
        runner.start()
        time.sleep(0.5)
        started = time.monotonic()
        pool.close()
        print(f"closed after {time.monotonic() - started:.2f} s, result {results}")
        runner.join()
        assert results == [1500.0], results
        """,
        handlers,
        timeout=60,
    )
    assert "closed after" in done.stdout


# -- 5. deadlines are enforced whoever dispatched the task ----------------------


def test_a_timeout_holds_for_a_task_a_finishing_run_dispatched(handlers: str) -> None:
    done = child(
        """
        sleeper, spin = sleep_program(), spin_program()
        pool = Pool(workers=1, initializer=handler_initializer(handlers))
        pool.compile(spin)
        pool.run(sleeper, [milliseconds(1)])
        runner = threading.Thread(target=pool.run, args=(sleeper, [milliseconds(800)]))
        runner.start()
        time.sleep(0.3)
        started = time.monotonic()
        doomed = pool.submit(spin, [np.ones(1)], timeout=1.0)  # queued behind the run
        try:
            doomed.result(timeout=30)
        except TaskTimeoutError:
            print(f"timed out after {time.monotonic() - started:.1f} s", flush=True)
        runner.join()
        pool.close()
        print("closed", flush=True)
        """,
        handlers,
    )
    assert "timed out after" in done.stdout
    assert float(done.stdout.split()[3]) < 10


# -- 6. timeout values are checked before anything is claimed --------------------


def test_bad_timeouts_are_refused_up_front_and_the_pool_goes_on() -> None:
    done = child(
        """
        program = scale_program(2.0)
        x = np.ones(8, np.float32)
        with Pool(workers=1) as pool:
            for bad, kind in [(float("nan"), ValueError), ("5", TypeError), (0, ValueError),
                              (-1.0, ValueError), (True, TypeError), (float("-inf"), ValueError)]:
                for call in (pool.submit, pool.run):
                    try:
                        call(program, [x], timeout=bad)
                    except kind as error:
                        assert "timeout" in str(error), error
                    else:
                        raise AssertionError(f"timeout={bad!r} was accepted")
                try:
                    pool.submit_compile(program, timeout=bad)
                except kind:
                    pass
                else:
                    raise AssertionError(f"timeout={bad!r} was accepted by submit_compile")
            # inf means no bound
            assert pool.submit(program, [x], timeout=float("inf")).result()[0][0] == 3.0
            assert pool.run(program, [x])[0][0] == 3.0
        for bad in (float("nan"), "5", 0):
            try:
                Pool(workers=1, task_timeout=bad)
            except (TypeError, ValueError) as error:
                assert "task_timeout" in str(error)
            else:
                raise AssertionError(f"task_timeout={bad!r} was accepted")
        print("ok")
        """
    )
    assert done.stdout.strip() == "ok"


# -- 7. a task that finishes as its deadline passes ------------------------------


@pytest.mark.slow
def test_a_task_finishing_at_its_deadline_never_harms_the_next(handlers: str) -> None:
    done = child(
        """
        sleeper = sleep_program()
        quick = scale_program(2.0)
        x = np.ones(8, np.float32)
        outcomes = {"result": 0, "timeout": 0}
        stop = []

        def hold_the_gil():  # delays the manager's reaction, as a busy parent does
            while not stop:
                sum(range(1000))

        threading.Thread(target=hold_the_gil, daemon=True).start()
        with Pool(workers=1, initializer=handler_initializer(handlers)) as pool:
            pool.compile(quick)
            for attempt in range(30):
                ms = 197.0 + attempt % 7  # around the 0.2 s deadline
                timed = pool.submit(sleeper, [milliseconds(ms)], timeout=0.2)
                after = pool.submit(quick, [x])  # queued behind it, no timeout
                try:
                    assert timed.result(timeout=30)[0][0] == ms
                    outcomes["result"] += 1
                except TaskTimeoutError:
                    outcomes["timeout"] += 1
                # The next task must simply work, whatever happened to the first.
                assert after.result(timeout=30)[0][0] == 3.0
                assert pool.run(quick, [x])[0][0] == 3.0
        stop.append(True)
        print(outcomes)
        """,
        handlers,
        timeout=180,
    )
    assert "result" in done.stdout


# -- 8. a task completes exactly once --------------------------------------------


def exit_after_each_reply():
    """A worker initializer: the worker exits right after sending each reply."""

    def initialize() -> None:
        import os as worker_os

        from worker.serve import server

        send = server.protocol.send_frame

        def send_then_exit(sock, message, fds=()):
            send(sock, message, fds)
            if type(message).__name__ == "Reply":
                worker_os._exit(0)

        server.protocol.send_frame = send_then_exit

    return initialize


def test_a_worker_dying_right_after_its_reply_costs_no_task() -> None:
    program = lower(lambda x: x + 1.0, [sds(4)])
    x = np.arange(4, dtype=np.float32)
    with Pool(workers=1, initializer=exit_after_each_reply(), max_crashes=1) as pool:
        for _ in range(6):
            np.testing.assert_array_equal(pool.run(program, [x])[0], x + 1)
            np.testing.assert_array_equal(pool.submit(program, [x]).result(timeout=60)[0], x + 1)


# -- 9. a worker that died idle is not blamed on the next task --------------------


def test_a_worker_killed_while_idle_is_not_blamed_on_the_next_task() -> None:
    program = lower(lambda x: x + 1.0, [sds(4)])
    x = np.arange(4, dtype=np.float32)
    with Pool(workers=1, max_crashes=2) as pool:
        pool.run(program, [x])
        for _ in range(3):
            pid = pool.worker_info[0]["pid"]
            os.kill(pid, signal.SIGKILL)
            np.testing.assert_array_equal(pool.run(program, [x])[0], x + 1)
        for _ in range(3):
            os.kill(pool.worker_info[0]["pid"], signal.SIGKILL)
            np.testing.assert_array_equal(pool.submit(program, [x]).result(timeout=60)[0], x + 1)


def test_a_worker_killed_before_it_began_its_task_sends_the_task_elsewhere() -> None:
    program = lower(lambda x: x * 3.0, [sds(4)])
    x = np.arange(4, dtype=np.float32)
    with Pool(workers=1, max_crashes=1) as pool:
        pool.run(program, [x])
        pid = pool.worker_info[0]["pid"]
        os.kill(pid, signal.SIGSTOP)  # it cannot take up what it is sent
        try:
            future = pool.submit(program, [x])
            (info,) = pool.worker_info
        finally:
            os.kill(pid, signal.SIGKILL)  # even if the lines above fail: close() would wait
        assert (info["task"], info.get("started")) == (program.name, False)
        # Not the program's fault: a replacement runs it (and nothing is quarantined).
        np.testing.assert_array_equal(future.result(timeout=60)[0], x * 3)
        assert pool.worker_info[0]["pid"] != pid
        np.testing.assert_array_equal(pool.run(program, [x])[0], x * 3)


# -- 10. a stopped worker does not outlive its parent ----------------------------


def test_a_stopped_worker_dies_with_its_killed_parent() -> None:
    script = textwrap.dedent("""
        import time
        from pool import Pool
        pool = Pool(workers=2)
        print(" ".join(str(w["pid"]) for w in pool.worker_info), flush=True)
        time.sleep(600)
    """)
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert process.stdout is not None
    pids = [int(p) for p in process.stdout.readline().split()]
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGSTOP)
    process.kill()
    process.wait()
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            for pid in pids:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            pytest.fail("a stopped worker outlived its SIGKILLed parent")
        time.sleep(0.05)


# -- 11. descriptors stay bounded -------------------------------------------------


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
def test_many_queued_large_inputs_fit_the_default_descriptor_limit() -> None:
    done = child(
        """
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
        size = 70_000  # 280 KB: more than the arena takes
        program = lower(lambda x: x * 2.0, [sds(size)])
        before = len(os.listdir("/proc/self/fd"))
        with Pool(workers=1) as pool:
            buffer = np.empty(size, np.float32)
            futures = []
            for i in range(2000):
                buffer[:] = i
                futures.append(pool.submit(program, [buffer]))
            peak = len(os.listdir("/proc/self/fd"))
            wrong = [i for i, f in enumerate(futures) if f.result(timeout=120)[0][0] != 2 * i]
            assert wrong == [], wrong[:10]
            del futures
            idle = len(os.listdir("/proc/self/fd"))
        print("fds", before, peak, idle)
        assert peak - before < 200, (before, peak)
        assert idle - before < 120, (before, idle)
        """,
        timeout=300,
    )
    assert done.stdout.startswith("fds")


def test_live_large_results_hold_a_bounded_number_of_descriptors() -> None:
    program = lower(lambda x: x.sum() + x, [sds(1 << 19)])  # 2 MiB output: its own segment
    x = np.ones(1 << 19, np.float32)
    for bound, settings in ((64, {}), (8, {"segment_fds": 8})):  # the default, and a chosen one
        with Pool(workers=1, **settings) as pool:
            pool.run(program, [x])
            before = open_descriptors()
            kept = [pool.run(program, [x])[0] for _ in range(150)]
            during = open_descriptors()
            assert all(float(a[0]) == float(1 << 19) + 1 for a in kept)
            del kept
            after = open_descriptors()
        assert during - before <= bound + 4, (bound, before, during)
        assert after - before <= bound + 4, (bound, before, after)


def test_running_out_of_descriptors_is_a_clear_error() -> None:
    done = child(
        """
        program = lower(lambda x: x.sum() + x, [sds(1 << 19)])
        x = np.ones(1 << 19, np.float32)
        with Pool(workers=1) as pool:
            # No segment to recycle: the second run's outputs went to the segment its input
            # was copied into, the one the first run gave back, and are held.
            kept = [pool.run(program, [np.zeros(1 << 19, np.float32)]) for _ in range(2)]
            held = take_every_descriptor()
            try:
                pool.run(program, [x])
            except OSError as error:
                print("error:", error)
            else:
                print("no error")
            give_back_descriptors(held)
            assert pool.run(program, [x])[0][0] == float(1 << 19) + 1
        """
    )
    line = next(line for line in done.stdout.splitlines() if line.startswith(("error", "no")))
    assert "descriptor" in line and "limit" in line, line


# -- 12. the program identity memo does not keep programs alive -------------------


def test_dropped_programs_are_not_kept_alive_by_their_identity_memo() -> None:
    from pool.executor.programs import program_id

    tracemalloc.start()
    try:
        for i in range(40):
            text = f"module @m{i}" + " " * (10 << 20)
            program_id(LoweredProgram(code=b"\0", text=text, input_types=(), platform="cpu"))
            del text
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 64 << 20, f"{held / 2**20:.0f} MiB still held"


# -- device errors leave a worker unusable (issue 11) ------------------------------


def test_a_device_error_retires_the_worker_and_counts_as_a_crash(handlers: str) -> None:
    from pool_helpers import custom_call_program

    failing = custom_call_program("device_error")
    adder = custom_call_program("add_one")
    x = np.ones(8, np.float32)
    with Pool(workers=1, initializer=handler_initializer(handlers), max_crashes=2) as pool:
        np.testing.assert_array_equal(pool.run(adder, [x])[0], x + 1)
        for attempt in range(2):
            pid = pool.worker_info[0]["pid"]
            with pytest.raises(WorkerCrashedError, match="CUDA_ERROR_ILLEGAL_ADDRESS") as caught:
                pool.run(failing, [x])
            assert "device" in str(caught.value)
            assert ("quarantined" in str(caught.value)) == (attempt == 1)
            np.testing.assert_array_equal(pool.run(adder, [x])[0], x + 1)
            assert pool.worker_info[0]["pid"] != pid and not alive(pid)
        with pytest.raises(ProgramQuarantinedError):
            pool.run(failing, [x])


# -- replacements: close() with queued tasks, and a replacement that cannot start ----


def test_close_runs_queued_tasks_after_the_only_worker_crashed(handlers: str) -> None:
    done = child(
        """
        import jax

        def sleep_then_crash(x):
            slept = jax.ffi.ffi_call("sleep_ms", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
            return jax.ffi.ffi_call("null_deref", jax.ShapeDtypeStruct(x.shape, x.dtype))(slept)

        crasher = lower(sleep_then_crash, [sds(8)], custom_calls=["sleep_ms", "null_deref"])
        quick = scale_program(2.0)
        pool = Pool(workers=1, initializer=handler_initializer(handlers))
        pool.compile(crasher)
        doomed = pool.submit(crasher, [milliseconds(500, 8)])
        queued = [pool.submit(quick, [np.ones(8)]) for _ in range(3)]
        pool.close()  # before the crash: it must still run what is queued
        assert isinstance(doomed.exception(), WorkerCrashedError)
        assert [f.result()[0][0] for f in queued] == [3.0] * 3
        print("closed")
        """,
        handlers,
        timeout=60,
    )
    assert "closed" in done.stdout


def test_a_replacement_that_cannot_start_is_tried_again() -> None:
    done = child(
        """
        program = scale_program(2.0)
        with Pool(workers=1) as pool:
            pool.run(program, [np.ones(8)])
            # No descriptor left: the replacement's shared memory cannot be made.
            held = take_every_descriptor()
            os.kill(pool.worker_info[0]["pid"], signal.SIGKILL)
            time.sleep(0.5)
            give_back_descriptors(held)
            assert pool.submit(program, [np.ones(8)]).result(timeout=30)[0][0] == 3.0
        print("recovered")
        """,
        timeout=60,
    )
    assert "recovered" in done.stdout
