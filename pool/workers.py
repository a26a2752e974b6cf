"""Process bookkeeping: spawning, watching and stopping worker processes.

A WorkerProcess knows its subprocess, its socket, the tail of its output and
which programs it has loaded; it knows nothing of futures or queues (that is
pool.tasks). Every method here is called from the pool's manager thread,
except spawn and stop during start-up and shutdown.
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
    """Where a worker is in its life."""

    STARTING = "starting"  # spawned, waiting for Ready
    IDLE = "idle"
    BUSY = "busy"
    DEAD = "dead"


class WorkerProcess:
    """One worker: a `python -m worker` subprocess and its socket."""

    def __init__(
        self,
        index: int,
        platform: str | None,
        cache_dir: str | None,
        max_loaded: int,
        initializer: bytes,
    ) -> None:
        self.index = index
        self.max_loaded = max_loaded
        self.state = State.STARTING
        self.task: Any = None
        self.loaded: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.plugin: dict[str, Any] = {}
        self.counters: dict[str, int] = {}
        self.started_at = time.monotonic()
        self.startup_seconds = 0.0
        self.timed_out = False  # set when the pool kills it for running past a deadline
        self._output = bytearray()

        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        arguments = ["--fd", str(child_end.fileno()), "--max-loaded", str(max_loaded)]
        if platform:
            arguments += ["--platform", platform]
        if cache_dir:
            arguments += ["--cache-dir", str(cache_dir)]
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
        finally:
            child_end.close()
        self.sock = parent_end
        self.output_fd = self.process.stdout.fileno() if self.process.stdout else -1
        os.set_blocking(self.output_fd, False)
        arena_fd, self.arena = shm.create(ARENA_SIZE, "pjrt-pool-arena")
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
        """Kills the process at once (SIGKILL)."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGKILL)

    def stop(self, grace: float) -> int | None:
        """Stops the worker: Exit request, then SIGTERM, then SIGKILL; reaps it."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.send(protocol.Exit())
            if self.wait_exit(grace) is None:
                with contextlib.suppress(ProcessLookupError):
                    self.process.terminate()
                if self.wait_exit(grace) is None:
                    self.kill()
                    self.wait_exit(10.0)
        self.close()
        return self.process.returncode

    def close(self) -> None:
        """Closes the parent's ends of the socket and output pipe (after the process ended)."""
        self.state = State.DEAD
        self.sock.close()
        with contextlib.suppress(BufferError):  # a view still alive keeps it mapped
            self.arena.close()
        if self.process.stdout is not None:
            with contextlib.suppress(OSError):
                self.read_output()
            self.process.stdout.close()


def pickle_initializer(initializer: Any, initargs: tuple[Any, ...]) -> bytes:
    """Returns the initializer and its arguments as cloudpickle bytes (b"" for none)."""
    if initializer is None:
        return b""
    if not callable(initializer):
        raise TypeError(f"initializer must be callable, not {type(initializer).__name__}")
    return cloudpickle.dumps((initializer, tuple(initargs)))
