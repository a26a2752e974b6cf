"""A thread waiting in a run's Future.result() reads the task's reply itself.

pool.executor.futures.TaskFuture: the waiting thread takes the worker's socket
over from the manager thread and reads the reply, as Pool.run does, so the
result costs no wake-up of the manager and then of the waiting thread. What
users rely on stays: done-callbacks run on the manager thread, a timeout or a
Ctrl-C while waiting leaves the task running, and the manager never mistakes a
reply that a caller read for a worker's end.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeoutError

import numpy as np
import pytest
from conftest import child, printed
from pool_helpers import handler_initializer, milliseconds, scale_program, sleep_program

from pool import Pool
from pool.executor.wait_set import WaitSet


def pids(pool: Pool) -> list[int]:
    return [info["pid"] for info in pool.worker_info]


def test_result_reads_the_reply_in_the_waiting_thread_and_callbacks_run_on_the_manager(
    handlers: str,
) -> None:
    # Each task sleeps 100 ms, so every result() is called before the reply comes
    # (when it comes first, the manager may rightly read it), even on a busy machine.
    sleeper = sleep_program()
    with Pool(1, initializer=handler_initializer(handlers)) as pool:
        pool.run(sleeper, [milliseconds(1)])
        readers: list[str] = []
        receive = pool._dispatcher.receive

        def recording_receive(worker):  # the real receive, noting the thread that reads
            readers.append(threading.current_thread().name)
            return receive(worker)

        pool._dispatcher.receive = recording_receive  # type: ignore[method-assign]
        callback_threads: list[str] = []
        late: list[bool] = []  # whether this thread came to result() past half the task's time
        for step in range(20):
            x = milliseconds(100 + step % 2)
            sent = time.monotonic()
            future = pool.submit(sleeper, [x])
            future.add_done_callback(
                lambda f: callback_threads.append(threading.current_thread().name)
            )
            late.append(time.monotonic() - sent > 0.05)
            np.testing.assert_array_equal(future.result()[0], x)
        deadline = time.monotonic() + 10
        while len(callback_threads) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
    # Before TaskFuture, the manager thread read every reply of a submitted task. A reply
    # that came before result() was called, this thread held off the CPU past the task's
    # 100 ms (seen while .ci/run's legs and another suite shared 2 CPUs), the manager may
    # rightly read; such a call is let off, as long as most calls come in time.
    assert len(readers) == 20 and late.count(True) <= 5, (readers, late)
    in_time = [reader for reader, was_late in zip(readers, late, strict=True) if not was_late]
    assert in_time == ["MainThread"] * len(in_time), (readers, late)
    assert callback_threads == ["pjrt-pool-manager"] * 20, callback_threads


def test_a_result_timeout_gives_the_worker_back_and_the_task_runs_on(handlers: str) -> None:
    sleeper, quick = sleep_program(), scale_program(2.0)
    with Pool(1, initializer=handler_initializer(handlers)) as pool:
        pool.run(sleeper, [milliseconds(1)])
        before = pids(pool)
        future = pool.submit(sleeper, [milliseconds(1500)])
        started = time.monotonic()
        with pytest.raises(FutureTimeoutError):
            future.result(timeout=0.2)
        waited = time.monotonic() - started
        assert 0.2 <= waited < 1.2, waited
        # Another thread waits too; the first reader's timeout left the socket to whoever
        # comes next, and both see the one result.
        other: list[object] = []
        helper = threading.Thread(target=lambda: other.append(future.result(timeout=30)))
        helper.start()
        assert future.result(timeout=30)[0].shape == (1,)
        helper.join(30)
        assert len(other) == 1
        quick_result = pool.submit(quick, [np.ones(8)]).result()[0]
        np.testing.assert_array_equal(quick_result, np.full(8, 3.0))
        assert pids(pool) == before  # nobody killed the worker


def test_ctrl_c_while_waiting_for_a_result_leaves_the_task_running(handlers: str) -> None:
    done = child(
        """
        sleeper = sleep_program()
        pool = Pool(workers=1, initializer=handler_initializer(handlers))
        pool.run(sleeper, [milliseconds(1)])
        before = [info["pid"] for info in pool.worker_info]
        main = threading.get_ident()
        future = pool.submit(sleeper, [milliseconds(1500)])
        threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT)).start()
        try:
            future.result()
            print("not interrupted", flush=True)
        except KeyboardInterrupt:
            print("interrupted, done:", future.done(), flush=True)
        print("then:", future.result(timeout=30)[0].shape, flush=True)
        print("same worker:", [info["pid"] for info in pool.worker_info] == before, flush=True)
        print("next:", pool.submit(sleeper, [milliseconds(1)]).result(timeout=30)[0].shape)
        pool.close()
        """,
        handlers,
        timeout=90,
    )
    assert "interrupted, done: False" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "then: (1,)" in done.stdout, done.stdout + done.stderr[-2000:]
    printed(done, "same worker: True", "next: (1,)")


def test_a_reply_the_waiting_thread_read_first_is_not_taken_for_the_workers_end() -> None:
    # The manager's wait reports a reply; before the manager turns to it, the thread
    # waiting for the result takes the socket over and reads it, and the worker is
    # idle again. The manager then took the report for an idle worker's end of file
    # and retired the worker. Here the manager sleeps at that moment (a trace on its
    # thread), so that the waiting thread reads first every time.
    from pool.executor.manager import Manager

    code, armed = Manager._on_readable.__code__, threading.Event()

    def trace(frame, event, arg):
        if frame.f_code is code and event == "call" and armed.is_set():
            armed.clear()
            time.sleep(0.2)  # the GIL is free: the waiting thread reads the reply meanwhile
        return None

    program = scale_program(2.0)
    threading.settrace(trace)  # the manager thread, started next, runs it
    try:
        pool = Pool(1)
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
    try:
        pool.run(program, [np.ones(8, np.float32)])
        before = pids(pool)
        for step in range(3):
            armed.set()
            future = pool.submit(program, [np.full(8, step, np.float32)])
            time.sleep(0.05)  # the reply comes and the manager's wait reports it
            assert future.result(timeout=30)[0][0] == step * 2.0 + 1.0
            time.sleep(0.3)  # the manager wakes and turns to the report
            # It was: dying, and the manager blocked for good reading the idle worker.
            assert pool.worker_info[0]["state"] == "idle", f"round {step}"
            assert pids(pool) == before, f"the worker was replaced after round {step}"
        pool.close()
    finally:
        pool.terminate()  # kills the workers: a manager stuck reading one reads its end


@pytest.mark.parametrize("workers", [1, 2])
def test_replies_read_by_waiting_threads_never_look_like_a_dead_worker(workers: int) -> None:
    # The manager's wait can report a reply that a waiting thread then takes the
    # socket over for and reads; if the manager then took the worker, now idle, for
    # one that sent its end of file, it retired it (and its replacement cost 0.4 s).
    program = scale_program(2.0)
    with Pool(workers) as pool:
        for _ in range(workers):
            pool.run(program, [np.ones(8, np.float32)])
        before = sorted(pids(pool))
        wrong: list[str] = []
        deadline = time.monotonic() + 60

        def calls(first: int) -> None:
            for step in range(first, first + 200):
                x = np.full(8, step, np.float32)
                future = pool.submit(program, [x])
                if step % 3 == 0:
                    future.add_done_callback(lambda f: None)
                try:
                    got = future.result(timeout=max(0.0, deadline - time.monotonic()))[0]
                except Exception as error:
                    wrong.append(f"{step}: {error!r}")
                    return
                if not np.array_equal(got, x * 2.0 + 1.0):
                    wrong.append(f"{step}: {got}")

        threads = [threading.Thread(target=calls, args=(1000 * i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()) + 5)
        assert wrong == []
        assert sorted(pids(pool)) == before  # no worker was retired or replaced
        assert [info["state"] for info in pool.worker_info] == ["idle"] * workers


def test_callbacks_of_results_read_just_before_close_run_before_it_returns(handlers: str) -> None:
    # The run sleeps 50 ms so that its callback is added before it ends (one added
    # to a done future runs at once, in the caller's thread).
    sleeper = sleep_program()
    for _ in range(5):
        ran: list[str] = []
        pool = Pool(1, initializer=handler_initializer(handlers))
        future = pool.submit(sleeper, [milliseconds(50)])
        assert not future.done()
        future.add_done_callback(lambda f, ran=ran: ran.append(threading.current_thread().name))
        future.result(timeout=30)
        pool.close()
        assert ran == ["pjrt-pool-manager"], ran


def test_a_socket_given_back_while_the_manager_looks_at_a_stale_report_stays_watched() -> None:
    # The manager's wait collected a worker's reply; before it looked the socket
    # up, a caller took it over (out of the set), read the reply, and another
    # caller's claim gave it back (into the set). The wait, finding no value at
    # its look, unregistered the descriptor: the socket stayed out of the epoll
    # set while the pool counted it in, and the worker's next reply was never
    # read (CI's jax012 leg: a future past its 60 s and a close() that hung, with
    # the reply's 22 bytes unread). Here the take-over and the give-back land
    # exactly at that look.
    wait_set = WaitSet()
    ours, theirs = socket.socketpair()
    fd = ours.fileno()

    class GivenBackAtTheLook(dict):
        armed = True

        def get(self, key, default=None):
            found = super().get(key, default)
            if key == fd and GivenBackAtTheLook.armed:
                GivenBackAtTheLook.armed = False
                wait_set.remove(fd)  # a caller takes the socket over (and reads the reply)
                wait_set.add(fd, "worker")  # a claim gives it back to the manager
                found = default  # what the look saw: the take-over came first
            return found

    try:
        wait_set._what = GivenBackAtTheLook()
        wait_set.add(fd, "worker")
        theirs.sendall(b"a reply")
        assert wait_set.wait(1.0) == []  # a stale report, dropped
        assert wait_set.wait(1.0) == ["worker"]  # the next reply is seen
    finally:
        wait_set.close()
        ours.close()
        theirs.close()


def test_a_take_over_as_the_manager_begins_a_wait_never_passes_for_a_fresh_report(
    handlers: str,
) -> None:
    # A take-over was counted before its socket left the manager's set. A wait
    # the manager began between the two took the count as it now was, and saw
    # the reply that the caller then read: that report passed as fresh, so the
    # manager read the socket of the worker the caller had freed (idle: marked
    # dying) and blocked on it for good. The manager is held here right before
    # its count is read, let go inside the take-over, and held again after its
    # wait until the caller has read the reply.
    done = child(
        """
        pool, sleeper, quick, x = warmed_pool(handlers)
        starts, wait_set = pool._starts, pool._wait_set
        hold, held, go, polled, read = (threading.Event() for _ in range(5))
        due, wait, remove = starts.respawn_due, wait_set.wait, wait_set.remove

        def held_before_the_count():  # the manager's turn, right before it reads the count
            if hold.is_set():
                hold.clear()
                held.set()
                go.wait(10)
                watching[0] = True
            return due()

        def held_after_the_wait(timeout):
            found = wait(timeout)
            while watching[0] and not found:  # a wake-up left in the pipe: wait for the reply
                found = wait(timeout)
            if watching[0]:
                watching[0] = False
                polled.set()
                read.wait(10)
            return found

        def let_go_inside_the_take_over(fd):
            if taking[0] and threading.current_thread() is threading.main_thread():
                taking[0] = False
                go.set()
                polled.wait(10)
            remove(fd)

        on_readable, handled = pool._manager._on_readable, threading.Event()

        def noted(worker, takeovers):  # the manager's handling of the report
            on_readable(worker, takeovers)
            handled.set()

        watching, taking = [False], [False]
        pool._manager._on_readable = noted
        starts.respawn_due = held_before_the_count
        wait_set.wait = held_after_the_wait
        wait_set.remove = let_go_inside_the_take_over
        hold.set()
        wait_set.wake()
        assert held.wait(10)
        future = pool.submit(sleeper, [milliseconds(50)])
        time.sleep(0.3)  # its reply waits in the socket: the manager is held
        taking[0] = True
        print("result:", future.result(timeout=10)[0].tolist(), flush=True)
        read.set()
        # Before the next submit claims the worker: the manager handles the report (or,
        # taking it for fresh, blocks reading the idle worker's socket).
        handled.wait(2)
        print("polled:", polled.is_set(), flush=True)
        try:
            print("next:", float(pool.submit(quick, [x]).result(timeout=10)[0][0]), flush=True)
        except Exception as error:
            print("next run stalled:", repr(error), flush=True)
        print("states:", [w["state"] for w in pool.worker_info], flush=True)
        pool.terminate()
        """,
        handlers,
        timeout=90,
    )
    printed(done, "result: [50.0]", "polled: True", "next: 3.0", "states: ['idle']")
