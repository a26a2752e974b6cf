"""How the command line ends on SIGINT (Ctrl-C) and SIGTERM (kill, a CI job's timeout).

Either signal ends a command with its own exit status, 128 + the signal as a
shell reports a process it ended (130 for SIGINT, 143 for SIGTERM), and one
line on stderr, at any moment, start-up included: never a traceback, never an
abort or a crash. Python's own handling raises KeyboardInterrupt wherever the
main thread is, which is right where a with block or a finally clause has
something to undo, and wrong elsewhere: inside an import (a traceback from
importlib, a module left half made), inside the initialization of an
extension module such as jaxlib's (a crash, then or at exit), inside a
``__del__`` or a callback (where Python prints it and goes on: the signal is
lost). And SIGTERM's default ends the process where it stands, writing
nothing. So the command line (and nothing else: a library never takes its
user's signals) handles both signals itself, in one of three ways (Mode), as
the command says what it is doing:

    AT_ONCE  nothing to undo (start-up, imports, reading, a spec being loaded):
             the line is written and the process leaves at once (os._exit),
             wherever the main thread was
    UNWIND   something is held that must be undone (a pool's workers, a file being
             written, a lowering thread): KeyboardInterrupt is raised in the main
             thread, the with blocks and finally clauses undo as it unwinds, and
             main leaves with the signal's status
    HOLD     something is being written that the signal must not cut (a warm's
             report and manifest): the signal waits until the block ends, then is
             raised as in UNWIND; a second one while the first waits leaves at once

install() puts the handlers in, as the first thing the command line does
(pool.cli.main, when run as the pjrt-pool command); main runs each command in
UNWIND, and commands mark their parts that are AT_ONCE (importing JAX, a spec)
or HOLD. A signal that comes in UNWIND while the main thread imports (a module
the command loads late, jaxlib's among them) and a KeyboardInterrupt raised into
code that cannot pass it on (a __del__, a garbage collector's callback) are sent
again, to land after them; and a signal that came while the command ran ends it
with the signal's status even if its KeyboardInterrupt was lost all the same
(received). Once the exit handlers have run, the signals are ignored: the
interpreter would put back their default actions as it finalizes. Before
install(), while Python starts and imports the command's first module (some tens
of milliseconds), a signal is Python's own.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import enum
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

HANDLED = (signal.SIGINT, signal.SIGTERM)
"""The signals the command line ends on in its own way."""


class Mode(enum.Enum):
    """What a signal does now (see the module docstring)."""

    AT_ONCE = "at once"
    UNWIND = "unwind"
    HOLD = "hold"


class Reported(KeyboardInterrupt):
    """Raised by a command that has said in its output what the signal stopped (warm's
    summary): main ends with the signal's status and adds no line of its own."""


_mode = Mode.AT_ONCE
_received: int | None = None  # the first signal that came, if one did
_last: int | None = None  # the latest, whose KeyboardInterrupt may have to be raised again
_unraisable_before = sys.unraisablehook
_waiting = False  # a signal came in HOLD and waits for the block's end
_command = "pjrt-pool"


def install() -> None:
    """Handles SIGINT and SIGTERM as the module docstring says, from now on (a signal this
    process was started with ignored, as a background job's SIGINT, stays ignored)."""
    for signum in HANDLED:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _handle)
    global _unraisable_before
    if sys.unraisablehook is not _unraisable:
        _unraisable_before, sys.unraisablehook = sys.unraisablehook, _unraisable
    # Run last of the exit handlers (they run in reverse): from then on the interpreter
    # puts back the default actions as it finalizes, and a signal would end the process
    # without a word (-2, -15) after the command said it was done. Ignored instead.
    atexit.register(_ignore)


def _ignore() -> None:
    for signum in HANDLED:
        if signal.getsignal(signum) is _handle:
            signal.signal(signum, signal.SIG_IGN)


def name_command(name: str) -> None:
    """Names the command in the line a signal writes ("pjrt-pool warm: interrupted")."""
    global _command
    _command = name


def received() -> int | None:
    """The signal that came while the command ran (the first), or None."""
    return _received


def exit_code() -> int:
    """The exit status for the signal that came (SIGINT's when a KeyboardInterrupt came some
    other way, such as the library's own)."""
    return 128 + (_received or signal.SIGINT)


def describe() -> str:
    """The line a signal ends a command with."""
    if _received == signal.SIGTERM:
        return f"{_command}: terminated (SIGTERM)"
    return f"{_command}: interrupted (Ctrl-C)"


def _handle(signum: int, frame: object) -> None:
    global _received, _waiting, _last
    if _received is None:
        _received = signum
    _last = signum
    if _mode is Mode.AT_ONCE or (_mode is Mode.HOLD and _waiting):
        leave_now()
    if _mode is Mode.HOLD:
        _waiting = True
        return
    if _importing(frame):
        # Raised inside an import, KeyboardInterrupt leaves a module half made, and inside
        # an extension's (jaxlib's, loading the CPU runtime) a crash follows, then or at
        # exit: measured, 4 SIGTERMs in 40 into `bundle check`. Sent again, it lands once
        # the import is done.
        _thread.start_new_thread(_send_soon, (signum, _IMPORT_RETRY_SECONDS))
        return
    raise KeyboardInterrupt


_IMPORT_RETRY_SECONDS = 0.005
"""How soon a signal that came during an import is sent again."""


def _importing(frame: Any) -> bool:
    """Whether the main thread is inside an import (importlib's frames are on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _unraisable(unraisable: Any) -> None:
    """Where the KeyboardInterrupt of a signal was raised into code that cannot pass it on (a
    __del__, a garbage collector's callback: JAX has one), Python would print it and go on,
    the signal lost. It is sent again instead, to be raised where the main thread goes next:
    from a thread of its own, a moment later, since a signal this thread sent itself would be
    handled before the sending returned, here again (and a threading.Thread's start waits)."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and _last is not None:
        _thread.start_new_thread(_send_soon, (_last,))
        return
    _unraisable_before(unraisable)


def _send_soon(signum: int, seconds: float = 0.001) -> None:
    time.sleep(seconds)  # the main thread leaves the code that could not raise
    os.kill(os.getpid(), signum)


def leave_now() -> None:
    """Writes the signal's line and ends the process at once with its status, running no
    teardown (a thread in native code cannot abort it). What stdout holds is flushed,
    where it can be."""
    for stream in (sys.stdout, sys.stderr):
        # Interrupted mid-write, a stream refuses a reentrant flush: what it holds is lost.
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError):
        os.write(2, (describe() + "\n").encode(errors="replace"))
    os._exit(exit_code())


@contextlib.contextmanager
def mode(new: Mode) -> Iterator[None]:
    """A signal does what `new` says while the block runs; then as before. Leaving a HOLD
    block with a signal waiting raises its KeyboardInterrupt (once the block is done), and
    so does entering an UNWIND block inside it (AT_ONCE: leaves at once)."""
    global _mode, _waiting
    before, _mode = _mode, new
    if _waiting and new is not Mode.HOLD:  # a signal held until now: acted on here
        _waiting = False
        _mode = before
        if new is Mode.AT_ONCE:
            leave_now()
        raise KeyboardInterrupt
    try:
        yield
    finally:
        _mode = before
    if new is Mode.HOLD and _waiting and before is not Mode.HOLD:
        _waiting = False
        raise KeyboardInterrupt


def at_once() -> contextlib.AbstractContextManager[None]:
    """While the block runs, a signal ends the process at once: for what holds nothing and
    must not be cut by an exception (imports, JAX's above all, and a user's spec)."""
    return mode(Mode.AT_ONCE)


def unwinding() -> contextlib.AbstractContextManager[None]:
    """While the block runs, a signal raises KeyboardInterrupt, to be undone as it unwinds."""
    return mode(Mode.UNWIND)


def held() -> contextlib.AbstractContextManager[None]:
    """While the block runs, a signal waits for its end (a second one leaves at once)."""
    return mode(Mode.HOLD)
