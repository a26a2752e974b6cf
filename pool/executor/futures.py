"""The futures a Pool hands out: callbacks that cannot break it, and futures of other futures.

A task's future is a PoolFuture; a run's is a TaskFuture, whose result()
reads the task's reply itself where it can (see TaskFuture). Their
done-callbacks run on the pool's manager thread, whose identity
(ManagerThread) the future's callback guard checks: a caller's thread that
completes a future by reading its reply relays the callbacks there.
`adapt` makes a future of another future's result, converted: Pool.function
turns a task's outputs into the function's result with it (a ClusterFuture
converts where its result is read instead: ClusterFuture.converted).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol

logger = logging.getLogger("pjrt_pool.pool")

Relay = Callable[[Callable[[], object]], bool]
"""Has the pool's manager thread make a call soon; False when that thread has ended."""


class ReplyPath(Protocol):
    """What a TaskFuture's result() goes through: its pool's caller path
    (pool.executor.caller.CallerPath)."""

    def read_reply(self, future: TaskFuture, timeout: float | None) -> float | None:
        """Reads the reply of a future's task in the calling thread when it can, waiting up
        to the timeout (seconds; None: no limit); returns the timeout left for the
        future's own wait."""
        ...

    def relay(self, call: Callable[[], object]) -> bool:
        """Has the pool's manager thread make a call soon; False when that thread has ended."""
        ...


class _Relaying(threading.local):
    """Per thread: where the done-callbacks of the future this thread is reading the reply
    of go (TaskFuture.result), or None."""

    to: Relay | None = None


_relaying = _Relaying()


class ManagerThread(threading.Thread):
    """The class of a pool's manager thread (pool.executor.manager), where most futures settle.

    PoolFuture knows that thread by its class.
    """


class PoolFuture(Future):  # type: ignore[type-arg]
    """A Future of a pool's task, whose done-callbacks cannot break the pool.

    A done-callback that raises an Exception is logged (on pjrt_pool.pool)
    and the other callbacks and the pool go on, as concurrent.futures does,
    on every thread a callback runs on: the manager's, and a caller's that
    completed the future (which relays the callbacks to the manager).
    concurrent.futures lets a BaseException (KeyboardInterrupt, SystemExit)
    out into the thread that runs the callback; on the manager thread that
    would stop the pool, so there it is logged too. Elsewhere (cancel(),
    add_done_callback on a done future, in the caller's own thread) a
    BaseException goes to the caller, as concurrent.futures' does.
    """

    def add_done_callback(self, fn: Callable[[Future[Any]], object]) -> None:
        super().add_done_callback(functools.partial(_guarded, fn))


class TaskFuture(PoolFuture):
    """The future of a pool's run task: result() reads the reply itself when it can.

    A thread waiting in result() for a task that a worker runs takes that
    worker's socket from the manager thread and reads the reply there,
    as Pool.run does: the result costs no wake-up of the manager and then
    of this thread. It does so only when the manager is not reading the
    reply already; otherwise, and on the manager thread, it waits as
    concurrent.futures does. The future's done-callbacks still run on the
    manager thread (relayed there). A Ctrl-C while the reply is awaited
    leaves the task running, as a plain Future's wait does; one while the
    reply is being read stops the task (the reply is half read), which
    then fails with PoolError.
    """

    def __init__(self, through: ReplyPath) -> None:
        super().__init__()
        # The pool's, until the future is done (then it would only keep the pool alive).
        self._through: ReplyPath | None = through

    def result(self, timeout: float | None = None) -> Any:
        """The task's outputs (see concurrent.futures.Future.result); reads its reply here
        when it can (see the class docstring)."""
        through = self._through
        if through is not None and not self.done():
            before = _relaying.to
            _relaying.to = through.relay
            try:
                timeout = through.read_reply(self, timeout)
            finally:
                _relaying.to = before
        return super().result(timeout)

    def set_result(self, result: Any) -> None:
        """As Future's; the pool is no longer needed."""
        self._through = None
        super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        """As Future's; the pool is no longer needed."""
        self._through = None
        super().set_exception(exception)

    def cancel(self) -> bool:
        """As Future's; a cancelled future no longer needs the pool."""
        cancelled = super().cancel()
        if cancelled:
            self._through = None
        return cancelled


class RunOutcome:
    """The outcome of a Pool.run task: the future-like part of a task that only its own
    caller waits for, and that nobody can cancel.

    A concurrent.futures.Future costs the best part of a small program's
    round trip (docs/facts.md, "A Future per task"); Pool.run's future
    never leaves the pool, so it needs none of that: no callbacks, no
    cancellation, one waiter. Its result is set once (a second setting
    raises InvalidStateError, which resolve and fail drop, as for a
    Future); a lock held from the start and released when it is set is
    what the caller waits on when the task was queued (the manager, or a
    thread that dispatched it, completes it). On the direct path the
    caller's own thread sets it, and result() finds it done.
    """

    __slots__ = ("_error", "_ready", "_result", "_set")

    def __init__(self) -> None:
        self._ready = threading.Lock()
        self._ready.acquire()  # released once the outcome is set
        self._set = False
        self._result: Any = None
        self._error: BaseException | None = None

    def running(self) -> bool:
        """True: nothing can cancel it, so it is as good as running (see dispatch)."""
        return True

    def set_running_or_notify_cancel(self) -> bool:
        """True: it cannot have been cancelled."""
        return True

    def done(self) -> bool:
        """Whether its outcome is set."""
        return self._set

    def set_result(self, result: Any) -> None:
        """Sets the task's outputs (InvalidStateError if an outcome is set already)."""
        self._settle(result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        """Sets the task's error (InvalidStateError if an outcome is set already)."""
        self._settle(None, exception)

    def _settle(self, result: Any, error: BaseException | None) -> None:
        # One thread settles a task (Task.settle), so no two come here at once.
        if self._set:
            raise InvalidStateError("the outcome of this run is set already")
        self._result, self._error = result, error
        self._set = True
        self._ready.release()

    def result(self, timeout: float | None = None) -> Any:
        """The task's outputs, waiting until they are set (raises the task's error); a
        Ctrl-C while waiting lands here, as in Future.result."""
        if not self._set:
            if not self._ready.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError("the run's outcome is not set yet")
            self._ready.release()  # the outcome stays readable
        if self._error is not None:
            raise self._error
        return self._result


def remaining(timeout: float | None, since: float) -> float | None:
    """What is left of a timeout (seconds; None: no limit) that began at `since` (monotonic)."""
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - since))


def _guarded(callback: Callable[[Future[Any]], object], future: Future[Any]) -> None:
    relay = _relaying.to
    if relay is not None and relay(functools.partial(_guarded, callback, future)):
        return  # this thread read the future's reply: the callback runs on the manager thread
    try:
        callback(future)
    except Exception as error:
        # Logged here, not left to concurrent.futures: a relayed callback runs in the
        # manager's loop, outside Future's own guard, where it would stop the pool.
        logger.error(
            "a done-callback (%r) raised %r; the pool goes on", callback, error, exc_info=True
        )
    except BaseException as error:
        if not isinstance(threading.current_thread(), ManagerThread):
            raise
        logger.error(
            "a done-callback (%r) raised %r on the pool's manager thread; the pool goes on",
            callback,
            error,
            exc_info=True,
        )


def resolve(future: Future[Any] | RunOutcome, result: Any) -> None:
    """Sets a future's result; a cancelled future drops it."""
    try:  # noqa: SIM105 (not contextlib.suppress: this is on every task's path)
        future.set_result(result)
    except InvalidStateError:
        pass


def fail(future: Future[Any] | RunOutcome, error: BaseException) -> None:
    """Sets a future's exception; a cancelled future drops it."""
    try:  # noqa: SIM105 (as in resolve)
        future.set_exception(error)
    except InvalidStateError:
        pass


class FutureLike(Protocol):
    """What adapt needs of the future it follows: concurrent.futures' or Dask's."""

    def add_done_callback(self, fn: Callable[[Any], object], /) -> None: ...
    def cancelled(self) -> bool: ...
    def cancel(self) -> Any: ...
    def exception(self) -> BaseException | None: ...
    def result(self) -> Any: ...


def adapt(inner: FutureLike, convert: Callable[[Any], Any]) -> Future[Any]:
    """A future of convert(inner's result); cancelling it cancels inner.

    inner's exception, or one that convert raises, is the future's
    exception; when inner is cancelled, so is the future. A future that
    converts where its result is read (a ClusterFuture: its converted
    method) is asked for that, so that nothing is fetched or converted on
    the thread that settles it (Dask's one callback thread).
    """
    converted = getattr(inner, "converted", None)
    if converted is not None:
        return converted(convert)  # type: ignore[no-any-return]
    return _Adapted(inner, convert)


class _Adapted(PoolFuture):
    """See adapt."""

    def __init__(self, inner: FutureLike, convert: Callable[[Any], Any]) -> None:
        super().__init__()
        self._inner = inner
        self._convert = convert
        inner.add_done_callback(self._settle)

    def _settle(self, inner: FutureLike) -> None:
        if inner.cancelled():
            super().cancel()
            return
        error = inner.exception()
        if error is not None:
            self.set_exception(error)
            return
        try:
            self.set_result(self._convert(inner.result()))
        except Exception as failure:  # converting failed: the caller sees why
            self.set_exception(failure)

    def cancel(self) -> bool:
        """Cancels the inner future's task if it has not started (as Future.cancel does)."""
        return bool(self._inner.cancel()) and super().cancel()
