"""Edges of shared arrays and kept values: other pools, crashes, bad requests, bounds.

- An array in one pool's shared memory (a result, Pool.empty, Pool.asarray) passed to
  another pool is copied like any numpy array: its segment id means nothing (or another
  segment) to that pool's workers.
- A worker dying while it puts a value never quarantines Pool.put.
- keep= past a program's outputs is a ValueError before anything is sent, every time.
- Kept values whose handles were never made are dropped in the worker too.
- A request that failed makes the parent send its segments again; many dropped handles
  go in bounded requests.
- A segment the worker cannot map fails its run, not the worker: only the socket's own
  failures end a worker's receive loop.
"""

from __future__ import annotations

import mmap
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import child, run_python
from pool_helpers import wait_until_started

from pool import Pool, lower
from pool.errors import WorkerCrashedError
from worker import _pjrt
from worker.serve.server import Server
from worker.wire import places, protocol

N = 1 << 18  # float32: 1 MiB, past the arena's share, so a segment of its own


def f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


AFFINE = lower(lambda x: x * 2 + 1, [f32(N)])


def test_an_array_of_another_pools_shared_memory_is_copied(tmp_path) -> None:
    with Pool(1, cache_dir=tmp_path) as pool, Pool(1, cache_dir=tmp_path) as other:
        y = np.full(N, 5.0, np.float32)
        (own,) = other.run(AFFINE, [other.asarray(y)])  # other's worker maps a segment of its own
        np.testing.assert_array_equal(own, y * 2 + 1)
        x = np.arange(N, dtype=np.float32)
        for shared in (pool.asarray(x), pool.run(AFFINE, [x])[0]):
            (out,) = other.run(AFFINE, [shared])
            np.testing.assert_array_equal(out, shared * 2 + 1)
        (back,) = pool.run(AFFINE, [own])  # and the other way
        np.testing.assert_array_equal(back, own * 2 + 1)


SLOW_PUT_SHAPE = (7,)


def slow_puts():
    """A Pool initializer: the worker takes 60 s over a put of shape SLOW_PUT_SHAPE, long
    enough for a test to kill it in the middle of one (a put is otherwise too quick to land
    a SIGKILL in). A closure, so that it is pickled whole for the workers."""
    shape = SLOW_PUT_SHAPE

    def install() -> None:
        import time as worker_time

        from worker.serve import server

        put = server.Server.put

        def slow_put(self, request, fds):
            if request.array_type.shape == shape:
                worker_time.sleep(60)
            return put(self, request, fds)

        server.Server.put = slow_put

    return install


def test_workers_dying_during_puts_never_quarantine_put(tmp_path) -> None:
    with Pool(1, cache_dir=tmp_path, initializer=slow_puts(), max_crashes=2) as pool:
        for attempt in range(3):
            with ThreadPoolExecutor(1) as thread:
                putting = thread.submit(pool.put, np.ones(SLOW_PUT_SHAPE, np.float32), name="p")
                victim = wait_until_started(pool, "p")
                os.kill(victim, signal.SIGKILL)
                with pytest.raises(WorkerCrashedError) as crash:
                    putting.result(timeout=60)
            assert "quarantined" not in str(crash.value), attempt
        value = pool.put(np.arange(4, dtype=np.float32))
        np.testing.assert_array_equal(value.fetch(), np.arange(4, dtype=np.float32))


def test_keep_past_the_outputs_is_refused_on_every_run(tmp_path) -> None:
    step = lower(lambda w, x: (w - x, jnp.sum(w)), [f32(8), f32(8)])
    x = np.ones(8, np.float32)
    with Pool(1, cache_dir=tmp_path) as pool:
        for attempt in range(3):  # the first run's worker refuses; later runs the parent
            with pytest.raises(ValueError, match="keep"):
                pool.run(step, [x, x], keep=5)
            with pytest.raises(ValueError, match="keep"):
                pool.submit(step, [x, x], keep=(0, 2)).result(timeout=60)
            if attempt == 0:
                pool.run(step, [x, x])  # the parent knows the outputs from here on
        assert pool.worker_info[0]["values"] == 0
        w, total = pool.run(step, [x, x], keep=(0,))
        assert float(total) == 8.0
        np.testing.assert_array_equal(w.fetch(), np.zeros(8, np.float32))


def test_values_kept_by_a_run_whose_reply_failed_are_dropped_in_the_worker() -> None:
    # A first run keeping output 0 while output 1 goes to a segment the worker makes: its
    # descriptor cannot be received (the parent has none left), so the reply fails after
    # the worker kept output 0. The worker's own count (a Fetch reply's) must come back to
    # the handles alive.
    done = child(
        """
        import jax.numpy as jnp
        n = 1 << 18
        program = lower(lambda w: (w + 1, jnp.zeros(n, jnp.float32) + w[0]), [sds(8)])
        w = np.ones(8, np.float32)
        with Pool(workers=1) as pool:
            pool.compile(program)
            live = pool.put(w)
            held = take_every_descriptor()
            try:
                pool.run(program, [w], keep=0)
            except OSError as error:
                print("failed:", type(error).__name__, error)
            else:
                print("failed: no")
            finally:
                give_back_descriptors(held)
            for _ in range(3):  # each fetch's request brings the drops; its reply, the count
                assert (live.fetch() == w).all()
            (worker,) = list(pool._workers)
            print("held:", worker.memory.reported_values, "handles:", worker.memory.value_count)
        """
    )
    lines = done.stdout.splitlines()
    assert any(line.startswith("failed: DescriptorLimitError") for line in lines), done.stdout
    assert "held: 1 handles: 1" in lines, done.stdout + done.stderr


def test_more_dropped_handles_than_a_request_carries_go_in_several(tmp_path) -> None:
    # 65,792 values dropped at once: more than a PlacedRun can count (16 bits) or hold (1 MiB).
    outputs = 256
    many = lower(lambda x: tuple(x + i for i in range(outputs)), [f32(1)])
    small = lower(lambda x: x * 2 + 1, [f32(8)])
    x = np.ones(8, np.float32)
    with Pool(1, cache_dir=tmp_path) as pool:
        pool.run(small, [x])  # its later runs are PlacedRuns (or HotRuns, with no drops)
        keep = tuple(range(outputs))
        handles = [pool.run(many, [x[:1]], keep=keep) for _ in range(257)]
        last = handles[-1][3]
        del handles
        for _ in range(3):
            np.testing.assert_array_equal(pool.run(small, [x])[0], x * 3)
        deadline = time.monotonic() + 30  # the manager brings the rest to the idle worker
        while pool.worker_info[0]["values"] > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.worker_info[0]["values"] == 1
        assert float(last.fetch()[0]) == 4.0
        (worker,) = list(pool._workers)
        assert worker.memory.reported_values == 1


def test_put_converts_as_device_put_and_values_refuse_copy_false(tmp_path) -> None:
    with Pool(1, cache_dir=tmp_path) as pool:
        value = pool.put(np.arange(N, dtype=np.float64))  # numpy's default, as jax.device_put
        assert value.dtype == np.float32
        np.testing.assert_array_equal(pool.run(AFFINE, [value])[0], np.arange(N) * 2.0 + 1)
        assert pool.put(np.arange(3)).dtype == np.int32
        with pytest.raises(ValueError, match="always copied"):
            np.asarray(value, copy=False)
        np.testing.assert_array_equal(np.asarray(value, copy=True), np.arange(N))


@pytest.mark.parametrize("x64", ["", "true"])
def test_put_converts_as_device_put_in_a_process_that_never_imports_jax(x64: str) -> None:
    """The executor imports no JAX (tests/test_structure.py): a put reads JAX's x64 mode from
    JAX where the process imported it, else from JAX_ENABLE_X64, as JAX would start."""
    done = run_python(
        """
        import sys
        import numpy as np
        from pool import Pool
        with Pool(1) as pool:
            print(pool.put(np.arange(4, dtype=np.float64)).dtype, "jax" in sys.modules)
        """,
        env={"JAX_ENABLE_X64": x64},
    )
    assert done.stdout.split() == ["float64" if x64 else "float32", "False"]


def fail_first_mapping():
    """A Pool initializer: the worker fails the first request that brings it segments, before
    mapping them (as a failed mmap, or descriptors that never came, would)."""

    def install() -> None:
        from worker.serve import server

        apply = server.Server._apply
        failed: list[bool] = []

        def failing_apply(self, segments, fds, drops, forgets):
            if segments and not failed:
                failed.append(True)
                raise MemoryError("injected: the request's segments could not be mapped")
            return apply(self, segments, fds, drops, forgets)

        server.Server._apply = failing_apply

    return install


def test_the_segments_of_a_failed_request_are_sent_again(tmp_path) -> None:
    with Pool(1, cache_dir=tmp_path, initializer=fail_first_mapping()) as pool:
        x = pool.asarray(np.arange(N, dtype=np.float32))
        with pytest.raises(MemoryError, match="injected"):
            pool.run(AFFINE, [x])
        for _ in range(2):  # the Run, then a PlacedRun, both naming x's segment
            (out,) = pool.run(AFFINE, [x])
            np.testing.assert_array_equal(out, x * 2 + 1)


def test_a_segment_the_worker_cannot_map_fails_its_run_and_the_worker_goes_on(tmp_path) -> None:
    ours, theirs = socket.socketpair()
    arena = mmap.mmap(-1, 4096 + protocol.CONTROL_BYTES)
    server = Server(theirs, arena, 4096, max_loaded=1)
    readonly = tmp_path / "readonly"
    readonly.write_bytes(bytes(4096))
    whole = ((places.PLACE, 5, 0),)
    try:
        for task_id in (11, 12):
            # A read-only file: mmap(PROT_WRITE, MAP_SHARED) fails with EACCES, an OSError
            # in Python that the receive loop once took for the socket's (the worker died).
            fd = os.open(readonly, os.O_RDONLY)
            try:
                run = places.PlacedRun(task_id, 3, True, whole, whole, ((5, 4096),))
                protocol.send_frame(ours, run, (fd,))
            finally:
                os.close(fd)
        protocol.send_frame(ours, protocol.Exit())
        server.serve()  # returns at Exit, having answered both runs
        for task_id in (11, 12):
            reply, _ = protocol.recv_frame(ours)
            assert reply.task_id == task_id and reply.error is not None
            assert "mapping a shared-memory segment" in reply.error.message
            assert reply.error.qualname == "PermissionError"
        # The socket's own failures still end it: a frame past its bounds (EPROTO) ...
        frame = bytearray(places.placed_frame(places.PlacedRun(13, 3, True, whole, whole), 0))
        frame[:4] = (places.MAX_PLACED_LENGTH + 1).to_bytes(4, "little")
        ours.sendall(frame)
        with pytest.raises(_pjrt.SocketError, match="a placed run's frame has a payload"):
            server.serve()
    finally:
        ours.close()
        theirs.close()
    # ... and the parent closing the socket mid-frame, quietly (ConnectionResetError).
    ours, theirs = socket.socketpair()
    try:
        server = Server(theirs, arena, 4096, max_loaded=1)
        ours.sendall(places.placed_frame(places.PlacedRun(14, 3, True, whole * 4, whole), 0)[:-8])
        ours.close()
        server.serve()
    finally:
        theirs.close()
