"""``python -m pool.conformance.reference_child PLATFORM FD THREADS``: jax.jit's side of the
check, in a process of its own.

The parent (reference_side.py) sends cases over the connection on file
descriptor FD; this process answers each with jax.jit's outputs of the case's
function on JAX's device for the platform, computed on the case's seeded
inputs (Case.make_inputs is a pure function of the case), or with why jax.jit
failed. Up to THREADS cases are compiled and run at once, each in a thread of
its own (JAX releases the GIL while XLA compiles; jax.enable_x64 holds per
thread). Messages, pickled by multiprocessing.connection (both ends are the
parent's own processes):

    parent -> child   (index, case): the case is its name in the battery, or the
                      Case itself, cloudpickled (a case of the caller's); None: exit
    child -> parent   ("ready", device) once the device is open, or ("unavailable", why);
                      then ("done", index, outputs) or ("failed", index, why) per case

A case that crashes or hangs this process costs its own answer only: the
parent starts another process and goes on (reference_side.py).
"""

from __future__ import annotations

import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import jax

from pool.conformance.case import Case
from pool.conformance.references import reference, reference_device
from worker.plugin.platforms.registry import platform_named


def _case(payload: str | bytes) -> Case:
    """The case a request names: a battery case by name, or one sent by value."""
    if isinstance(payload, str):
        from pool.conformance.battery import battery

        return next(case for case in battery() if case.name == payload)
    case = cloudpickle.loads(payload)
    if not isinstance(case, Case):
        raise TypeError(f"not a conformance case: {type(case).__name__}")
    return case


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return f"{type(error).__name__}: {text.splitlines()[0][:500]}"


class _Answers:
    """Sends answers over the connection, one thread at a time."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            self._connection.send(message)


def _answer(answers: _Answers, index: int, payload: str | bytes, device: Any) -> None:
    try:
        case = _case(payload)
        with jax.enable_x64(case.x64):
            outputs = reference(case, case.make_inputs(), device)
    except Exception as error:  # that case's failure, said in the report
        answers.send(("failed", index, _first_line(error)))
        return
    answers.send(("done", index, outputs))


def main(argv: list[str]) -> int:
    """Serves the parent's cases (see the module) until it says exit or goes away."""
    # A terminal's Ctrl-C reaches this process too (it is in the parent's process
    # group): the parent decides, and ends this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    platform, descriptor, threads = argv[0], int(argv[1]), int(argv[2])
    connection = Connection(descriptor)
    answers = _Answers(connection)
    try:
        device = reference_device(platform)
    except Exception as error:  # the device is held by another process, or absent
        answers.send(("unavailable", _first_line(error)))
        return 3
    known = platform_named(platform)
    if known.references_apart and device.platform not in known.jax_names:
        # JAX fell back to its CPU: the chip is still held (by a process that is
        # ending), or not there. Never jax.jit on another platform than the plugin's.
        answers.send(("unavailable", f"JAX found no {platform} device (it chose {device})"))
        return 3
    answers.send(("ready", str(device)))
    with ThreadPoolExecutor(threads, thread_name_prefix="reference") as executor:
        while True:
            try:
                request = connection.recv()
            except EOFError:
                break
            if request is None:
                break
            index, payload = request
            executor.submit(_answer, answers, index, payload, device)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
