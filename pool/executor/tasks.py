"""Task bookkeeping: what was asked, its future, and what to send for it.

Kept apart from process bookkeeping (pool.executor.workers): a Task knows its program,
its arguments and its future, never a process's state. The Pool moves tasks
between its pending queue and the workers::

    QUEUED --claimed with a worker--> RUNNING --settle()--> DONE   (exactly once)
    RUNNING --worker died before starting it, or was killed for
              another reason--> QUEUED again (at most MAX_REQUEUES times)

A task is settled (its future resolved or failed, its shared memory given
back) by exactly one thread: the one whose ``Dispatch._settle_locked`` call
flips ``done`` under the pool's lock.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import mmap
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from pool.executor.segments import Segment, SegmentCache, writer
from worker import protocol, shm
from worker.arguments import types_of
from worker.identity import compile_options as default_compile_options
from worker.records import ArrayType, DigestedProgram, LoweredProgram

logger = logging.getLogger("pjrt_pool.pool")

MAX_REQUEUES = 3
"""How often a task whose workers died before starting it is sent again before it fails."""

_MEMO_BYTES = 64 << 20
"""Program text (in characters) that the program-identity memo may keep alive."""

_text_digests: collections.OrderedDict[int, tuple[str, str]] = collections.OrderedDict()
_memo_size = 0
_memo_lock = threading.Lock()


def _text_digest(text: str) -> str:
    """The SHA-256 of a program text, memoized by the text object's identity.

    The same program is usually submitted many times, and hashing a large
    module costs more than a small program's whole round trip. The memo
    keeps the texts it knows alive (to make their identity safe to reuse),
    so it holds at most _MEMO_BYTES of them, the oldest going first.
    """
    global _memo_size
    memo = _text_digests.get(id(text))  # one dict lookup: atomic, no lock needed
    if memo is not None and memo[0] is text:
        return memo[1]
    digest = hashlib.sha256(text.encode()).hexdigest()
    if len(text) <= _MEMO_BYTES // 4:
        with _memo_lock:
            old = _text_digests.pop(id(text), None)
            if old is not None:
                _memo_size -= len(old[0])
            _text_digests[id(text)] = (text, digest)
            _memo_size += len(text)
            while _memo_size > _MEMO_BYTES:
                _, (dropped, _) = _text_digests.popitem(last=False)
                _memo_size -= len(dropped)
    return digest


def program_id(program: LoweredProgram, compile_options: bytes | None = None) -> str:
    """Identifies a program within a pool: platform, compile options and text.

    Two programs with the same text compiled with different options are
    different executables (fast math, for one, changes results), so the
    options are part of the identity wherever the pool routes, caches or
    quarantines a program. None means the default options. A program from
    lower() carries its text's digest (DigestedProgram), so that its text is
    hashed once, however large it is.
    """
    return _identity(program_text_digest(program), program.platform, compile_options)


def program_text_digest(program: LoweredProgram) -> str:
    """The SHA-256 of a program's text: the one lower() recorded, or computed (memoized)."""
    if isinstance(program, DigestedProgram):
        return program.text_sha256
    return _text_digest(program.text)


@functools.lru_cache(maxsize=4096)
def _identity(text_digest: str, platform: str | None, compile_options: bytes | None) -> str:
    options = default_compile_options() if compile_options is None else compile_options
    return hashlib.sha256(f"{platform or ''}\0{options.hex()}\0{text_digest}".encode()).hexdigest()


class ManagerThread(threading.Thread):
    """A pool's manager thread (pool.executor.manager), where most futures are settled.

    PoolFuture knows it by its class.
    """


class PoolFuture(Future):  # type: ignore[type-arg]
    """A Future of a pool's task, whose done-callbacks cannot break the pool.

    concurrent.futures logs an Exception from a done-callback, but lets a
    BaseException (KeyboardInterrupt, SystemExit) out into the thread that
    runs it: on the pool's manager thread, the callbacks after it never ran
    and the pool stopped. There, such an exception is now logged (on
    pjrt_pool.pool) and the other callbacks and the pool go on. Callbacks
    that run elsewhere (cancel(), add_done_callback on a done future)
    behave as concurrent.futures' do.
    """

    def add_done_callback(self, fn: Callable[[Future[Any]], object]) -> None:
        super().add_done_callback(functools.partial(_guarded, fn))


def _guarded(callback: Callable[[Future[Any]], object], future: Future[Any]) -> None:
    try:
        callback(future)
    except Exception:
        raise  # concurrent.futures logs it and goes on
    except BaseException as error:
        if not isinstance(threading.current_thread(), ManagerThread):
            raise
        logger.error(
            "a done-callback (%r) raised %r on the pool's manager thread; the pool goes on",
            callback,
            error,
            exc_info=True,
        )


@dataclass(eq=False)
class Task:
    """One compile or run request and the future that receives its result."""

    id: int
    kind: str  # "compile" or "run"
    program: LoweredProgram | None
    program_id: str
    name: str
    future: Future[Any]
    timeout: float | None
    input_types: tuple[ArrayType, ...] = ()
    input_offsets: tuple[int, ...] = ()
    input_size: int = 0
    input: Segment | None = None  # the segment holding large inputs
    in_arena: bool = False  # the inputs go through the worker's arena
    output: Segment | None = None  # a recycled segment offered for large outputs
    arrays: list[np.ndarray] | None = None  # the caller's arrays, while the caller waits (run)
    packed: bytearray | None = None  # the inputs copied at submit, laid out as in shared memory
    segments: SegmentCache | None = None  # where released segments go (set before they come)
    zero_copy: bool = True
    resend_program: bool = False
    deadline: float | None = None
    cache_key: str | None = None  # a run by ProgramSpec: load this key, no program
    spec_types: tuple[ArrayType, ...] | None = None  # that ProgramSpec's input types
    compile_options: bytes | None = None
    declared_types: bool = True  # the inputs have the program's declared types
    done: bool = False  # settled: flipped once, under the pool's lock
    sending: bool = False  # its request went (or may have gone) to its current worker
    kill_error: BaseException | None = None  # what to fail with if the pool kills its worker
    requeues: int = 0

    def request(
        self, worker_has_program: bool, arena: mmap.mmap, want_output_types: bool
    ) -> tuple[Any, tuple[int, ...]]:
        """Returns the message for a worker and the descriptors to send with it.

        Small inputs are copied into the worker's arena here, which the caller
        has claimed along with the worker; large inputs staged in private
        memory (see stage_inputs) go into a segment now.
        """
        if self.kind == "compile":
            message = protocol.Compile(
                self.id, self.program_id, self.program, self.name, self.compile_options
            )
            return message, ()
        in_arena = self.in_arena
        if in_arena:
            if self.packed is not None:
                memoryview(arena)[: len(self.packed)] = self.packed
            elif self.arrays is not None:
                shm.write(arena, self.arrays, self.input_offsets)
        elif self.packed is not None:
            self._packed_to_segment()
        include = self.cache_key is None and (self.resend_program or not worker_has_program)
        output = self.output
        message = protocol.Run(
            self.id,
            self.program_id,
            self.program if include else None,
            self.name,
            None if self.declared_types else self.input_types,
            self.input_offsets,
            self.input_size,
            self.zero_copy,
            in_arena=in_arena,
            cache_key=self.cache_key,
            want_output_types=want_output_types,
            output_capacity=output.capacity if output is not None and output.fd >= 0 else 0,
            compile_options=self.compile_options if include else None,
        )
        fds = () if in_arena else (self.input.fd,)  # type: ignore[union-attr]
        if output is not None and output.fd >= 0:
            fds += (output.fd,)
        return message, fds

    def _packed_to_segment(self) -> None:
        """Moves large inputs staged in private memory into a segment, for sending.

        packed goes only once the segment holds them all: if this is cut
        short, the next attempt writes them again.
        """
        assert self.segments is not None and self.input is not None and self.packed is not None
        packed = self.packed

        def write(memory: Any) -> None:
            memoryview(memory)[: len(packed)] = packed

        self.segments.fill(self.input, self.input_size, write)
        self.packed = None

    def release(self) -> None:
        """Gives the task's segments back for reuse once the worker is done with them."""
        if self.segments is not None:
            self.segments.give(self.input, self.output)
        self.arrays = self.packed = None


def pack(arrays: list[np.ndarray], offsets: tuple[int, ...], size: int) -> bytearray:
    """Copies arrays into private memory laid out as they will be in shared memory."""
    packed = bytearray(size)
    shm.write(packed, arrays, offsets)  # type: ignore[arg-type]
    return packed


def stage_inputs(
    task: Task,
    arrays: list[np.ndarray],
    arena_limit: int,
    segments: SegmentCache,
    layout: tuple[tuple[ArrayType, ...], tuple[int, ...], int] | None,
    caller_waits: bool,
) -> None:
    """Prepares a task's inputs so that later changes to the caller's arrays do not reach it.

    With caller_waits (Pool.run: the caller gets control back only when the
    task is settled), small inputs stay by reference and are copied straight
    into the worker's arena; otherwise they are copied here. Inputs larger
    than arena_limit go into a segment of their own, made here in the
    submitting thread so that the manager thread never copies much; when
    the pool's descriptor budget is spent (many tasks queued), they are
    copied into private memory instead and into a segment at dispatch.
    `layout` gives the types, offsets and size when they are known.
    """
    if layout is not None:  # the program's declared types: computed once per program
        task.input_types, task.input_offsets, task.input_size = layout
    else:
        task.input_types = types_of(arrays)
        task.input_offsets, task.input_size = shm.layout(task.input_types)
    if task.input_size <= arena_limit:
        task.in_arena = True
        if caller_waits:
            task.arrays = arrays
        else:
            task.packed = pack(arrays, task.input_offsets, task.input_size)
        return
    task.segments = segments
    task.input = Segment()
    if segments.reserve(task.input):
        segments.fill(task.input, task.input_size, writer(arrays, task.input_offsets))
    else:
        task.packed = pack(arrays, task.input_offsets, task.input_size)
