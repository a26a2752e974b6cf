"""The hot path of a small program: after its first run in a worker, a program whose
inputs and outputs fit the arena goes as a HotRun of a few bytes (worker.protocol).

Every guarantee of a full run holds on it: right results, the LRU of loaded
programs, deadlines, crash attribution, device failures, and the frames
themselves arrive whole, one per read, never more.
"""

from __future__ import annotations

import socket

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pool_helpers import handler_initializer, milliseconds, scale_program, sds, sleep_program

from pool import DeviceFailureError, Pool, TaskTimeoutError, WorkerCrashedError, lower
from worker import protocol


def hot_slots(pool: Pool) -> dict[str, int]:
    """The hot slots the pool's only worker gave (the parent's record of them)."""
    (worker,) = list(pool._workers)
    return {program: hot.slot for program, hot in worker.hot.items()}


def failing_when_positive(target: str):
    """x, or the FFI handler `target` of x where x[0] > 0 (only the branch taken runs)."""

    def call(x):
        failing = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return jax.lax.cond(x[0] > 0, failing, lambda v: v, x)

    return lower(call, [sds(8)], custom_calls=[target])


def test_repeated_runs_go_hot_and_give_what_the_first_gave() -> None:
    program = scale_program(3.0)
    with Pool(1) as pool:
        first = pool.run(program, [np.arange(8, dtype=np.float32)])[0]
        assert list(hot_slots(pool).values()) == [0]
        for step in range(50):
            x = np.full(8, step, np.float32)
            out = pool.run(program, [x])[0]
            np.testing.assert_array_equal(out, x * 3 + 1)
            # Outputs are copies: the next run, through the same arena, leaves them be.
        np.testing.assert_array_equal(first, np.arange(8, dtype=np.float32) * 3 + 1)
        submitted = [pool.submit(program, [np.full(8, i, np.float32)]) for i in range(20)]
        for i, future in enumerate(submitted):
            np.testing.assert_array_equal(future.result()[0], np.full(8, i * 3 + 1))


def test_programs_the_worker_unloads_lose_their_slots_and_run_right() -> None:
    programs = [scale_program(float(f)) for f in (2, 5, 7)]
    x = np.ones(8, np.float32)
    with Pool(1, max_loaded=2) as pool:
        for step in range(12):
            factor, program = [(2, programs[0]), (5, programs[1]), (7, programs[2])][step % 3]
            np.testing.assert_array_equal(pool.run(program, [x])[0], x * factor + 1)
            assert len(hot_slots(pool)) <= 2  # never a slot of an unloaded program
        slots = hot_slots(pool)
        # Slots are never reused: a program loaded again gets a new one.
        assert max(slots.values()) >= 6


def test_a_hot_run_past_its_deadline_is_killed_and_the_pool_goes_on(handlers: str) -> None:
    program = sleep_program()
    with Pool(1, initializer=handler_initializer(handlers)) as pool:
        assert pool.run(program, [milliseconds(1)])[0][0] == 1.0
        assert hot_slots(pool)
        pid = pool.worker_info[0]["pid"]
        with pytest.raises(TaskTimeoutError):
            pool.run(program, [milliseconds(20_000)], timeout=0.5)
        assert pool.run(program, [milliseconds(2)])[0][0] == 2.0
        assert pool.worker_info[0]["pid"] != pid


def test_a_crash_in_a_hot_run_fails_that_run_only(handlers: str) -> None:
    program = failing_when_positive("null_deref")
    calm, fatal = np.zeros(8, np.float32), np.ones(8, np.float32)
    with Pool(1, initializer=handler_initializer(handlers)) as pool:
        np.testing.assert_array_equal(pool.run(program, [calm])[0], calm)
        assert hot_slots(pool)
        with pytest.raises(WorkerCrashedError, match="SIGSEGV"):
            pool.run(program, [fatal])
        np.testing.assert_array_equal(pool.run(program, [calm])[0], calm)
        np.testing.assert_array_equal(pool.run(program, [calm])[0], calm)


def test_a_device_failure_in_a_hot_run_retires_the_worker(handlers: str) -> None:
    program = failing_when_positive("device_error")
    calm, fatal = np.zeros(8, np.float32), np.ones(8, np.float32)
    with Pool(1, initializer=handler_initializer(handlers)) as pool:
        np.testing.assert_array_equal(pool.run(program, [calm])[0], calm)
        pid = pool.worker_info[0]["pid"]
        with pytest.raises(DeviceFailureError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
            pool.run(program, [fatal])
        np.testing.assert_array_equal(pool.run(program, [calm])[0], calm)
        assert pool.worker_info[0]["pid"] != pid


def test_frames_arrive_one_per_read_and_a_foreign_format_is_refused() -> None:
    left, right = socket.socketpair()
    with left, right:
        # Back to back in the stream: each read takes one frame, never part of the next.
        sent = [
            protocol.HotRun(7, 3, True),
            protocol.Exit(),  # the shortest pickle, padded
            protocol.HotReply(9),
            protocol.HotRun(8, 0, False),
        ]
        for message in sent:
            protocol.send_frame(left, message)
        received = [protocol.recv_frame(right)[0] for _ in range(4)]
        assert received == sent
        left.sendall(bytes([16, 0, 0, 0, 0, 9]) + bytes(16))
        with pytest.raises(ValueError, match="not a frame of ours"):
            protocol.recv_frame(right)


def test_a_program_with_no_inputs_or_outputs_of_size_zero_runs_hot() -> None:
    program = lower(lambda x: (x * 2, jnp.zeros((0,), jnp.float32)), [sds(0)])
    with Pool(1) as pool:
        for _ in range(3):
            doubled, empty = pool.run(program, [np.zeros(0, np.float32)])
            assert doubled.shape == (0,) and empty.shape == (0,)
