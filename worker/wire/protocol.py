"""The wire protocol between the parent and a worker: frames over a Unix socket.

Each worker has its own socketpair. A frame is::

    length   4 bytes, little-endian, of the payload
    nfds     1 byte, the number of file descriptors sent with the frame
    format   1 byte: Format.PICKLE, Format.HOT_RUN, Format.HOT_REPLY or Format.PLACED_RUN
    payload  a pickled message (below), a hot message's fixed fields, or a placed run's

Every payload is at least MIN_PAYLOAD bytes (pickles are padded: unpickling
stops at the pickle's end), so a reader takes the header and MIN_PAYLOAD
bytes in one system call without ever reading into the next frame, and a hot
message, which is exactly that long, arrives whole in that one call.

The hot messages are the hot path of a small program: a run of an executable
the worker has loaded, its inputs and outputs in the worker's arena where
the worker laid them out before. The worker names such a program by a slot
(the `hot_slot` of the Reply to a full Run); HotRun asks it to run the slot
on what the arena holds, and HotReply says the outputs are where they were
last time. Anything else that happens to a HotRun (an error, a program the
worker unloaded) is answered by a pickled Reply, as for a Run.

A placed run (PlacedRun, worker.wire.places, with the Where of each array)
is the hot path of every other run of a program the worker has loaded: its
inputs and outputs anywhere in shared memory (the arena, or a segment the
parent made) or kept in the worker as values. Each
array is a `Where` (kind, id, offset): PLACE, the id of a segment (0: the
arena) and the byte offset there; or VALUE, the id of a value the worker
keeps (an input's, or the id to keep an output under). The worker maps each
segment once, when the first frame that names it brings its descriptor,
and keeps it mapped (so its pages fault in once), until a later frame names
it among `forgets`; `drops` are values the parent no longer holds. The
native hot loop answers a PlacedRun with a HotReply; the outputs are where
the frame said.

File descriptors (memfd shared-memory segments) travel as SCM_RIGHTS
ancillary data on the frame's first byte. Pickle is safe here: both ends are
the same user's processes, started by the parent for itself; nothing from the
disk cache or the network is ever unpickled.

Messages are small dataclasses. Parent to worker: Init (which may name
executables to load before Ready: a preloaded Pool), Compile, Run, HotRun,
PlacedRun, Put and Fetch (of kept values), Exit. Worker to parent: Ready
once after start-up, then one Reply or HotReply per request, in order.

Besides the frames, the worker's arena ends with CONTROL_BYTES that the
worker writes and the parent reads: the id of the request the worker took
up last, written before any work on it. When a worker dies, that tells the
parent whether the task it was given had started (a crash to blame on the
program) or not (the worker died idle: send the task elsewhere).
"""

from __future__ import annotations

import array
import enum
import errno
import math
import os
import pickle
import resource
import select
import socket
import struct
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from worker.errors import PjrtPoolError
from worker.records import (
    ArrayType,
    CompileStatistics,
    JaxCompile,
    LoweredProgram,
    ProgramSpec,
)
from worker.wire.places import (
    MAX_PLACED_LENGTH,
    PLACED_HEAD_LENGTH,
    PLACED_RUN_FORMAT,
    PlacedRun,
    Where,
    decode_placed,
    placed_frame,
)

_HEADER = struct.Struct("<IBB")
MAX_FDS = 64
"""The most descriptors one frame carries (native/hot_loop.cc's kMaxFds)."""
MIN_PAYLOAD = 16
"""The least bytes of any frame's payload: a hot message's size (see the module docstring)."""
_FIRST_READ = _HEADER.size + MIN_PAYLOAD
_MAX_POLL_MS = 2**31 - 1  # poll's limit; a longer wait ends early and is reported as not readable
_CTRUNC = int(socket.MSG_CTRUNC)  # an IntFlag, whose & with an int runs in Python (3 us)


class Format(enum.IntEnum):
    """How a frame's payload is written."""

    PICKLE = 0  # a pickled message
    HOT_RUN = 1  # HotRun's fields
    HOT_REPLY = 2  # HotReply's fields
    PLACED_RUN = PLACED_RUN_FORMAT  # PlacedRun's fields (worker.wire.places)


class HotRun(NamedTuple):
    """Run the executable in a hot slot on the inputs the arena holds (see the docstring)."""

    task_id: int
    slot: int
    zero_copy: bool


class HotReply(NamedTuple):
    """The HotRun (or PlacedRun) of this task ran: its outputs are where the slot's last ones
    were (where the PlacedRun said)."""

    task_id: int


_HOT_RUN = struct.Struct("<IBBqiB3x")  # the header and HotRun's fields, MIN_PAYLOAD of them
_HOT_REPLY = struct.Struct("<IBBq8x")  # the header and HotReply's field, padded likewise
assert _HOT_RUN.size == _HOT_REPLY.size == _FIRST_READ
# Plain ints of the hot formats: reading an enum member off its class costs more than
# packing the frame, and the hot path does it on every run.
_HOT_RUN_FORMAT = int(Format.HOT_RUN)
_HOT_REPLY_FORMAT = int(Format.HOT_REPLY)
_ANCILLARY_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)

CONTROL_BYTES = 64
"""Bytes after the arena's data: the id of the request the worker started last (int64)."""

STARTED = struct.Struct("<q")
"""The layout of the started request's id at the start of the control bytes."""


class ConnectionLostError(PjrtPoolError, EOFError):
    """The other end closed the socket (the process exited or died)."""


class DescriptorLimitError(PjrtPoolError, OSError):
    """This process has no file descriptor left for shared memory (EMFILE).

    When the limit is hit while receiving, the frame was read whole (the
    stream stays usable) but the descriptors sent with it were dropped by
    the kernel; `message` holds what was received.
    """

    def __init__(self, doing: str, message: Any = None) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            open_now = len(os.listdir("/proc/self/fd"))
        except OSError:
            open_now = -1
        count = f"{open_now} open, " if open_now >= 0 else ""
        text = (
            doing  # rebuilt from a worker's reply: the message is whole already
            if doing.startswith("out of file descriptors")
            else f"out of file descriptors while {doing} ({count}limit {soft}, the soft "
            "RLIMIT_NOFILE): raise the limit (ulimit -n, resource.setrlimit), keep fewer large "
            "results alive, or lower the pool's segment_fds"
        )
        super().__init__(errno.EMFILE, text)
        self.message = message


def send_frame(sock: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    """Sends one message, with file descriptors attached.

    A message goes on the wire as the tuple (kind, *fields): pickling a plain
    tuple takes a microsecond, a dataclass several, and small programs make
    thousands of round trips a second. A hot message goes as its fixed
    fields, in one system call.
    """
    if type(message) is HotRun:
        sock.sendall(_HOT_RUN.pack(MIN_PAYLOAD, 0, _HOT_RUN_FORMAT, *message))
        return
    if type(message) is HotReply:
        sock.sendall(_HOT_REPLY.pack(MIN_PAYLOAD, 0, _HOT_REPLY_FORMAT, *message))
        return
    if type(message) is PlacedRun:
        data = placed_frame(message, len(fds))
        if not fds:
            sock.sendall(data)
            return
    else:
        data = _pickled_frame(message, len(fds))
    if fds:
        # The descriptors ride on the first chunk; a stream socket may take
        # only part of a large frame per sendmsg, so send the rest plainly.
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def _pickled_frame(message: Any, nfds: int) -> bytes:
    """A pickled message's frame: the header and the padded pickle."""
    kind = _KINDS[type(message)]
    payload = pickle.dumps((kind, *vars(message).values()), protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) < MIN_PAYLOAD:
        payload += bytes(MIN_PAYLOAD - len(payload))
    return _HEADER.pack(len(payload), nfds, Format.PICKLE) + payload


def spin_until_readable(poller: select.poll, seconds: float) -> bool:
    """Polls for up to `seconds` without sleeping; returns whether the socket is readable.

    poller has the socket registered for POLLIN (kept with the socket: making
    one per call costs more than a small program's run).

    Blocking puts the thread (on a virtual machine, the whole virtual CPU) to
    sleep, and waking it costs tens of microseconds per message: more than a
    small program's run. A short spin before a blocking read catches a
    prompt reply or request without that cost, and bounds the CPU it burns.
    """
    if seconds <= 0:
        return False
    deadline = time.perf_counter() + seconds
    while True:
        if poller.poll(0):
            return True
        if time.perf_counter() >= deadline:
            return False


def wait_until_readable(poller: select.poll, spin_seconds: float, timeout: float | None) -> bool:
    """Spins as spin_until_readable does, then sleeps until the socket is readable or
    `timeout` seconds have passed since the call (None: no limit); returns whether it is."""
    started = time.perf_counter()
    spin = spin_seconds if timeout is None else min(spin_seconds, timeout)
    if spin_until_readable(poller, spin):
        return True
    if timeout is None:
        return bool(poller.poll())
    left = timeout - (time.perf_counter() - started)
    # poll takes whole milliseconds: round up, so that it never returns early for good.
    return left > 0 and bool(poller.poll(min(math.ceil(left * 1000), _MAX_POLL_MS)))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            raise ConnectionLostError("connection closed in the middle of a frame")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> tuple[Any, list[int]]:
    """Receives one message and the file descriptors sent with it (caller closes them).

    Raises ConnectionLostError at the end of the stream, DescriptorLimitError
    when the kernel dropped descriptors for want of room, and whatever
    unpickling raises for bytes that are not a frame; the descriptors that
    came with a frame that raises, or whose reading is interrupted, are
    closed here. (A signal handled right as recvmsg returns, before Python
    stores its result, loses them: no Python code can close that gap.)
    """
    data, ancillary, flags, _ = sock.recvmsg(_FIRST_READ, _ANCILLARY_SPACE)
    if not ancillary and not flags and len(data) == _FIRST_READ:
        # The hot path's reply, read whole, with no descriptors and nothing truncated:
        # the checks _finish makes of a frame, made here without its general steps.
        length, sent_fds, form, task_id = _HOT_REPLY.unpack(data)
        if form == _HOT_REPLY_FORMAT and length == MIN_PAYLOAD and sent_fds == 0:
            return HotReply(task_id), []
    received = array.array("i")  # holds the descriptors from the moment they are parsed
    try:
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
        return _finish(sock, data, received, bool(flags & _CTRUNC))
    except BaseException:
        _close_all(received)
        raise


def finish_frame(
    sock: socket.socket, first: bytes, fds: list[int], truncated: bool
) -> tuple[Any, list[int]]:
    """recv_frame for a frame whose first read was made elsewhere (the worker's hot loop).

    first holds the bytes that read took (empty at the end of the stream),
    fds the descriptors that came with them and truncated whether the kernel
    dropped some (MSG_CTRUNC). Raises and closes them as recv_frame does.
    """
    try:
        return _finish(sock, first, fds, truncated)
    except BaseException:
        _close_all(fds)
        raise


def _close_all(fds: Sequence[int]) -> None:
    """Closes descriptors received with a frame that failed: none is left open."""
    for fd in fds:
        os.close(fd)


def _finish(
    sock: socket.socket, data: bytes, received: Sequence[int], truncated: bool
) -> tuple[Any, list[int]]:
    """The message of a frame whose first read gave data and descriptors; reads the rest."""
    if not data:
        raise ConnectionLostError("connection closed")
    if len(data) < _FIRST_READ:
        data += _recv_exactly(sock, _FIRST_READ - len(data))
    length, sent_fds, form = _HEADER.unpack_from(data)
    if form not in (Format.PICKLE, Format.PLACED_RUN) and length != MIN_PAYLOAD:
        # A hot frame is exactly its fields: with any other length, what follows
        # would be read as the next frame. Descriptors sent with one come back to
        # the caller, which closes them (the worker does).
        raise ValueError(f"not a frame of ours (format {form}, {length} bytes)")
    message = _decode(sock, data, length, form)
    if truncated or len(received) != sent_fds:
        # The kernel dropped descriptors this process had no room for.
        raise DescriptorLimitError("receiving shared memory from another process", message)
    return message, list(received)


def _decode(sock: socket.socket, first: bytes, length: int, form: int) -> Any:
    """The message of a frame whose first _FIRST_READ bytes were read; reads the rest."""
    if form == Format.HOT_REPLY:
        return HotReply(_HOT_REPLY.unpack(first)[3])
    if form == Format.HOT_RUN:
        _, _, _, task_id, slot, zero_copy = _HOT_RUN.unpack(first)
        return HotRun(task_id, slot, bool(zero_copy))
    if form == Format.PLACED_RUN and PLACED_HEAD_LENGTH <= length <= MAX_PLACED_LENGTH:
        payload = first[_HEADER.size :] + _recv_exactly(sock, length - MIN_PAYLOAD)
        return decode_placed(payload)
    if form != Format.PICKLE or length < MIN_PAYLOAD:
        raise ValueError(f"not a frame of ours (format {form}, {length} bytes)")
    payload = first[_HEADER.size :]
    if length > MIN_PAYLOAD:
        payload += _recv_exactly(sock, length - MIN_PAYLOAD)
    kind, *fields = pickle.loads(payload)
    return _MESSAGES[kind](*fields)


# -- parent to worker --------------------------------------------------------


@dataclass(frozen=True)
class Init:
    """Map the worker's arena (the segment sent with the frame) and run the initializer.

    The arena is a shared-memory segment owned by the parent for the worker's
    life; small tasks pass inputs and outputs through it, saving the system
    calls of a fresh segment per task. `initializer` holds the user's
    cloudpickled callable and arguments, or is empty.
    The segment is arena_size + CONTROL_BYTES long. `preload` names
    executables, as (cache key, program name) pairs, that the worker loads
    from the disk cache before it says Ready (a Pool made with preload=), and
    primes too (Executable.prime) when `prime`; each is then loaded under its
    key, as a Run by that key would load it.
    """

    initializer: bytes
    arena_size: int
    preload: tuple[tuple[str, str], ...] = ()
    prime: bool = False


@dataclass(frozen=True)
class Compile:
    """Compile or load a program and describe it.

    `compile_options` replaces the default CompileOptionsProto when given.
    With `jax`, the program is compiled for JAX's own persistent cache
    instead, and filed there under JAX's key (worker.compile.for_jax).
    """

    task_id: int
    program_id: str
    program: LoweredProgram
    name: str
    compile_options: bytes | None = None
    jax: JaxCompile | None = None


@dataclass(frozen=True)
class Run:
    """Run a program on inputs in shared memory (or kept values), its full form.

    The parent sends it for a program's first run in a worker (which loads
    it, and gives it the slots its later runs name: Reply.hot_slot,
    Reply.placed_slot), and for a run its slot cannot take (inputs of other
    types than the program's own). `sources` give each input's Where;
    `input_types` their types, or None when they are the program's own input
    types (the usual case: only programs of unknown types, or ProgramSpec
    runs, send them). `destinations` give each output's Where, or are None
    when the parent does not know the outputs yet (a first run): the worker
    then lays them out in the arena after the arena's inputs if they fit,
    else over the task's own copy of its inputs when the request offers it
    (`spare`: that segment's id and bytes) and they fit there ("spare": the
    run has ended on every device before any output is copied out, so no
    input is read after), else in a segment it makes and sends back ("new"),
    and keeps the outputs `keep` names ((output index, value id)) instead. `segments`, `drops` and
    `forgets` are as in PlacedRun (the descriptors come with the frame).
    `want_output_types` asks for the output types in the reply; the parent
    remembers them per program, so that small replies stay small. `program`
    is None when the parent knows the worker has it loaded, or when the task
    names a cache key instead (`cache_key`: run what the disk cache holds
    under that key, as a manifest does). `compile_options` go with
    `program`, for compiling it (None: the default). With `bundle` (a
    bundle's absolute path or URL), `cache_key` names a program of that
    bundle: the worker loads the entry of the program (`name`) built for its
    plugin and host from the bundle, read-only, as Manifest.run in one
    process does (worker.bundle.loading).
    """

    task_id: int
    program_id: str
    program: LoweredProgram | None
    name: str
    input_types: tuple[ArrayType, ...] | None
    sources: tuple[Where, ...]
    destinations: tuple[Where, ...] | None
    zero_copy: bool
    cache_key: str | None = None
    want_output_types: bool = True
    compile_options: bytes | None = None
    bundle: str | None = None
    keep: tuple[tuple[int, int], ...] = ()
    segments: tuple[tuple[int, int], ...] = ()
    drops: tuple[int, ...] = ()
    forgets: tuple[int, ...] = ()
    spare: tuple[int, int] | None = None


@dataclass(frozen=True)
class Put:
    """Copy the array at `source` (a PLACE Where) of `array_type` to the device and keep it as
    value `value_id`; `segments`, `drops` and `forgets` as in PlacedRun."""

    task_id: int
    value_id: int
    source: Where
    array_type: ArrayType
    segments: tuple[tuple[int, int], ...] = ()
    drops: tuple[int, ...] = ()
    forgets: tuple[int, ...] = ()


@dataclass(frozen=True)
class Fetch:
    """Copy the kept value `value_id` (row-major) to `destination` (a PLACE Where), or, with
    value_id -1, only map, drop and forget (the parent hands back what it let go of)."""

    task_id: int
    value_id: int
    destination: Where
    segments: tuple[tuple[int, int], ...] = ()
    drops: tuple[int, ...] = ()
    forgets: tuple[int, ...] = ()


@dataclass(frozen=True)
class Exit:
    """Finish and exit."""


# -- worker to parent --------------------------------------------------------


class HotSlot(NamedTuple):
    """A hot slot a worker gave a program it preloaded (Ready.hot): a HotRun of `slot` runs
    it on inputs of `input_types` at `input_offsets` in the arena, and leaves its outputs,
    of `output_types`, at `output_offsets` there."""

    key: str
    slot: int
    input_types: tuple[ArrayType, ...]
    input_offsets: tuple[int, ...]
    output_types: tuple[ArrayType, ...]
    output_offsets: tuple[int, ...]


@dataclass(frozen=True)
class Ready:
    """Start-up finished: the plugin is loaded (and the initializer ran, and Init's preload
    loaded).

    `loaded` are the keys of the programs it preloaded, `statistics` and
    `counters` what preloading added to its CompileStatistics and its disk
    cache counters (None: it preloaded nothing). With an `error` raised
    while preloading, `failed_program` names the program that did not load.
    `hot` are the hot slots of the preloaded programs whose inputs and
    outputs fit the arena, so that their first runs go as HotRuns. `warnings` are those it
    gave as it started (worker.log.said).
    """

    pid: int
    plugin: dict[str, Any]
    startup_seconds: float
    error: RemoteError | None = None
    loaded: tuple[str, ...] = ()
    statistics: CompileStatistics | None = None
    counters: dict[str, int] | None = None
    failed_program: str | None = None
    hot: tuple[HotSlot, ...] = ()
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class RemoteError:
    """An exception raised in the worker, in a form that survives pickling.

    The parent rebuilds an exception of the same class (see
    pool.errors.rebuild_error) so that callers catch the same exceptions the
    in-process API raises.
    """

    module: str
    qualname: str
    message: str
    attributes: dict[str, Any]
    traceback: str

    @classmethod
    def of(cls, error: BaseException) -> RemoteError:
        """Captures an exception, its simple attributes and its traceback."""
        attributes = {
            name: value
            for name, value in vars(error).items()
            if isinstance(value, (int, float, str, bool, type(None)))
        }
        return cls(
            module=type(error).__module__,
            qualname=type(error).__qualname__,
            message=str(error),
            attributes=attributes,
            traceback="".join(traceback.format_exception(error)),
        )


OutputPlace = Literal["placed", "arena", "spare", "new"]
"""Where a Run's outputs lie (Reply.output_place): where the request's destinations said,
after the inputs in the arena, over the inputs in the segment the request offered
(Run.spare), or in a segment the worker made and sent with the reply."""


@dataclass(frozen=True)
class Reply:
    """The result of one request.

    For Compile: `spec`. For Run: the outputs at `output_offsets` in the
    `output_place`: "placed" (where the request's destinations said), "arena",
    "spare" (the segment the request offered) or "new" (a segment sent with
    this frame), of `output_types` when the
    request wanted them (a kept output's offset is -1). `statistics` is what the request added to
    the worker's CompileStatistics and `counters` the worker's disk cache
    counters, both only when the request compiled or loaded something (None
    otherwise: nothing changed), with `remote_counters` the worker's remote
    tier's counters when it opened one; `evicted` lists programs the worker unloaded
    to make room. `fatal` says the error left the device unusable (see
    worker.plugin.device_errors): the worker exits after this reply. `phases` are
    the seconds per phase of the compile or load a Compile request did
    (worker.phases). `hot_slot` (not -1) names the run's program for HotRun
    requests: its inputs and outputs lie in the arena as they did now.
    `placed_slot` (not -1) names it for PlacedRun requests. `values_held` (a
    Fetch's reply, else -1) counts the values the worker keeps, as its own table
    says (the parent's mirror can be checked against it). `warnings` are those the worker
    gave since its last reply (worker.log.said), for the pool to pass on. Fields are
    kept few and plain because every reply is pickled, and a small
    program's whole round trip is a few hundred microseconds.
    """

    task_id: int
    error: RemoteError | None = None
    spec: ProgramSpec | None = None
    output_types: tuple[ArrayType, ...] | None = None
    output_offsets: tuple[int, ...] = ()
    output_size: int = 0
    output_place: OutputPlace = "new"
    statistics: CompileStatistics | None = None
    counters: dict[str, int] | None = None
    remote_counters: dict[str, int] | None = None
    evicted: tuple[str, ...] = ()
    fatal: bool = False
    phases: dict[str, float] | None = None
    hot_slot: int = -1
    placed_slot: int = -1
    values_held: int = -1
    warnings: tuple[str, ...] = ()


_MESSAGES: tuple[type, ...] = (Init, Compile, Run, Exit, Ready, Reply, Put, Fetch)
_KINDS = {cls: index for index, cls in enumerate(_MESSAGES)}
