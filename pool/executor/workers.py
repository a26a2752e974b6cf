"""Process bookkeeping: spawning, watching and stopping worker processes.

A WorkerProcess knows its subprocess, its socket, the tail of its output,
which programs it has loaded and where it is in its life (below); it knows
nothing of futures or queues (that is pool.executor.tasks). The Pool moves workers
between states, always under its lock, with ``move``; a move the table does
not allow raises, so a bookkeeping bug surfaces at once instead of hanging.

Worker states and why each move happens::

    STARTING --Ready----------------> IDLE      plugin loaded, initializer ran
    STARTING --end of file----------> DEAD      it died starting (a start-up failure)
    IDLE     --claim(task)----------> BUSY      a thread took it for one task
    IDLE     --readable socket------> DYING     an idle worker only ever shows end of
                                                file (or breaks the protocol): retire it
    BUSY     --reply handled--------> IDLE      its task is settled or queued again
    BUSY     --nothing was sent-----> IDLE      its claimer failed or was interrupted
                                                before sending the request
    BUSY     --end of file----------> DEAD      it died: its task is failed or requeued
    STARTING, IDLE, BUSY --kill-----> DYING     deadline passed, its caller gave up, the
                                                stream broke, a device error, terminate()
    DYING    --end of file----------> DEAD      reaped; the pool spawns a replacement
    STARTING, IDLE --stopped--------> DEAD      close(): an exit request, then signals

Who holds the socket is `holder`, a second fact: None for the pool's
manager thread, whose wait set (pool.executor.watch) has the socket then, or the id
of one caller thread, with the socket out of that set::

    manager --claimed by a caller (Pool.run; a submit that dispatches)--> caller
    caller  --request sent (submit), reply handled (run), or the caller
              failed or was interrupted (Pool._recover)--------------------> manager

Only Dispatch._claim_locked and Dispatch._give_back_locked change it, so
"the manager's wait set has the socket exactly when the manager holds it"
holds everywhere else.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import os
import re
import signal
import socket
import subprocess
import time
from typing import Any

import cloudpickle

from pool.spawn import child_environment, python_command
from worker import protocol, shm

logger = logging.getLogger("pjrt_pool.worker")

STDERR_TAIL_BYTES = 8192
"""How much of a worker's output is kept for crash reports."""

_FRAME_LINE = re.compile(r"^\s*@\s+0x[0-9a-f]+")

ARENA_SIZE = 1 << 20
"""Bytes of each worker's arena: small tasks' inputs and outputs pass through it."""


class State(enum.Enum):
    """Where a worker is in its life (see the module docstring)."""

    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    DYING = "dying"
    DEAD = "dead"


_MOVES: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.IDLE, State.DYING, State.DEAD}),
    State.IDLE: frozenset({State.BUSY, State.DYING, State.DEAD}),
    State.BUSY: frozenset({State.IDLE, State.DYING, State.DEAD}),
    State.DYING: frozenset({State.DEAD}),
    State.DEAD: frozenset(),
}


class WorkerProcess:
    """One worker: a `python -m worker` subprocess and its socket."""

    def __init__(
        self,
        index: int,
        platform: str | None,
        cache_dir: str | None,
        max_loaded: int,
        initializer: bytes,
        never_compile: bool = False,
    ) -> None:
        self.index = index
        self.max_loaded = max_loaded
        self.state = State.STARTING
        self.holder: int | None = None  # the thread that holds the socket; None: the manager
        self.task: Any = None
        self.killed_by_pool = False  # the pool killed it for a reason not its task's fault
        self.startup_failure: BaseException | None = None  # why it was killed while starting
        self.loaded: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.plugin: dict[str, Any] = {}
        self.counters: dict[str, int] = {}
        self.started_at = time.monotonic()
        self.startup_seconds = 0.0
        self._output = bytearray()

        # The arena and socket come first: a failure here leaves no process behind.
        arena_fd, self.arena = shm.create(ARENA_SIZE + protocol.CONTROL_BYTES, "pjrt-pool-arena")
        protocol.STARTED.pack_into(self.arena, ARENA_SIZE, -1)
        try:
            parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except BaseException:
            os.close(arena_fd)
            raise
        arguments = ["--fd", str(child_end.fileno()), "--max-loaded", str(max_loaded)]
        arguments += ["--parent-pid", str(os.getpid())]
        if platform:
            arguments += ["--platform", platform]
        if cache_dir:
            arguments += ["--cache-dir", str(cache_dir)]
        if never_compile:
            arguments.append("--never-compile")
        try:
            self.process = subprocess.Popen(
                python_command("worker", *arguments),
                pass_fds=(child_end.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=child_environment(),
                # Its own session: a Ctrl-C meant for the parent must not kill
                # workers behind the pool's back; the pool stops them itself.
                start_new_session=True,
            )
        except BaseException:
            os.close(arena_fd)
            parent_end.close()
            raise
        finally:
            child_end.close()
        self.sock = parent_end
        self.output_fd = self.process.stdout.fileno() if self.process.stdout else -1
        os.set_blocking(self.output_fd, False)
        try:
            protocol.send_frame(self.sock, protocol.Init(initializer, ARENA_SIZE), (arena_fd,))
        except OSError:
            pass  # the worker died at once; the pool sees the end of its socket
        finally:
            os.close(arena_fd)

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.process.pid

    def move(self, to: State) -> None:
        """Moves the worker to another state; the caller holds the pool's lock."""
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"pjrt-pool bug: worker {self.pid} cannot go {self.state} -> {to}")
        self.state = to

    def started(self, task_id: int) -> bool:
        """Whether the worker took up the task: it writes a task's id before working on it."""
        return protocol.STARTED.unpack_from(self.arena, ARENA_SIZE)[0] == task_id

    # -- output ----------------------------------------------------------

    def read_output(self) -> bool:
        """Reads what the worker printed; returns False at end of file."""
        try:
            chunk = os.read(self.output_fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not chunk:
            return False
        self._output += chunk
        del self._output[:-STDERR_TAIL_BYTES]
        for line in chunk.decode(errors="replace").splitlines():
            logger.debug("worker %d: %s", self.pid, line)
        return True

    def output_tail(self, lines: int = 20) -> str:
        """The last lines the worker wrote to stdout or stderr, without raw stack frames.

        A plugin's fatal error prints its reason and then dozens of frame
        addresses; dropping the addresses keeps the reason in the tail.
        """
        text = self._output.decode(errors="replace").strip()
        kept = [line for line in text.splitlines() if not _FRAME_LINE.match(line)]
        return "\n".join(kept[-lines:])

    # -- loaded programs (mirrors the worker's LRU) ------------------------

    def note_loaded(self, program_id: str, evicted: tuple[str, ...]) -> None:
        """Records that the worker holds a program now, and what it unloaded."""
        self.loaded[program_id] = None
        self.loaded.move_to_end(program_id)
        for gone in evicted:
            self.loaded.pop(gone, None)

    # -- requests --------------------------------------------------------

    def send(self, message: Any, fds: tuple[int, ...] = ()) -> None:
        """Sends a request; raises OSError if the worker is gone."""
        protocol.send_frame(self.sock, message, fds)

    def receive(self) -> tuple[Any, list[int]]:
        """Receives the next message; raises ConnectionLostError if the worker is gone."""
        return protocol.recv_frame(self.sock)

    # -- ending ----------------------------------------------------------

    def wait_exit(self, timeout: float) -> int | None:
        """Waits for the process to end; returns its exit status or None."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """Kills the process at once (SIGKILL); it is reaped when its end of file is seen."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Closes the parent's ends of the socket and output pipe (after the process ended)."""
        self.sock.close()
        with contextlib.suppress(BufferError):  # a view still alive keeps it mapped
            self.arena.close()
        if self.process.stdout is not None:
            with contextlib.suppress(OSError):
                self.read_output()
            self.process.stdout.close()
        self.output_fd = -1  # its number may be reused by now: never read or unwatch it again


def stop_all(workers: list[WorkerProcess], grace: float) -> None:
    """Stops workers together: Exit request, then SIGTERM, then SIGKILL; reaps each.

    All of them get each step at once, so stopping N hung workers takes about
    2 x grace seconds, not N times that.
    """
    running = [w for w in workers if w.process.poll() is None]
    for worker in running:
        with contextlib.suppress(OSError):
            worker.send(protocol.Exit())
    for escalate in (None, "terminate", "kill"):
        if escalate == "terminate":
            for worker in running:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.terminate()
        elif escalate == "kill":
            for worker in running:
                worker.kill()
        deadline = time.monotonic() + (grace if escalate != "kill" else 10.0)
        for worker in running:
            worker.wait_exit(max(0.0, deadline - time.monotonic()))
        running = [w for w in running if w.process.poll() is None]
        if not running:
            break
    for worker in workers:
        worker.close()


def pickle_initializer(initializer: Any, initargs: tuple[Any, ...]) -> bytes:
    """Returns the initializer and its arguments as cloudpickle bytes (b"" for none)."""
    if initializer is None:
        return b""
    if not callable(initializer):
        raise TypeError(f"initializer must be callable, not {type(initializer).__name__}")
    try:
        return cloudpickle.dumps((initializer, tuple(initargs)))
    except Exception as error:  # what pickling raises varies with what it met
        raise TypeError(
            "initializer and initargs go to each worker with cloudpickle, which "
            f"cannot pickle them: {type(error).__name__}: {error}"
        ) from error
