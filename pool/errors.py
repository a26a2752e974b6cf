"""Parent-side exceptions and the wording of child-process failures."""

from __future__ import annotations

import importlib
import signal
import warnings
from typing import Any

from worker.errors import PjrtPoolError
from worker.wire.protocol import RemoteError


def describe_exit(returncode: int | None) -> str:
    """Says how a child process ended: "was killed by SIGSEGV (signal 11)" or "exited with 3"."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        number = -returncode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"was killed by {name} (signal {number})"
    return f"exited with status {returncode}"


def likely_cause(returncode: int | None) -> str:
    """The likely reason a worker ended with this status, and what to do about it."""
    if returncode == -9:
        return (
            "SIGKILL comes from the kernel's out-of-memory killer (see `dmesg`) or from "
            "another process; if memory ran out, use fewer workers or smaller programs"
        )
    if returncode in (-11, -7, -4):
        return "the PJRT plugin, or a custom call the program ran, crashed"
    if returncode == -6:
        return "the plugin aborted, usually a failed internal check; its output below says why"
    return "the worker exited unexpectedly"


class PoolError(PjrtPoolError, RuntimeError):
    """Base class of the pool's own failures."""


class WorkerCrashedError(PoolError):
    """The worker process running a task died (signal, abort, OOM kill).

    Only that task fails; the pool starts a replacement worker. Attributes:
    `returncode` (negative for a signal), `program` (its name), `stderr_tail`.
    """

    def __init__(
        self, message: str, returncode: int | None = None, program: str = "", stderr_tail: str = ""
    ) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.program = program
        self.stderr_tail = stderr_tail


class DeviceFailureError(WorkerCrashedError):
    """A task met a device error that leaves the device unusable in its process.

    An illegal address, a failed launch, an uncorrectable ECC error or a lost
    device poisons the worker's device context for good, so the pool
    replaces the worker and counts a crash of the program, as for a crash.
    """


class TaskTimeoutError(PoolError, TimeoutError):
    """A task ran past its timeout; its worker was killed and replaced."""


class ProgramQuarantinedError(PoolError):
    """A program crashed workers repeatedly and is no longer run by this pool."""


class PoolClosedError(PoolError):
    """The pool is closed (or broken) and takes no more tasks.

    Tasks the pool stopped before or while they ran fail with it too; its
    message says how the pool was stopped (terminate(), close(cancel_pending=True),
    a with block left by an exception).
    """


class PoolForkedError(PoolClosedError):
    """The pool belongs to the process this one was forked from; it cannot be used here.

    A forked child inherits its parent's worker sockets and shared memory but
    none of its threads: using them would take the parent's workers from under
    it. Create a Pool in the child (or fork before creating one).
    """


class WorkerStartupError(PoolError):
    """A worker could not start: its plugin failed to load or the initializer raised."""


class RemoteWorkerError(PoolError):
    """An exception from a worker whose class cannot be rebuilt in the parent."""


REBUILT_MODULES = ("builtins", "worker", "pool")
"""Where a worker's exception class may come from to be rebuilt in the parent: Python's own
exceptions and the project's. Anything else becomes a RemoteWorkerError carrying its text,
so that a reply never makes the parent import a module it names."""


def rebuild_error(remote: RemoteError) -> BaseException:
    """Returns an exception of the worker's class, message and simple attributes.

    Only the classes of REBUILT_MODULES are rebuilt, and only public
    attributes of plain values are set on them; any other class comes back
    as a RemoteWorkerError that names it. The worker's traceback is attached
    as a note, so the parent's traceback shows where in the worker the error
    was raised.
    """
    error: BaseException
    try:
        top = str(remote.module).partition(".")[0]
        if top not in REBUILT_MODULES:
            raise LookupError(remote.module)
        module = importlib.import_module(remote.module)
        cls: Any = module
        for part in remote.qualname.split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise TypeError(remote.qualname)
        error = cls(remote.message)
        for name, value in remote.attributes.items():
            if (
                isinstance(name, str)
                and not name.startswith("_")
                and isinstance(value, (int, float, str, bool, type(None)))
            ):
                setattr(error, name, value)
    except Exception:  # a class that needs other arguments, or does not import here
        error = RemoteWorkerError(f"{remote.module}.{remote.qualname}: {remote.message}")
    error.add_note(f"Raised in a pjrt-pool worker:\n{remote.traceback!s}")
    return error


class TracedPoolFunctionError(PjrtPoolError, TypeError):
    """A PoolFunction was called with JAX tracers (under jax.grad, jax.vmap, jax.jit, ...).

    Its program runs in a worker process, where JAX's tracers cannot follow:
    make the PoolFunction of the transformed function instead.
    """


class ConvertedInputWarning(UserWarning):
    """An argument a pool made in its shared memory (Pool.asarray, Pool.empty, a result) has
    another dtype than the program reads: each run converts it into a copy, which making it
    there was to spare. Each is said once (Python's filter)."""


class WorkerWarning(UserWarning):
    """A warning a pool's worker gave (the plugin's known failures, a cache it cannot use,
    a remote tier switched off, a warning of the initializer's): said in the caller's
    process once per pool and message, as one line through the "pjrt_pool.worker" logger,
    and issued as this warning too, for programs that record it, filter it or make it an
    error. Python does not print it a second time: its default is to ignore it (the filter
    below), and a filter of the program's own, which comes first, decides otherwise."""


# Appended: any filter the program or -W sets is before it and wins.
warnings.filterwarnings("ignore", category=WorkerWarning, append=True)
