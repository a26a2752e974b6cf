"""jax.jit's side of the check, in a child process that a crash or a hang costs one case.

::

    this process                                     reference process (reference_child.py)
    submit(case) ─▶ queue ─▶ dispatcher thread ──(index, case)──▶ up to `threads` cases at once
                     Future ◀── outputs / why ◀──────────────────  jax.jit(case.function)(inputs)

One process serves the whole battery; it is started again only after it
died or hung. A case that crashes it (libtpu aborting on a program, a
segfault in a kernel) is a "reference crash", one that runs past the
timeout a "reference timeout" (the process is killed), and the cases it
was working on besides are sent again. When several were in flight at a
crash, nothing says which one crashed it: they are sent again one at a
time, and the one that crashes that process alone is charged with it.

On a platform whose device one process at a time may hold (TPU), the
process opens the device only when the runner starts this side (after the
pool's workers let it go), and a start that finds it still held (the last
holder's process is ending: libtpu takes some seconds to let a chip go)
is tried again for DEVICE_WAIT seconds. jax.jit never falls back to
another platform there: the process says the device is unavailable
instead.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import os
import site
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import ModuleType
from typing import Any

import cloudpickle
import numpy as np

from pool.conformance.battery import battery
from pool.conformance.case import Case
from pool.conformance.status import Status
from pool.errors import describe_exit
from pool.spawn import child_environment, python_command
from worker.errors import PjrtPoolError
from worker.plugin.platforms.registry import platform_named

START_TIMEOUT = 180.0
"""Seconds a reference process may take to import JAX and open its device."""

DEVICE_WAIT = 90.0
"""Seconds to keep starting a reference process whose exclusive device is still held."""

_RETRY_PAUSE = 2.0
_EXIT_WAIT = 5.0
_TAIL_LINES = 3


class JaxSideError(PjrtPoolError):
    """jax.jit's side failed on a case; status says how (a Status.REFERENCE_* outcome)."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class _Request:
    index: int
    case: Case
    future: Future[list[np.ndarray]]
    needed: Callable[[], bool]
    suspect: bool = False
    """Sent again after a crash with others in flight: goes alone, to find the culprit."""
    sent: float = 0.0


@dataclass
class _Child:
    process: subprocess.Popen[bytes]
    connection: Connection
    device: str
    log_offset: int
    """Where this process's output begins in the log."""


class _StartError(PjrtPoolError):
    """No reference process could be started; the message says why."""


class ReferenceSide:
    """Computes jax.jit's outputs of cases in a child process (see the module).

    submit() queues a case and returns a Future of its outputs, whose
    exception is a JaxSideError when jax.jit's side failed on it. Cases
    are served once start() was called, in the order submitted. close()
    stops the process and fails what was not answered.
    """

    def __init__(self, platform: str, timeout: float, threads: int = 1) -> None:
        self.platform = platform
        self.timeout = timeout
        self.threads = max(1, threads)
        self.processes_started = 0
        """Reference processes started: 1, and one more after each crash or hang."""
        self.device = ""
        """The JAX device the references ran on (as the process named it)."""
        self._queue: collections.deque[_Request] = collections.deque()
        self._outstanding: dict[int, _Request] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._wake_read, self._wake_write = os.pipe()
        self._child: _Child | None = None
        self._start_failure: str | None = None
        self._broken: str | None = None
        """Why the dispatcher stopped, if it did: later cases fail at once with it."""
        self._thread: threading.Thread | None = None
        self._directory = tempfile.TemporaryDirectory(prefix="pjrt-pool-references-")
        self._log = Path(self._directory.name) / "reference.log"
        self._count = 0

    def submit(self, case: Case, needed: Callable[[], bool] = lambda: True) -> Future[Any]:
        """Queues a case; returns the Future of jax.jit's outputs. needed is asked when its
        turn comes: False cancels it (the plugin's side failed: nothing to compare)."""
        future: Future[list[np.ndarray]] = Future()
        with self._lock:
            self._count += 1
            request = _Request(self._count, case, future, needed)
            if self._broken is None:
                self._queue.append(request)
        if self._broken is not None:
            _settle(request, JaxSideError(Status.REFERENCE_ERROR, self._broken))
        self._wake()
        return future

    def start(self) -> None:
        """Begins serving the queue (a process is started for the first case)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name="pjrt-pool-references", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        """Ends the reference process and the dispatcher; fails what was not answered."""
        self._closing.set()
        self._wake()
        if self._thread is not None:
            self._thread.join()
        self._stop_child(polite=True)
        for request in [*self._outstanding.values(), *self._queue]:
            _settle(request, JaxSideError(Status.REFERENCE_ERROR, "the check was stopped"))
        self._outstanding.clear()
        self._queue.clear()
        for descriptor in (self._wake_read, self._wake_write):
            os.close(descriptor)
        self._directory.cleanup()

    def __enter__(self) -> ReferenceSide:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the dispatcher thread -------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # closed: nothing is waiting any more
            os.write(self._wake_write, b"\0")

    def _serve(self) -> None:
        try:
            self._dispatch()
        except BaseException as error:  # a bug here must fail the cases, never hang the check
            self._broken = f"jax.jit's side stopped: {type(error).__name__}: {error}"
            self._stop_child(polite=False)
            with self._lock:
                left = [*self._outstanding.values(), *self._queue]
                self._outstanding.clear()
                self._queue.clear()
            for request in left:
                _settle(request, JaxSideError(Status.REFERENCE_ERROR, self._broken))
            raise

    def _dispatch(self) -> None:
        while not self._closing.is_set():
            self._send_queued()
            waitables: list[Any] = [self._wake_read]
            if self._child is not None:
                waitables.append(self._child.connection)
            ready = wait(waitables, self._until_next_deadline())
            if self._wake_read in ready:
                os.read(self._wake_read, 4096)
            if self._child is not None and self._child.connection in ready:
                self._receive()
            self._check_deadlines()

    def _until_next_deadline(self) -> float | None:
        if not self._outstanding:
            return None
        first = min(request.sent for request in self._outstanding.values())
        return max(0.0, first + self.timeout - time.monotonic()) + 0.01

    def _next(self) -> _Request | None:
        """The next request to send, or None (none queued, or a suspect must go alone)."""
        with self._lock:
            while self._queue:
                request = self._queue[0]
                alone = request.suspect or any(r.suspect for r in self._outstanding.values())
                limit = 1 if alone else self.threads
                if len(self._outstanding) >= limit:
                    return None
                self._queue.popleft()
                if request.future.running():  # sent before: a crash or hang sent it back
                    return request
                if request.needed() and request.future.set_running_or_notify_cancel():
                    return request
                request.future.cancel()
        return None

    def _send_queued(self) -> None:
        while (request := self._next()) is not None:
            if self._start_failure is not None:
                message = f"jax.jit's process did not start: {self._start_failure}"
                _settle(request, JaxSideError(Status.REFERENCE_ERROR, message))
                continue
            try:
                child = self._child or self._launch()
            except _StartError as error:
                self._start_failure = str(error)
                self._queue.appendleft(request)
                continue
            payload = request.case.name if _in_battery(request.case) else _pickled(request.case)
            if isinstance(payload, Exception):
                message = f"the case could not be sent to jax.jit's process: {payload}"
                _settle(request, JaxSideError(Status.REFERENCE_ERROR, message))
                continue
            try:
                child.connection.send((request.index, payload))
            except OSError:  # it died since its last answer: send this again to the next one
                self._queue.appendleft(request)
                self._crashed()
                continue
            request.sent = time.monotonic()
            self._outstanding[request.index] = request

    def _receive(self) -> None:
        assert self._child is not None
        connection = self._child.connection
        try:
            while connection.poll():
                kind, index, *rest = connection.recv()
                request = self._outstanding.pop(index, None)
                if request is None:
                    continue
                if kind == "done":
                    request.future.set_result(rest[0])
                else:
                    message = f"jax.jit failed on this case: {rest[0]}"
                    request.future.set_exception(JaxSideError(Status.REFERENCE_ERROR, message))
        except (EOFError, OSError):
            self._crashed()

    def _crashed(self) -> None:
        """The process died: the case it worked on alone is charged; several are sent again,
        one at a time."""
        assert self._child is not None
        child = self._child
        _ended(child.process, _EXIT_WAIT)
        self._stop_child(polite=False)  # closes its end; kills it if it lingers
        returncode = child.process.returncode
        in_flight = sorted(self._outstanding.values(), key=lambda r: r.index)
        self._outstanding.clear()
        if len(in_flight) == 1:
            message = f"the process that runs jax.jit {describe_exit(returncode)}"
            tail = _tail(self._log, child.log_offset)
            if tail:
                message += "; its output ends with: " + tail
            _settle(in_flight[0], JaxSideError(Status.REFERENCE_CRASH, message))
            return
        for request in reversed(in_flight):
            request.suspect = True
            self._queue.appendleft(request)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        late = [r for r in self._outstanding.values() if now - r.sent > self.timeout]
        if not late:
            return
        self._stop_child(polite=False)
        for request in late:
            del self._outstanding[request.index]
            message = f"jax.jit did not finish within {self.timeout:g} s; its process was killed"
            _settle(request, JaxSideError(Status.REFERENCE_TIMEOUT, message))
        for request in sorted(self._outstanding.values(), key=lambda r: -r.index):
            self._queue.appendleft(request)  # not theirs to answer for: sent again
        self._outstanding.clear()

    # -- the process -----------------------------------------------------------------

    def _launch(self) -> _Child:
        """Starts a reference process and waits for its device; raises _StartError."""
        deadline = time.monotonic() + DEVICE_WAIT
        while True:
            child, why = self._try_launch()
            if child is not None:
                self._child = child
                self.device = child.device
                return child
            if not platform_named(self.platform).references_apart or time.monotonic() > deadline:
                raise _StartError(why)
            if self._closing.wait(_RETRY_PAUSE):
                raise _StartError("the check was stopped")

    def _try_launch(self) -> tuple[_Child | None, str]:
        ours, theirs = socket.socketpair()
        with ours, theirs, open(self._log, "ab") as log:
            offset = log.tell()
            process = subprocess.Popen(
                python_command(
                    "pool.conformance.reference_child",
                    self.platform,
                    str(theirs.fileno()),
                    str(self.threads),
                ),
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=child_environment(_jax_platforms(self.platform)),
            )
            self.processes_started += 1
            connection = Connection(os.dup(ours.fileno()))
        child = _Child(process, connection, "", offset)
        first = self._first_message(child)
        if first is not None and first[0] == "ready":
            child.device = str(first[1])
            return child, ""
        self._child = child
        self._stop_child(polite=False)
        why = str(first[1]) if first is not None else describe_exit(process.returncode)
        tail = _tail(self._log, offset)
        return None, why + (f"; its output ends with: {tail}" if tail else "")

    def _first_message(self, child: _Child) -> tuple[Any, ...] | None:
        """The process's first message, or None when it died, hung or the check stopped."""
        deadline = time.monotonic() + START_TIMEOUT
        while not self._closing.is_set() and time.monotonic() < deadline:
            try:
                if child.connection.poll(0.2):
                    message: tuple[Any, ...] = child.connection.recv()
                    return message
            except (EOFError, OSError):
                return None
        return None

    def _stop_child(self, polite: bool) -> None:
        """Ends the reference process: asked to exit (polite), else killed."""
        child, self._child = self._child, None
        if child is None:
            return
        if polite:
            with contextlib.suppress(OSError):
                child.connection.send(None)
        if child.process.poll() is None and (not polite or _ended(child.process, 2.0) is None):
            child.process.kill()
            _ended(child.process, _EXIT_WAIT)
        child.connection.close()


def _jax_platforms(platform: str) -> dict[str, str]:
    """The reference process's JAX_PLATFORMS: the user's, else the CPU's for a check of a CPU
    plugin (it then never opens an accelerator another process needs), else JAX's choice."""
    if os.environ.get("JAX_PLATFORMS") or "cpu" not in platform_named(platform).jax_names:
        return {}
    return {"JAX_PLATFORMS": "cpu"}


@functools.cache
def _battery_ids() -> frozenset[int]:
    return frozenset(id(case) for case in battery())  # battery() is cached: ids stay


def _in_battery(case: Case) -> bool:
    """Whether the case is the battery's own (sent by name) rather than the caller's."""
    return id(case) in _battery_ids()


def _installed(module: ModuleType) -> bool:
    """Whether a module is pjrt-pool's or installed (importable in a child as it is here),
    rather than a script's or a test's own."""
    if module.__name__.split(".")[0] in ("pool", "worker"):
        return True
    file = getattr(module, "__file__", None)
    if file is None:
        return True  # built in
    roots = {sys.prefix, sys.base_prefix, *site.getsitepackages(), site.getusersitepackages()}
    where = Path(file).resolve()
    return any(where.is_relative_to(Path(root).resolve()) for root in roots)


def _pickled(case: Case) -> bytes | Exception:
    """A case of the caller's, for the reference process: its function's module by value
    when that process could not import it (a script's, a test's), as the warm command's
    lowering processes get spec modules."""
    module = inspect.getmodule(case.function)
    if module is not None and module.__name__ != "__main__" and not _installed(module):
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(case)
    except Exception as error:  # pickling runs the caller's objects' __reduce__
        return error


def _settle(request: _Request, failure: JaxSideError) -> None:
    """Fails a request's Future (cancels it if it never ran); one already settled stays."""
    if request.future.done():
        return
    if not request.future.running() and not request.future.set_running_or_notify_cancel():
        return
    request.future.set_exception(failure)


def _ended(process: subprocess.Popen[bytes], seconds: float) -> int | None:
    """The process's exit status once it ends within `seconds`, else None."""
    try:
        return process.wait(seconds)
    except subprocess.TimeoutExpired:
        return None


def _tail(log: Path, offset: int) -> str:
    """The last lines a reference process wrote to the log, from its offset, in one line."""
    try:
        with open(log, "rb") as file:
            file.seek(offset)
            text = file.read()[-8192:].decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(line[:300] for line in lines[-_TAIL_LINES:])
