"""Large arrays at memory speed, and values that stay in a worker.

- Segments are mapped once on both sides and reused: call after call makes no new
  memfd and no new mapping, in the parent or in the worker.
- Arrays in the pool's shared memory (Pool.empty, Pool.asarray, a result) are passed
  as they are: a submitted task reads them where they are (so a change made before
  it runs reaches it, as for any reference), where a plain array is copied at submit.
- Values (Pool.put, keep=) stay in their worker: runs take them there, fetch copies
  them out, dropping them frees the worker's memory; a crash of their worker fails
  every call that needs them, naming them, and the pool goes on; misuse is a clear
  error.
- The native loop's placed runs refuse places outside their segments.
"""

from __future__ import annotations

import gc
import mmap
import os
import pickle
import signal
import socket
import threading
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pool_helpers import (
    handler_initializer,
    milliseconds,
    plugin_executable,
    sleep_program,
    wait_until_started,
)

from pool import Pool, lower
from pool.errors import (
    ConvertedInputWarning,
    PoolClosedError,
    WorkerCrashedError,
    WorkerWarning,
)
from pool.executor.copier import COPY_THREADS_VARIABLE, SPREAD_BYTES, STREAM_BYTES, Copier
from pool.executor.values import DeviceValue
from worker import _pjrt
from worker.dtypes import code_of_dtype
from worker.wire import places, protocol, shm

N = 1 << 18  # float32: 1 MiB, past the arena's share, so a segment of its own


def f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


AFFINE = lower(lambda x: x * 2 + 1, [f32(N)])
STEP = lower(lambda w, x: (w - 0.5 * x, jnp.sum(w * x)), [f32(N), f32(N)])


def memfd_mappings(pid: int | str = "self") -> list[str]:
    """The memfd mappings of a process, by address range and name."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted(" ".join(line.split()[::5]) for line in maps if "/memfd:" in line)


@pytest.fixture(scope="module")
def pool(handlers: str):
    with Pool(1, initializer=handler_initializer(handlers)) as pool:
        yield pool


def test_segments_are_mapped_once_on_both_sides_and_reused(pool) -> None:
    x = np.arange(N, dtype=np.float32)
    worker = pool.worker_info[0]["pid"]
    seen = []
    for i in range(6):
        (out,) = pool.run(AFFINE, [x + i])
        np.testing.assert_array_equal(out, (x + i) * 2 + 1)
        del out
        gc.collect()
        seen.append((memfd_mappings(), memfd_mappings(worker)))
    assert all(found == seen[2] for found in seen[2:]), seen


def test_arrays_in_shared_memory_are_passed_as_they_are(pool) -> None:
    sleeper = sleep_program()
    shared = pool.asarray(np.ones(N, np.float32))
    plain = np.ones(N, np.float32)
    (result,) = pool.run(AFFINE, [shared])  # a result is in shared memory too
    busy = pool.submit(sleeper, [milliseconds(300)])  # the one worker is busy meanwhile
    wait_until_started(pool, sleeper.name)
    by_reference = [pool.submit(AFFINE, [a]) for a in (shared, result, plain)]
    shared[:] = 10  # before the tasks run: only the arrays passed as they are see it
    result[:] = 20
    plain[:] = 30
    busy.result(timeout=60)
    outs = [future.result(timeout=60)[0] for future in by_reference]
    assert [float(o[0]) for o in outs] == [21.0, 41.0, 3.0]
    filled = pool.empty((N,), np.float32)
    filled[:] = np.arange(N, dtype=np.float32)
    np.testing.assert_array_equal(pool.run(AFFINE, [filled])[0], filled * 2 + 1)
    with pytest.raises(TypeError, match="not supported"):
        pool.empty((4,), object)


def test_values_stay_in_their_worker_and_come_back_on_request(pool) -> None:
    x = np.full(N, 2.0, np.float32)
    w = pool.put(np.ones(N, np.float32))
    assert (w.shape, w.dtype, w.nbytes) == ((N,), np.float32, 4 * N)
    before = pool.worker_info[0]
    for _ in range(4):
        w, total = pool.run(STEP, [w, x], keep=0)
        assert isinstance(w, DeviceValue) and isinstance(total, np.ndarray)
    np.testing.assert_allclose(np.asarray(w), np.ones(N) - 4.0)
    info = pool.worker_info[0]
    assert info["pid"] == before["pid"]
    # The current value, and at most the one its last request did not yet drop.
    assert 4 * N <= info["value_bytes"] <= 8 * N
    future = pool.submit(STEP, [w, x], keep=(0, 1))
    w2, kept_total = future.result(timeout=60)
    assert isinstance(kept_total, DeviceValue) and float(kept_total.fetch()) == -6.0 * N
    del w, w2, kept_total, future  # the future holds its result
    gc.collect()
    deadline = time.monotonic() + 10  # the manager hands the drops to the idle worker
    while pool.worker_info[0]["values"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.worker_info[0]["values"] == 0 and pool.worker_info[0]["value_bytes"] == 0


def test_a_training_loop_keeps_its_parameters_in_the_worker(pool) -> None:
    def step(params, x):
        value, grads = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(params)
        return jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads), value

    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((16, 4)).astype(np.float32)}
    x = rng.standard_normal((32, 16)).astype(np.float32)
    kept, plain = pool.function(step, keep=0), pool.function(step)
    # Everything kept: the worker answers each step once it is dispatched, as jax.jit
    # does, and the values are read once their runs have ended.
    everything = pool.function(step, keep=True)
    a, b, c = params, params, params
    for _ in range(10):
        a, loss_a = kept(a, x)
        b, loss_b = plain(b, x)
        c, loss_c = everything(c, x)
    assert isinstance(a["w"], DeviceValue) and isinstance(loss_a, np.ndarray)
    assert isinstance(c["w"], DeviceValue) and isinstance(loss_c, DeviceValue)
    np.testing.assert_array_equal(np.asarray(a["w"]), b["w"])
    np.testing.assert_array_equal(np.asarray(c["w"]), b["w"])
    assert float(loss_a) == float(loss_b) == float(loss_c.fetch())
    with pytest.raises(ValueError, match="returns a tuple of 2"):
        pool.function(step, keep=2)(params, x)


def test_a_value_whose_run_was_not_awaited_is_read_once_the_run_ends(pool) -> None:
    """A run whose outputs all stay in the worker is answered once dispatched: the
    value it keeps is read (fetched, or taken by the next run) only after it ends."""
    program = sleep_program(N)
    pool.run(program, [milliseconds(1, N)], keep=0)  # compiled, placed
    for ms in (300.0, 200.0):
        [value] = pool.run(program, [milliseconds(ms, N)], keep=0)
        np.testing.assert_array_equal(value.fetch(), milliseconds(ms, N))
    [slow] = pool.run(program, [milliseconds(300, N)], keep=0)
    [again] = pool.run(program, [slow], keep=0)  # waits for `slow` on the device
    assert float(np.asarray(again)[0]) == 300.0


def resident_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in lines if line.startswith("VmRSS:")).split()[1]) * 1024


def test_a_run_answered_at_dispatch_reads_its_inputs_as_they_were(pool) -> None:
    """The answer of a run whose outputs all stay in the worker frees the caller's input
    memory (the parent writes the next call's inputs there) while the run has not yet
    read it: the worker reads its own copy (staged), which it frees once the run is done
    with it, so that a loop of such runs holds no more memory than a step's inputs."""
    program = lower(
        lambda s, x: jax.ffi.ffi_call("sleep_ms", f32(N))(s) + x,
        [f32(N), f32(N)],
        custom_calls=["sleep_ms"],
    )
    pool.run(program, [milliseconds(1, N), np.zeros(N, np.float32)], keep=0)  # compiled, placed
    [late] = pool.run(program, [milliseconds(300, N), np.ones(N, np.float32)], keep=0)
    # Sent while `late` sleeps, from the memory `late`'s input came in.
    [soon] = pool.run(program, [milliseconds(0, N), np.full(N, 7, np.float32)], keep=0)
    np.testing.assert_array_equal(late.fetch(), np.full(N, 301, np.float32))
    np.testing.assert_array_equal(soon.fetch(), np.full(N, 7, np.float32))
    worker = pool.worker_info[0]["pid"]
    x = np.ones(N, np.float32)
    w, _ = pool.run(STEP, [x, x], keep=0)
    before = resident_bytes(worker)
    for _ in range(400):  # 400 MiB of inputs, if their copies were never freed
        w, _ = pool.run(STEP, [w, x], keep=(0, 1))
    np.testing.assert_allclose(w.fetch(), np.full(N, 1 - 0.5 * 401, np.float32))
    assert resident_bytes(worker) - before < 64 << 20


def test_a_run_writes_its_outputs_over_its_own_copy_of_its_inputs(pool) -> None:
    # A numpy input is copied into a segment of the task's; the outputs then go to that
    # segment, not to a second one: four held results make four segments, not eight
    # (the round trip's peak is 3x the array: the caller's, the segment, the plugin's).
    # The first run too, whose outputs the parent does not know yet: the worker is
    # offered the segment (Run.spare) and makes none of its own.
    x = np.arange(N, dtype=np.float32)
    before = set(memfd_mappings())  # the module's pool's, idle meanwhile
    with Pool(1) as fresh:
        held = [fresh.run(AFFINE, [x + i])[0] for i in range(4)]  # a first run, then placed
        for i, out in enumerate(held):
            np.testing.assert_array_equal(out, (x + i) * 2 + 1)
        made = set(memfd_mappings()) - before
        assert len([m for m in made if "pjrt-pool-segment" in m]) == 4, made
        assert not [m for m in made if "pjrt-pool-outputs" in m], made
        del held
    # Outputs that trade places with inputs, several of each, one larger than the inputs
    # (a segment of its own then): each reads what it was given.
    swap = lower(lambda a, b: (b, a + 1), [f32(N), f32(N // 2)])
    grow = lower(lambda a: (jnp.concatenate([a, a]), a[:8]), [f32(N)])
    a, b = np.arange(N, dtype=np.float32), np.full(N // 2, 7.0, np.float32)
    for _ in range(2):  # the second is a placed run
        out_b, out_a = pool.run(swap, [a, b])
        np.testing.assert_array_equal(out_b, b)
        np.testing.assert_array_equal(out_a, a + 1)
        both, head = pool.run(grow, [a])
        np.testing.assert_array_equal(both, np.concatenate([a, a]))
        np.testing.assert_array_equal(head, a[:8])


def test_large_copies_into_shared_memory_are_spread_over_threads_and_exact(
    pool, monkeypatch
) -> None:
    # A copy of copier.SPREAD_BYTES or more goes over threads the pool's Copier keeps:
    # every byte lands once, at its place, whatever the split (sizes that are not a
    # multiple of the threads or of a page, more threads than pages), copied plainly or
    # streamed (copier.STREAM_BYTES or more: stores around the caches, which want aligned
    # destinations: these start 0, 1 and 17 bytes past a 64-byte boundary), and streamed
    # on the caller's thread alone below SPREAD_BYTES (a TPU pool's copies from 1 MiB).
    rng = np.random.default_rng(0)
    source = rng.integers(0, 255, (9 << 20) + 4097, dtype=np.uint8)
    for spread_bytes, stream_bytes in ((0, STREAM_BYTES), (0, 0), (SPREAD_BYTES, 0)):
        spreading = Copier(spread_bytes=spread_bytes, stream_bytes=stream_bytes)
        for size in (0, 1, 31, 4095, 4097, 3 * 4096 + 5, 9 << 20, (9 << 20) + 4097):
            for threads in ("1", "2", "3", "7", "64"):
                monkeypatch.setenv(COPY_THREADS_VARIABLE, threads)
                for skew in (0, 1, 17):
                    room = np.zeros(size + 128, np.uint8)
                    start = -room.ctypes.data % 64 + skew
                    destination = room[start : start + size]
                    spreading.copy(memoryview(destination), source[:size])
                    assert np.array_equal(destination, source[:size]), (size, threads, skew)
                    assert not room[:start].any() and not room[start + size :].any()
        assert any(t.name.startswith("pjrt-pool-copy") for t in threading.enumerate())
        spreading.close()
        assert not any(t.name.startswith("pjrt-pool-copy") for t in threading.enumerate())
        destination = np.zeros(4097, np.uint8)
        spreading.copy(memoryview(destination), source[:4097])  # closed: the caller's thread
        assert np.array_equal(destination, source[:4097])
    # The streamed copy itself refuses buffers it cannot copy between, saying why.
    with pytest.raises(ValueError, match="as many bytes"):
        _pjrt.stream_copy(np.zeros(4, np.uint8), np.zeros(5, np.uint8))
    with pytest.raises(ValueError, match="C-contiguous"):
        _pjrt.stream_copy(np.zeros(8, np.uint8)[::2], np.zeros(4, np.uint8))
    with pytest.raises((BufferError, ValueError)):
        _pjrt.stream_copy(np.zeros(4, np.uint8).data.toreadonly(), np.zeros(4, np.uint8))
    # Through the pool: a numpy input and Pool.asarray of 12 MiB and 4 bytes, spread and not.
    n = (3 << 20) + 1
    big = lower(lambda a, b: (a * 2 + b,), [f32(n), f32(n)])
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    for threads in ("3", "1", None):
        if threads is None:
            monkeypatch.delenv(COPY_THREADS_VARIABLE)
        else:
            monkeypatch.setenv(COPY_THREADS_VARIABLE, threads)
        (out,) = pool.run(big, [a, pool.asarray(b)])
        assert np.array_equal(out, a * 2 + b)
    # A numpy input past copier.STREAM_BYTES (a CPU pool's size) goes streamed, exact.
    assert pool._segments.copier.stream_bytes == STREAM_BYTES
    huge = (STREAM_BYTES >> 2) + 1
    x = rng.standard_normal(huge).astype(np.float32)
    (out,) = pool.run(lower(lambda v: (v * 2,), [f32(huge)]), [x])
    assert np.array_equal(out, x * 2)
    del out, x
    # A setting it cannot use is refused, naming the variable, and the pool goes on.
    monkeypatch.setenv(COPY_THREADS_VARIABLE, "many")
    with pytest.raises(ValueError, match="PJRT_POOL_COPY_THREADS='many': give the number"):
        pool.run(big, [a, b])
    monkeypatch.delenv(COPY_THREADS_VARIABLE)
    (out,) = pool.run(big, [a, b])
    assert np.array_equal(out, a * 2 + b)


def test_misused_values_are_clear_errors(pool, tmp_path) -> None:
    w = pool.put(np.ones(N, np.float32))
    with pytest.raises(TypeError, match="never converted"):
        pool.run(AFFINE, [pool.put(np.ones(N, np.int32))])
    with pytest.raises(TypeError, match="keep must be"):
        pool.run(AFFINE, [w], keep="0")
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(w)
    with Pool(1, cache_dir=tmp_path) as other:
        with pytest.raises(ValueError, match="another pool"):
            other.run(AFFINE, [w])
        mine = other.put(np.ones(N, np.float32))
    with pytest.raises(PoolClosedError):
        mine.fetch()
    with pytest.raises(PoolClosedError):
        other.put(np.ones(4, np.float32))


def test_a_crash_fails_every_call_that_needs_its_values_and_the_pool_goes_on(
    tmp_path, handlers: str
) -> None:
    x = np.ones(N, np.float32)
    with Pool(2, cache_dir=tmp_path, initializer=handler_initializer(handlers)) as pool:
        w = pool.put(x, name="the weights")
        other = pool.put(x)  # on either worker
        sleeper = sleep_program()
        holder = w.pid
        # Its worker busy, then killed with a call that needs w queued behind.
        busy = pool.submit(sleeper, [milliseconds(30_000)])
        if wait_until_started(pool, sleeper.name) != holder:
            busy.result(timeout=120)
            busy = pool.submit(STEP, [w, x], keep=0)  # on w's worker, for sure
        queued = pool.submit(STEP, [w, x], keep=0)
        os.kill(holder, signal.SIGKILL)
        with pytest.raises(WorkerCrashedError, match="the weights"):
            queued.result(timeout=60)
        for call in (lambda: pool.run(STEP, [w, x]), w.fetch, lambda: pool.put(x, like=w)):
            with pytest.raises(WorkerCrashedError, match=f"pid {holder}.*the weights"):
                call()
        with pytest.raises(WorkerCrashedError):
            busy.result(timeout=60)
        assert "lost" in repr(w)
        if other.pid != holder:
            np.testing.assert_array_equal(other.fetch(), x)
        np.testing.assert_array_equal(pool.run(AFFINE, [x])[0], x * 3)
        assert np.asarray(pool.put(x)).sum() == N


def test_the_native_loop_refuses_places_outside_their_segments() -> None:
    # The native loop runs a PJRT plugin's executables: the program on the CPU plugin.
    executable = plugin_executable(lower(lambda x: x * 2 + 1, [f32(N)], platform="pjrt_cpu"))
    ours, theirs = socket.socketpair()
    arena = mmap.mmap(-1, 4096 + protocol.CONTROL_BYTES)
    loop = _pjrt.HotLoop(theirs.fileno(), arena, 4096, 0.0)
    loop.set_placed_slot(3, executable.native, [(code_of_dtype(np.float32), [N])])
    segment = shm.new_segment(4 * N)
    try:
        # Sent by the protocol module with the segment's descriptor: the loop maps it,
        # runs and replies; the outputs are where the frame said.
        data = np.frombuffer(mmap.mmap(segment, 4 * N), np.float32)
        data[:] = 1.0
        whole = ((places.PLACE, 5, 0),)
        run = places.PlacedRun(11, 3, True, whole, whole, ((5, 4 * N),))
        protocol.send_frame(ours, run, (segment,))
        protocol.send_frame(ours, protocol.Exit())
        message = protocol.finish_frame(theirs, *loop.serve())
        assert message == (protocol.Exit(), [])
        assert protocol.recv_frame(ours) == (protocol.HotReply(11), [])
        assert float(data[0]) == 3.0 and loop.segment_count == 2
        with pytest.raises(ValueError, match="does not lie in its segment"):
            loop.run_placed(12, 3, [(places.PLACE, 5, 64)], list(whole), True)
        with pytest.raises(ValueError, match="segment 9 is not held"):
            loop.run_placed(13, 3, [(places.PLACE, 9, 0)], list(whole), True)
        with pytest.raises(LookupError):
            loop.run_placed(14, 4, list(whole), list(whole), True)
        with pytest.raises(ValueError, match="not held"):
            loop.run_placed(15, 3, [(places.VALUE, 1, 0)], list(whole), True)
        assert places.decode_placed(places.placed_frame(run, 1)[6:]) == run
    finally:
        os.close(segment)
        ours.close()
        theirs.close()


def mapped_bytes(pid: int) -> int:
    """The bytes of a process's memfd mappings, its arena's left out."""
    total = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "/memfd:" in line and "arena" not in line:
            start, end = (int(address, 16) for address in line.split()[0].split("-"))
            total += end - start
    return total


def test_dropped_results_and_values_give_their_memory_back() -> None:
    x = np.ones(N, np.float32)
    bound = 8 * N  # two segments of N floats
    with Pool(1, segment_cache_bytes=bound) as pool:
        worker = pool.worker_info[0]["pid"]
        held = [pool.run(AFFINE, [x])[0] for _ in range(12)]
        values = [pool.put(x) for _ in range(4)]
        assert pool._segments.lent <= pool._segments.max_fds
        assert pool.worker_info[0]["value_bytes"] == 4 * x.nbytes
        del held, values
        gc.collect()
        # Within a turn of the manager, the idle worker lets go of what the pool did.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            pool.worker_info[0]["values"] or mapped_bytes(worker) > bound
        ):
            time.sleep(0.01)
        assert pool.worker_info[0]["values"] == 0
        assert mapped_bytes(worker) <= bound
        assert pool._segments.lent == 0 and pool._segments.held <= 2


def test_asarray_makes_the_dtype_a_program_reads_and_a_conversion_is_said(pool) -> None:
    """Issue 63: pool.asarray(np.arange(16)) stayed int64, and a run of a program lowered from
    int32 arrays converted it, into a copy, without a word."""
    triple = lower(lambda i: i * 3, [jax.ShapeDtypeStruct((N,), jnp.int32)])
    made = pool.asarray(np.arange(N))  # numpy's int64, as jnp.asarray makes it: int32
    assert made.dtype == np.int32
    assert pool.asarray(np.ones(4)).dtype == np.float32  # float64: float32
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # as Python's own filter says a warning: once
        (out,) = pool.run(triple, [made])
        np.testing.assert_array_equal(out, np.arange(N, dtype=np.int32) * 3)
        kept = pool.asarray(np.arange(N), dtype=np.int64)  # the caller's dtype, kept
        assert kept.dtype == np.int64
        for _ in range(3):
            (out,) = pool.run(triple, [kept])
        np.testing.assert_array_equal(out, np.arange(N, dtype=np.int32) * 3)
    said = [str(w.message) for w in seen if issubclass(w.category, ConvertedInputWarning)]
    assert len(said) == 1, said
    assert "argument 0 of jit__lambda lies in the pool's shared memory as int64" in said[0]
    assert "the program reads int32" in said[0] and "dtype=np.int32" in said[0]


def test_a_workers_warnings_reach_the_caller_once_each(tmp_path, monkeypatch, caplog) -> None:
    """Issue 63: what a worker warned of (a setting it cannot read, its initializer's own
    warning) reached only the pool's debug log. Now each comes once per pool, from every
    worker that gives it: logged on pjrt_pool.worker and issued as a WorkerWarning."""
    # A value of its own: a warning this process said before (another test's pool) is said
    # once per process, and the workers' same warning with it.
    monkeypatch.setenv("PJRT_POOL_CACHE_MAX_SIZE", "lots-of-room")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warns = lambda: __import__("warnings").warn("the initializer's own warning")  # noqa: E731
        with Pool(2, cache_dir=tmp_path, initializer=warns) as two:
            for _ in range(3):
                two.run(AFFINE, [np.ones(N, np.float32)])
    said = [str(w.message) for w in seen if issubclass(w.category, WorkerWarning)]
    assert len(said) == 2, said
    assert any(text.endswith(": the initializer's own warning") for text in said), said
    assert any("PJRT_POOL_CACHE_MAX_SIZE: not a size: 'lots-of-room'" in text for text in said), (
        said
    )
    logged = [r.getMessage() for r in caplog.records if r.name == "pjrt_pool.worker"]
    assert sorted(logged) == sorted(said)
