"""Dispatch ahead: a run that keeps every output returns its handles once it is sent.

Real workers, the CPU plugin. A worker stopped with SIGSTOP reads no request
and sends no reply, which keeps runs in flight for as long as a test needs:
on a pool without dispatch ahead the first kept run under SIGSTOP would wait
for its reply, so every test here fails there. Each call that could hang runs
in a daemon thread joined with a timeout, so that a hang fails the test.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import child, printed

from pool import Pool, WorkerCrashedError

WIDTH = 8


def _register(library: str) -> Callable[[], None]:
    """An initializer (for Pool) that registers the test library's fail_if_negative."""

    def register() -> None:
        from worker import register_custom_call

        handlers = ctypes.CDLL(library)
        address = ctypes.cast(handlers.fail_if_negative, ctypes.c_void_p).value
        register_custom_call("fail_if_negative", address)

    return register


def add_step(w: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A training step's shape: new parameters and a loss, both kept."""
    return w + x, jnp.sum(x)


def failing_step(w: jax.Array, x: jax.Array) -> tuple[jax.Array]:
    """w + x + 1, failing in the worker (fail_if_negative) when x[0] < 0."""
    checked = jax.ffi.ffi_call("fail_if_negative", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    return (w + checked,)


@pytest.fixture(scope="module")
def pool(handlers: str) -> Iterator[Pool]:
    with Pool(1, initializer=_register(handlers)) as pool:
        yield pool


@pytest.fixture(scope="module")
def step(pool: Pool) -> Any:
    """add_step through the pool, every output kept, run twice: later runs go ahead."""
    kept = pool.function(add_step, keep=True)
    w = np.zeros(WIDTH, np.float32)
    for _ in range(2):
        w, _ = kept(w, np.ones(WIDTH, np.float32))
    np.asarray(w)  # its reply read: no run in flight
    return kept


def pid_of(pool: Pool) -> int:
    return pool.worker_info[0]["pid"]


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The worker stopped (SIGSTOP) for the block, continued after it whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def within(call: Callable[[], Any], seconds: float) -> tuple[bool, list[Any]]:
    """Runs call() in a daemon thread: whether it returned within `seconds`, and (once it
    has) what it returned or raised, in the list."""
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append(call())
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), outcome


def sent(call: Callable[[], Any]) -> Any:
    """call()'s result, which must come back within seconds although the worker is stopped
    (a run sent ahead of its reply): a call that waits fails the test instead of hanging it."""
    returned, outcome = within(call, 5)
    assert returned, "a kept run waited for its reply"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def wait_for(condition: Callable[[], bool], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true"
        time.sleep(0.01)


def test_kept_runs_return_before_their_replies(pool: Pool, step: Any) -> None:
    w = pool.put(np.zeros(WIDTH, np.float32))
    batches = [np.full(WIDTH, i + 1, np.float32) for i in range(4)]
    made = []
    with stopped(pid_of(pool)):
        for batch in batches[:3]:
            made.append(sent(lambda b=batch: step(w if not made else made[-1][0], b)))
        assert pool.worker_info[0]["ahead"] == 3
        # A fourth waits: three are in flight at most (dispatch_ahead).
        fourth, outcome = within(lambda: step(made[-1][0], batches[3]), 0.3)
        assert not fourth
    wait_for(lambda: bool(outcome))
    made.append(outcome[0])
    expected = np.zeros(WIDTH, np.float32)
    for (params, loss), batch in zip(made, batches, strict=True):
        expected = expected + batch
        np.testing.assert_array_equal(np.asarray(params), expected)
        assert float(np.asarray(loss)) == batch.sum()
    wait_for(lambda: pool.worker_info[0]["state"] == "idle")


@pytest.mark.parametrize("elements", [WIDTH, 40_000, 150_000], ids=["arena", "third", "segment"])
def test_runs_ahead_keep_their_own_inputs(pool: Pool, elements: int) -> None:
    # Small inputs go into the worker's arena, each run sent ahead in a region of its own;
    # 160 KB ones are more than a third of the arena's share; 600 KB ones a segment each.
    kept = pool.function(add_step, keep=True)
    w = np.zeros(elements, np.float32)
    for _ in range(2):
        w, _ = kept(w, np.ones(elements, np.float32))
    np.asarray(w)  # its reply read: no run in flight
    batches = [np.arange(elements, dtype=np.float32) * (i + 2) for i in range(3)]
    outputs = []
    with stopped(pid_of(pool)):
        for batch in batches:
            outputs.append(sent(lambda b=batch: kept(w, b)))
            batch[:] = -1  # the caller's array changes once the call returned: the run's not
        assert pool.worker_info[0]["ahead"] == 3
    for (params, _), factor in zip(outputs, range(2, 5), strict=True):
        np.testing.assert_array_equal(
            np.asarray(params), 2 + np.arange(elements, dtype=np.float32) * factor
        )


def test_a_failed_run_fails_its_values_and_the_runs_sent_after_it(pool: Pool) -> None:
    failing = pool.function(failing_step, keep=True, custom_calls=["fail_if_negative"])
    ones = np.ones(WIDTH, np.float32)
    (w,) = failing(np.zeros(WIDTH, np.float32), ones)
    (w,) = failing(w, ones)
    np.asarray(w)  # its reply read: no run in flight
    pid = pid_of(pool)
    with stopped(pid):
        (first,) = sent(lambda: failing(w, -ones))
        (second,) = sent(lambda: failing(first, ones))  # names a value never to be made
        (third,) = sent(lambda: failing(second, ones))
    with pytest.raises(Exception, match="fail_if_negative: the input starts negative") as raised:
        np.asarray(third)
    assert "dispatch_ahead" in "".join(getattr(raised.value, "__notes__", []))
    with pytest.raises(Exception, match="the input starts negative"):
        failing(second, ones)
    assert "failed" in repr(first)
    assert pid_of(pool) == pid  # a run's failure is not a crash
    (fresh,) = failing(pool.put(np.zeros(WIDTH, np.float32)), ones)
    np.testing.assert_array_equal(np.asarray(fresh), 2 * ones)
    np.testing.assert_array_equal(np.asarray(w), 4 * ones)  # made before: untouched


def test_a_fetch_waits_for_the_runs_ahead_of_it(pool: Pool, step: Any) -> None:
    w = pool.put(np.zeros(WIDTH, np.float32))
    ones = np.ones(WIDTH, np.float32)
    with stopped(pid_of(pool)):
        for _ in range(3):
            w, _ = sent(lambda w=w: step(w, ones))
        fetched, array = within(lambda: np.asarray(w), 0.3)
        assert not fetched  # a fetch waits for its reply, and for those before it
        plain, losses = within(lambda: pool.function(add_step, keep=0)(w, ones), 0.1)
        assert not plain
    wait_for(lambda: bool(array) and bool(losses))
    np.testing.assert_array_equal(array[0], 3 * ones)
    params, total = losses[0]
    np.testing.assert_array_equal(np.asarray(params), 4 * ones)
    assert isinstance(total, np.ndarray) and float(total) == WIDTH
    moved = pool.put(np.ones(WIDTH, np.float32), like=w)
    np.testing.assert_array_equal(np.asarray(step(moved, ones)[0]), 2 * ones)
    # A submit taking a value while runs are out goes through the manager.
    w, _ = step(w, ones)
    submitted = pool.submit(step.lower(w, ones), [w, ones], keep=(0, 1)).result(20)
    np.testing.assert_array_equal(np.asarray(submitted[0]), 5 * ones)


def test_values_dropped_while_runs_are_in_flight(pool: Pool, step: Any) -> None:
    w = pool.put(np.zeros(WIDTH, np.float32))
    ones = np.ones(WIDTH, np.float32)
    for index in range(200):
        w, _ = step(w, ones)
        if index % 50 == 0:
            gc.collect()
    np.testing.assert_array_equal(np.asarray(w), 200 * ones)
    pool.run(step.lower(w, ones), [w, ones], keep=(0, 1))  # brings the last drops
    wait_for(lambda: pool.worker_info[0]["values"] <= 4, 5)


def test_results_are_those_of_a_pool_that_waits_for_every_reply(pool: Pool) -> None:
    def mlp_step(w: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        loss, grad = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * grad, loss

    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((16, 16)).astype(np.float32)
    batches = [rng.standard_normal((4, 16)).astype(np.float32) for _ in range(30)]
    results = []
    with Pool(1, dispatch_ahead=0) as waiting:
        for each in (pool, waiting):
            kept = each.function(mlp_step, keep=True)
            w, losses = w0, []
            for batch in batches:
                w, loss = kept(w, batch)
                losses.append(loss)
            results.append((np.asarray(w), [float(np.asarray(loss)) for loss in losses]))
        # Without dispatch ahead a kept run waits for its reply.
        with stopped(pid_of(waiting)):
            returned, _ = within(lambda: kept(w, batches[0]), 0.3)
            assert not returned
    np.testing.assert_array_equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]


def test_a_crash_fails_every_value_in_flight(pool: Pool, step: Any) -> None:
    w = pool.put(np.zeros(WIDTH, np.float32))
    ones = np.ones(WIDTH, np.float32)
    pid = pid_of(pool)
    made = []
    with stopped(pid):
        for _ in range(3):
            w, _ = sent(lambda w=w: step(w, ones))
            made.append(w)
        os.kill(pid, signal.SIGKILL)
    for value in made:
        with pytest.raises(WorkerCrashedError, match="output 0 of"):
            np.asarray(value)
    with pytest.raises(WorkerCrashedError):
        step(made[-1], ones)
    wait_for(lambda: pool.worker_info[0]["state"] == "idle" and pid_of(pool) != pid)
    fresh = pool.put(np.zeros(WIDTH, np.float32))
    for _ in range(3):
        fresh, _ = step(fresh, ones)
    np.testing.assert_array_equal(np.asarray(fresh), 3 * ones)


def test_the_option_is_checked() -> None:
    with pytest.raises(ValueError, match="dispatch_ahead must be at most 3"):
        Pool(1, dispatch_ahead=4)
    with pytest.raises(TypeError, match="dispatch_ahead must be an int"):
        Pool(1, dispatch_ahead=1.5)


@pytest.mark.slow
def test_interrupts_deadlines_and_the_end_with_runs_in_flight(handlers: str) -> None:
    # One child (a hang fails it): a Ctrl-C at each point of a kept run's path, a run sent
    # ahead past its deadline, and close() and terminate() with runs in flight.
    done = child(
        """
        import contextlib, inspect
        import jax.numpy as jnp
        from pool.executor.caller import CallerPath
        from pool.executor.dispatch import Dispatcher

        def add_step(w, x):
            return w + x, jnp.sum(x)

        def interrupt_at(function, text):
            code = function.__code__
            lines, first = inspect.getsourcelines(function)
            number = next(n for n, line in enumerate(lines, first) if text in line)

            def trace(frame, event, arg):
                if frame.f_code is not code:
                    return None
                if event == "line" and frame.f_lineno == number:
                    sys.settrace(None)
                    signal.raise_signal(signal.SIGINT)
                return trace

            sys.settrace(trace)

        ones = np.ones(8, np.float32)
        pool = Pool(1, task_timeout=None)
        step = pool.function(add_step, keep=True)
        w, _ = step(np.zeros(8, np.float32), ones)
        w, _ = step(w, ones)
        points = [
            ("wait", None, None),  # a SIGINT while the fourth call waits for the first reply
            ("read", Dispatcher.receive, "message, fds = worker.receive()"),
            ("sent", Dispatcher.send_ahead, "with self._lock:"),
            ("resolved", Dispatcher.send_ahead, "resolve(task.future, handles)"),
            ("handled", Dispatcher._finish_ahead, "with self._lock:"),
        ]
        for name, function, text in points:
            pid = pool.worker_info[0]["pid"]
            w = pool.put(np.zeros(8, np.float32))
            out = []
            os.kill(pid, signal.SIGSTOP)
            for _ in range(3):
                w, _ = step(w, ones)
                out.append(w)
            try:
                if function is None:
                    main = threading.main_thread().ident  # a Ctrl-C reaches the main thread
                    threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT)).start()
                    step(w, ones)
                else:
                    os.kill(pid, signal.SIGCONT)
                    interrupt_at(function, text)
                    for _ in range(4):
                        w, _ = step(w, ones)
                    print(name, "not reached", flush=True)
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
                with contextlib.suppress(ProcessLookupError):  # (replaced meanwhile)
                    os.kill(pid, signal.SIGCONT)
            fetched = []
            for value in out:
                try:
                    fetched.append(float(np.asarray(value)[0]))
                except Exception as error:
                    fetched.append(type(error).__name__)
            fresh, _ = step(pool.put(ones), ones)
            same = pool.worker_info[0]["pid"] == pid
            print(name, same, fetched, float(np.asarray(fresh)[0]), flush=True)
        ends = []
        for end in ("close", "terminate"):
            other = Pool(1)
            kept = other.function(add_step, keep=True)
            v, _ = kept(np.zeros(8, np.float32), ones)
            v, _ = kept(v, ones)
            np.asarray(v)  # (its reply read: none in flight)
            pid = other.worker_info[0]["pid"]
            os.kill(pid, signal.SIGSTOP)
            for _ in range(3):
                v, _ = kept(v, ones)
            if end == "close":
                os.kill(pid, signal.SIGCONT)
            ender = threading.Thread(target=getattr(other, end), daemon=True)
            ender.start()
            ender.join(20)
            ends.append(not ender.is_alive())
        print("ended", ends, flush=True)
        timed = Pool(1, task_timeout=1.0)
        kept = timed.function(add_step, keep=True)
        v, _ = kept(np.zeros(8, np.float32), ones)
        v, _ = kept(v, ones)
        np.asarray(v)
        pid = timed.worker_info[0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        first, _ = kept(v, ones)
        second, _ = kept(first, ones)
        time.sleep(2.0)
        for value in (first, second):
            try:
                np.asarray(value)
            except Exception as error:
                print("deadline", type(error).__name__, flush=True)
        timed.close()
        pool.close()
        """,
        handlers,
        timeout=150,
    )
    printed(
        done,
        "wait True [1.0, 2.0, 3.0] 2.0",
        "read False ['WorkerCrashedError', 'WorkerCrashedError', 'WorkerCrashedError'] 2.0",
        "sent False ['WorkerCrashedError', 'WorkerCrashedError', 'WorkerCrashedError'] 2.0",
        "resolved True [1.0, 2.0, 3.0] 2.0",
        "handled False ['WorkerCrashedError', 'WorkerCrashedError', 'WorkerCrashedError'] 2.0",
        "ended [True, True]",
        "deadline TaskTimeoutError",
        "deadline WorkerCrashedError",
    )
    assert "not reached" not in done.stdout
