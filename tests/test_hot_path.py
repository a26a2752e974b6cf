"""The hot path of a small program: after its first run in a worker, a program whose
inputs and outputs fit the arena goes as a HotRun of a few bytes (worker.wire.protocol),
which the worker's native hot loop answers without Python (worker._pjrt.HotLoop).

Every guarantee of a full run holds on it: right results, the LRU of loaded
programs, deadlines, crash attribution, device failures, and the frames
themselves arrive whole, one per read, never more. The native loop runs a PJRT
plugin's executables, so these tests run on the CPU plugin (PLATFORM); the
cpu platform's own runtime, jaxlib's client, serves HotRuns from Python
(tests/test_jaxlib_runtime.py).
"""

from __future__ import annotations

import array
import mmap
import os
import signal
import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_PLUGIN
from pool_helpers import handler_initializer, milliseconds, plugin_executable, sds
from pool_helpers import scale_program as scale_on_any
from pool_helpers import sleep_program as sleep_on_any

from pool import (
    DeviceFailureError,
    Pool,
    TaskTimeoutError,
    WorkerCrashedError,
    lower,
)
from pool.executor import caller
from worker import _pjrt
from worker.dtypes import code_of_dtype
from worker.serve.server import register_slot
from worker.wire import protocol, shm

pytestmark = pytest.mark.skipif(DEFAULT_PLUGIN is None, reason="needs lammps-jax-pjrt-cpu")

PLATFORM = "pjrt_cpu"
"""The CPU plugin's platform: the native hot loop runs a PJRT plugin's executables (and
plugin_executable compiles on it)."""


def scale_program(factor: float, size: int = 8):
    return scale_on_any(factor, size, platform=PLATFORM)


def sleep_program(size: int = 1):
    return sleep_on_any(size, platform=PLATFORM)


def hot_slots(pool: Pool) -> dict[str, int]:
    """The hot slots the pool's only worker gave (the parent's record of them)."""
    (worker,) = list(pool._workers)
    return {program: hot.slot for program, hot in worker.hot.items()}


def failing_when_positive(target: str):
    """x, or the FFI handler `target` of x where x[0] > 0 (only the branch taken runs)."""

    def call(x):
        failing = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return jax.lax.cond(x[0] > 0, failing, lambda v: v, x)

    return lower(call, [sds(8)], custom_calls=[target], platform=PLATFORM)


def test_repeated_runs_go_hot_and_give_what_the_first_gave() -> None:
    program = scale_program(3.0)
    with Pool(1, platform=PLATFORM) as pool:
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
    with Pool(1, max_loaded=2, platform=PLATFORM) as pool:
        for step in range(12):
            factor, program = [(2, programs[0]), (5, programs[1]), (7, programs[2])][step % 3]
            np.testing.assert_array_equal(pool.run(program, [x])[0], x * factor + 1)
            assert len(hot_slots(pool)) <= 2  # never a slot of an unloaded program
        slots = hot_slots(pool)
        # Slots are never reused: a program loaded again gets a new one.
        assert max(slots.values()) >= 6


def test_a_hot_run_past_its_deadline_is_killed_and_the_pool_goes_on(handlers: str) -> None:
    program = sleep_program()
    with Pool(1, initializer=handler_initializer(handlers), platform=PLATFORM) as pool:
        assert pool.run(program, [milliseconds(1)])[0][0] == 1.0
        assert hot_slots(pool)
        pid = pool.worker_info[0]["pid"]
        with pytest.raises(TaskTimeoutError):
            pool.run(program, [milliseconds(20_000)], timeout=0.5)
        assert pool.run(program, [milliseconds(2)])[0][0] == 2.0
        assert pool.worker_info[0]["pid"] != pid


def test_a_caller_spins_for_a_fast_reply_and_sleeps_for_a_slow_one(
    handlers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where callers may poll for a reply past the short spin (hosts of 4 CPUs or more;
    here any machine is let), a run of a millisecond is polled for and a slow one slept for:
    a caller of a 100 ms program spends a small part of its time on the CPU."""
    monkeypatch.setattr(caller, "LONG_SPIN_CPUS", 1)
    program = sleep_program()
    with Pool(1, initializer=handler_initializer(handlers), platform=PLATFORM) as pool:
        for ms in (1.0, 100.0):  # the first run loads; the next ones learn how long it takes
            for _ in range(3):
                assert pool.run(program, [milliseconds(ms)])[0][0] == ms
        cpu, wall = time.thread_time(), time.perf_counter()
        for _ in range(5):
            assert pool.run(program, [milliseconds(100)])[0][0] == 100.0
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    # The short spin and the call's own work take well under a millisecond of each 100 ms;
    # polling for as long as the reply takes (or for the long spin's 2 ms) would take more.
    assert cpu < 0.015 * wall, f"the caller was on the CPU {cpu:.4f} s of {wall:.3f} s"


def test_a_crash_in_a_hot_run_fails_that_run_only(handlers: str) -> None:
    program = failing_when_positive("null_deref")
    calm, fatal = np.zeros(8, np.float32), np.ones(8, np.float32)
    with Pool(1, initializer=handler_initializer(handlers), platform=PLATFORM) as pool:
        np.testing.assert_array_equal(pool.run(program, [calm])[0], calm)
        assert hot_slots(pool)
        with pytest.raises(WorkerCrashedError, match="SIGSEGV"):
            pool.run(program, [fatal])
        np.testing.assert_array_equal(pool.run(program, [calm])[0], calm)
        np.testing.assert_array_equal(pool.run(program, [calm])[0], calm)


def test_a_device_failure_in_a_hot_run_retires_the_worker(handlers: str) -> None:
    program = failing_when_positive("device_error")
    calm, fatal = np.zeros(8, np.float32), np.ones(8, np.float32)
    with Pool(1, initializer=handler_initializer(handlers), platform=PLATFORM) as pool:
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
    program = lower(lambda x: (x * 2, jnp.zeros((0,), jnp.float32)), [sds(0)], platform=PLATFORM)
    with Pool(1, platform=PLATFORM) as pool:
        for _ in range(3):
            doubled, empty = pool.run(program, [np.zeros(0, np.float32)])
            assert doubled.shape == (0,) and empty.shape == (0,)


def test_hot_runs_keep_their_programs_loaded_in_the_workers_lru() -> None:
    # The native loop runs A without Python: the worker's LRU must still see those
    # runs, or loading C would unload A (used last) instead of B.
    a, b, c = (scale_program(float(f)) for f in (2, 5, 7))
    x = np.ones(8, np.float32)
    with Pool(1, max_loaded=2, platform=PLATFORM) as pool:
        pool.run(a, [x])
        pool.run(b, [x])
        for _ in range(5):
            np.testing.assert_array_equal(pool.run(a, [x])[0], x * 2 + 1)
        pool.run(c, [x])
        before = pool.statistics
        np.testing.assert_array_equal(pool.run(a, [x])[0], x * 2 + 1)
        assert pool.statistics == before  # A stayed loaded: nothing compiled or loaded again


class _Loop:
    """A hot loop in this process on one end of a socketpair, the other end for the test."""

    def __init__(self, program, arena_size: int = 4096) -> None:
        self.executable = plugin_executable(program)
        self.ours, self.theirs = socket.socketpair()
        self.arena_size = arena_size
        self.arena = mmap.mmap(-1, arena_size + protocol.CONTROL_BYTES)
        self.loop = _pjrt.HotLoop(self.theirs.fileno(), self.arena, arena_size, 0.0)
        types = self.executable.input_types
        self.input_offsets, end = shm.layout(types)
        self.output_offsets, _ = shm.layout(self.executable.output_types, end)
        self.inputs = shm.views(self.arena, types, self.input_offsets)
        self.outputs = shm.views(self.arena, self.executable.output_types, self.output_offsets)

    def register(self, slot: int) -> None:
        types = self.executable.input_types
        register_slot(
            self.loop, slot, self.executable, types, self.input_offsets, self.output_offsets
        )

    def close(self) -> None:
        del self.inputs, self.outputs
        self.ours.close()
        self.theirs.close()


def test_the_native_loop_speaks_the_protocols_frames() -> None:
    loop = _Loop(scale_program(3.0))
    try:
        loop.register(4)
        # Sent by the protocol module, back to back: the loop answers both HotRuns
        # itself and hands back the first frame that is not one, whole and unread past.
        for step in range(2):
            loop.inputs[0][:] = step
            protocol.send_frame(loop.ours, protocol.HotRun(100 + step, 4, step == 0))
            protocol.send_frame(loop.ours, protocol.HotRun(200 + step, 99, False))  # unknown
            first, fds, truncated = loop.loop.serve()
            assert protocol.recv_frame(loop.ours) == (protocol.HotReply(100 + step), [])
            np.testing.assert_array_equal(loop.outputs[0], np.full(8, step * 3 + 1))
            assert protocol.STARTED.unpack_from(loop.arena, loop.arena_size)[0] == 100 + step
            assert loop.loop.last_task_id == 100 + step
            message = protocol.finish_frame(loop.theirs, first, fds, truncated)
            assert message == (protocol.HotRun(200 + step, 99, False), [])
        assert loop.loop.take_used() == [4]
        assert loop.loop.take_used() == []
        # A HotRun that comes with a descriptor is not the loop's to run: it comes
        # back with the descriptor, which the caller closes (the worker does).
        read_end, write_end = os.pipe()
        try:
            data = protocol._HOT_RUN.pack(16, 1, protocol.Format.HOT_RUN, 300, 4, 0)
            loop.ours.sendmsg(
                [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [read_end]))]
            )
            first, fds, truncated = loop.loop.serve()
            message, fds = protocol.finish_frame(loop.theirs, first, fds, truncated)
            assert message == protocol.HotRun(300, 4, False) and len(fds) == 1
            assert loop.loop.take_used() == []  # it did not run
            os.close(fds[0])
        finally:
            os.close(read_end)
            os.close(write_end)
        protocol.send_frame(loop.ours, protocol.Exit())
        assert protocol.finish_frame(loop.theirs, *loop.loop.serve()) == (protocol.Exit(), [])
        loop.ours.shutdown(socket.SHUT_WR)
        assert loop.loop.serve() == (b"", [], False)  # the end of the stream
        loop.loop.drop_slot(4)
        assert not loop.loop.has_slot(4)
    finally:
        loop.close()


def test_the_native_loop_refuses_places_outside_its_arena() -> None:
    loop = _Loop(scale_program(3.0), arena_size=256)
    try:
        native = loop.executable.native
        f32 = code_of_dtype(np.dtype(np.float32))
        good_in, good_out = (0, 32, f32, (8,)), (64, 32)
        for inputs, outputs in [
            ([(240, 32, f32, (8,))], [good_out]),  # runs past the arena's end
            ([(2**64 - 16, 32, f32, (8,))], [good_out]),  # wraps around
            ([(0, 16, f32, (8,))], [good_out]),  # not its type's size
            ([(0, 32, 99, (8,))], [good_out]),  # no such element type
            ([good_in], [(250, 32)]),
            ([good_in], [(64, 16)]),  # not the output's size
            ([good_in], []),  # not the program's output count
        ]:
            with pytest.raises(ValueError):
                loop.loop.set_slot(1, native, inputs, outputs)
        assert not loop.loop.has_slot(1)
        with pytest.raises(ValueError, match="not registered"):
            loop.loop.run(7, 1, False)
        with pytest.raises(ValueError, match="control bytes"):
            _pjrt.HotLoop(loop.theirs.fileno(), loop.arena, len(loop.arena), 0.0)
    finally:
        loop.close()


def test_a_signal_wakes_the_native_loop_and_its_handler_runs() -> None:
    # Its own handler, not SIGINT's: a shell starts background jobs with SIGINT
    # ignored, and then Python installs no handler for it.
    class WokenError(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise WokenError

    loop = _Loop(scale_program(3.0))
    main = threading.get_ident()
    previous = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGUSR1))
    # If the signal never ended the wait, a frame ends it: the test fails, never hangs.
    rescue = threading.Timer(20.0, protocol.send_frame, (loop.ours, protocol.Exit()))
    try:
        timer.start()
        rescue.start()
        with pytest.raises(WokenError):
            loop.loop.serve()  # blocked with nothing to read: only the signal ends it
    finally:
        timer.cancel()
        rescue.cancel()
        signal.signal(signal.SIGUSR1, previous)
        loop.close()


def test_an_idle_worker_a_caller_parked_is_replaced_when_it_dies() -> None:
    # Pool.run leaves the idle worker's socket out of the manager's wait set (parked);
    # the manager puts it back within PARKED_SECONDS, so a death is still seen.
    program = scale_program(2.0)
    x = np.ones(8, np.float32)
    with Pool(1, platform=PLATFORM) as pool:
        for _ in range(5):
            pool.run(program, [x])
        pid = pool.worker_info[0]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            info = pool.worker_info[0]
            if info["pid"] != pid and info["state"] == "idle":
                break
            time.sleep(0.01)
        assert pool.worker_info[0]["pid"] != pid, "the dead worker was never replaced"
        np.testing.assert_array_equal(pool.run(program, [x])[0], x * 2 + 1)
