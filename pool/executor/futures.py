"""The futures a Pool hands out: callbacks that cannot break it, and futures of other futures.

A task's future is a PoolFuture. Most are settled on the pool's manager
thread, whose identity (ManagerThread) the future's callback guard checks.
`adapt` makes a future of another future's result, converted: Pool.function
turns a task's outputs into the function's result with it, and ClusterPool a
Dask future's value into a CompileResult.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol

logger = logging.getLogger("pjrt_pool.pool")


class ManagerThread(threading.Thread):
    """The class of a pool's manager thread (pool.executor.manager), where most futures settle.

    PoolFuture knows that thread by its class.
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


def resolve(future: Future[Any], result: Any) -> None:
    """Sets a future's result; a cancelled future drops it."""
    try:  # noqa: SIM105 (not contextlib.suppress: this is on every task's path)
        future.set_result(result)
    except InvalidStateError:
        pass


def fail(future: Future[Any], error: BaseException) -> None:
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
    exception; when inner is cancelled, so is the future.
    """
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
