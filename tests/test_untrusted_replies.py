"""What a worker says is checked before the parent acts on it.

A worker is made to lie (an initializer that wraps the worker's own
send_frame), and the parent must fail only that task, with a PoolError,
replace the worker and go on: never map memory the reply names without
checking the descriptor (a SIGBUS kills the parent), never read a frame
past its length, never import a module an error names. Scenarios that could
kill the parent run in a child process (conftest.child).
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, child

from pool.errors import RemoteWorkerError, rebuild_error
from worker.errors import NeverCompileError
from worker.wire import protocol, shm

LIAR = """
import dataclasses, jax.numpy as jnp

def lie(flag, how):
    # In the worker: the next reply whose outputs are in a new segment, once the flag
    # file exists, names another segment: a 4 KiB one, or an unsealed one of the size.
    from worker.wire import protocol
    real = protocol.send_frame

    def send_frame(sock, message, fds=()):
        new = type(message) is protocol.Reply and message.output_place == "new"
        if new and os.path.exists(flag):
            os.remove(flag)
            fd = os.memfd_create("liar")
            os.ftruncate(fd, 4096 if how == "small" else message.output_size)
            try:
                return real(sock, message, (fd,))
            finally:
                os.close(fd)
        return real(sock, message, fds)

    protocol.send_frame = send_frame

program = lower(lambda v: jnp.tile(v, 49152), [sds(8)])  # 1.5 MiB out: a segment of its own
x = np.ones(8, np.float32)
"""


LIED_RUN = """
    try:
        print("lied:", float(pool.run(program, [x])[0].sum()), flush=True)
    except PoolError as error:
        print("refused:", error, flush=True)
    print("next:", float(pool.run(program, [x])[0].sum()), flush=True)
    print("workers:", len(pool.worker_info), flush=True)
"""
"""The end of a liar's scenario, inside `with Pool(...) as pool:`: the run the worker lies
about (refused, or not), then the next run and the workers left."""


@pytest.mark.parametrize("how", ["small", "unsealed"])
def test_a_reply_naming_memory_its_segment_lacks_fails_the_task_not_the_parent(
    tmp_path, how
) -> None:
    # The parent mapped the size the reply named with MAP_FIXED, never compared with
    # the descriptor's: a 1.5 MiB reply on a 4 KiB memfd made .sum() kill the parent
    # with a bus error (exit 135); an unsealed segment could be shrunk later.
    flag = tmp_path / "lie"
    done = child(
        LIAR
        + textwrap.dedent(f"""
        flag = {str(flag)!r}
        # No segment kept for reuse: every large output comes in a new segment.
        with Pool(1, initializer=lie, initargs=(flag, {how!r}), segment_cache_bytes=0) as pool:
            print("first:", float(pool.run(program, [x])[0].sum()), flush=True)
            open(flag, "w").close()
        """)
        + LIED_RUN,
        timeout=120,
    )
    assert "first: 393216.0" in done.stdout, done.stdout
    assert "refused:" in done.stdout and "does not fit its shared memory" in done.stdout, (
        done.stdout
    )
    reason = "holds 4096 bytes" if how == "small" else "not sealed"
    assert reason in done.stdout, done.stdout
    assert "next: 393216.0" in done.stdout and "workers: 1" in done.stdout, done.stdout


SPARE_LIAR = """
import dataclasses, jax.numpy as jnp

def lie(flag, how):
    # In the worker: the next reply of a Run, once the flag file exists, says its outputs
    # lie over the inputs' segment (Run.spare): past its end, or with none offered.
    from worker.wire import protocol
    real = protocol.send_frame

    def send_frame(sock, message, fds=()):
        if type(message) is protocol.Reply and message.output_place in ("new", "spare"):
            if os.path.exists(flag):
                os.remove(flag)
                offsets = (1 << 40,) if how == "past" else message.output_offsets
                message = dataclasses.replace(message, output_place="spare",
                                              output_offsets=offsets)
                return real(sock, message, ())
        return real(sock, message, fds)

    protocol.send_frame = send_frame

# "past": a 2 MiB input, copied into a segment the first run is offered; "unasked": an
# input in the arena (no segment to offer) and 1.5 MiB out.
if how == "past":
    program, x = lower(lambda v: v * 2, [sds(1 << 19)]), np.ones(1 << 19, np.float32)
else:
    program, x = lower(lambda v: jnp.tile(v, 49152), [sds(8)]), np.ones(8, np.float32)
"""


@pytest.mark.parametrize("how", ["past", "unasked"])
def test_outputs_said_to_lie_over_the_inputs_are_checked_first(tmp_path, how) -> None:
    flag = tmp_path / "lie"
    open(flag, "w").close()  # the first run lies
    done = child(
        f"how = {how!r}\n"
        + SPARE_LIAR
        + textwrap.dedent(f"""
        with Pool(1, initializer=lie, initargs=({str(flag)!r}, how)) as pool:
        """)
        + LIED_RUN,
        timeout=120,
    )
    reason = "does not fit its shared memory" if how == "past" else "outputs in 'spare'"
    assert "refused:" in done.stdout and reason in done.stdout, done.stdout
    assert "next: 1048576.0" in done.stdout or "next: 393216.0" in done.stdout, done.stdout
    assert "workers: 1" in done.stdout, done.stdout


def test_segments_are_sealed_at_their_size() -> None:
    fd = shm.new_segment(8192)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)  # a shrink: what would fault the other side
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1 << 20)
        shm.check_received(fd, 8192, "a segment")
        with pytest.raises(ValueError, match="holds 8192 bytes"):
            shm.check_received(fd, 8193, "a segment")
    finally:
        os.close(fd)
    read, write = os.pipe()
    try:
        with pytest.raises(ValueError, match="not a shared-memory segment"):
            shm.check_received(read, 1, "a pipe")
    finally:
        os.close(read)
        os.close(write)


def test_outputs_outside_their_memory_are_refused() -> None:
    from worker.records import ArrayType

    f32 = ArrayType.of("float32", (16,))
    shm.check_layout([f32, f32], [0, 64], 128, "the arena")
    for offsets, size in (([0, 64], 127), ([0, 32], 128), ([0, -64], 128), ([0], 128)):
        with pytest.raises(ValueError):
            shm.check_layout([f32, f32], offsets, size, "the arena")


def test_a_hot_frame_whose_length_is_not_its_formats_is_a_protocol_error() -> None:
    # The decoder took a HotReply whose length field said 40 as HotReply(7) and
    # parsed its extra bytes as the next frame (a Reply for task 99).
    ours, theirs = socket.socketpair()
    try:
        follower = protocol.Reply(99)
        payload = struct.pack("<q8x", 7)
        header = struct.pack("<IBB", 40, 0, protocol.Format.HOT_REPLY)
        theirs.sendall(header + payload)
        protocol.send_frame(theirs, follower)
        with pytest.raises(ValueError, match="not a frame of ours"):
            protocol.recv_frame(ours)
        # A well-formed hot frame still reads as itself.
        ours2, theirs2 = socket.socketpair()
        protocol.send_frame(theirs2, protocol.HotReply(7))
        assert protocol.recv_frame(ours2) == (protocol.HotReply(7), [])
        ours2.close()
        theirs2.close()
    finally:
        ours.close()
        theirs.close()


def remote(module: str, qualname: str, attributes: dict | None = None) -> protocol.RemoteError:
    return protocol.RemoteError(module, qualname, "boom", attributes or {}, "Traceback ...")


def test_errors_are_rebuilt_only_from_pythons_and_the_projects_classes() -> None:
    assert type(rebuild_error(remote("builtins", "ValueError"))) is ValueError
    rebuilt = rebuild_error(remote("worker.errors", "NeverCompileError", {"program": "p"}))
    assert isinstance(rebuilt, NeverCompileError) and rebuilt.program == "p"
    private = rebuild_error(remote("builtins", "ValueError", {"_secret": 1, "__class__": 2}))
    assert type(private) is ValueError and not hasattr(private, "_secret")
    other = rebuild_error(remote("numpy.exceptions", "AxisError"))
    assert isinstance(other, RemoteWorkerError) and "numpy.exceptions.AxisError: boom" in str(other)


def test_an_error_naming_a_module_does_not_make_the_parent_import_it() -> None:
    # `this` prints the Zen of Python when imported: a reply naming it ran that import.
    code = (
        "import sys\n"
        "from pool.errors import rebuild_error\n"
        "from worker.wire.protocol import RemoteError\n"
        "error = rebuild_error(RemoteError('this', 'Error', 'boom', {}, ''))\n"
        "print(type(error).__name__, 'this' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "RemoteWorkerError False", done.stdout
