"""The futures the Dask ClusterPool hands out: concurrent.futures' Futures that follow Dask's.

ClusterPool.submit returns a ClusterFuture, a concurrent.futures.Future
whose result is fetched to this process when it is first read; its dask_future
attribute is Dask's own future of the same run, to chain Dask work on (pass
it to client.submit, or as the inputs of another ClusterPool run), whose
outputs stay in the node's memory while it is referenced. Dask's future
gives a ClusterFuture back with ClusterPool.follow.

Dask settles every future on one callback thread of the client: a
ClusterFuture's settling there only notes the task's status, and fetching
(and converting, see ClusterFuture.converted) happens in the thread that
reads the result, so that results come in parallel and no fetch holds up
the others' settling.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

import distributed

from pool.cluster.carried import CarriedError, NodeLostError, original_error
from pool.errors import PoolError
from pool.executor.futures import fail, remaining, resolve


class _Fetched(NamedTuple):
    """A finished task's value as read here: convert(its value), or why that failed."""

    value: Any
    error: BaseException | None


class ClusterFuture(Future):  # type: ignore[type-arg]
    """A Future of a task on the cluster; dask_future is Dask's own (see the module docstring).

    It is done when the Dask task is. Its result, convert(the task's value),
    is fetched from the node by the first call of result() or exception()
    (in the calling thread, within its timeout; a run whose dask_future is
    passed on is never fetched here); the task's error (the node Pool's
    exception, unchanged; a lost worker as NodeLostError) is its exception.
    A task whose data Dask lost before it settled (status "lost") is
    computed again by Dask, and the future waits for that. done(), if
    given, is called once the task has ended, whatever the outcome.
    retry_lost (ClusterPool's, None: not known) words a NodeLostError.
    Cancelling it cancels the Dask task.
    """

    def __init__(
        self,
        dask_future: distributed.Future,
        convert: Callable[[Any], Any] | None = None,
        done: Callable[[], object] | None = None,
        *,
        retry_lost: bool | None = None,
    ) -> None:
        super().__init__()
        self.dask_future = dask_future
        self._convert = convert
        self._on_done = done
        self._retry_lost = retry_lost
        self._fetch_lock = threading.Lock()
        self._fetched: _Fetched | None = None  # set once, by _fetch, under _fetch_lock
        self.ended = threading.Event()
        """Set once done() has been called (the task ended, or abandon gave up on it)."""
        self._ended_lock = threading.Lock()
        dask_future.add_done_callback(self._settle)

    def converted(self, convert: Callable[[Any], Any]) -> ClusterFuture:
        """A ClusterFuture of convert(this one's result), converted where it is read.

        It follows the same Dask task, so nothing is fetched or converted
        on Dask's callback thread (pool.executor.futures.adapt asks for
        this); cancelling either cancels the task.
        """
        inner = self._convert
        if inner is None:
            composed = convert
        else:

            def composed(value: Any) -> Any:
                return convert(inner(value))

        return ClusterFuture(self.dask_future, composed, retry_lost=self._retry_lost)

    def _settle(self, remote: distributed.Future) -> None:
        """Dask's done-callback (on its callback thread): notes the outcome, fetches nothing."""
        if remote.status in ("lost", "pending"):
            # Its data was lost before this future settled: Dask computes it again.
            asyncio.run_coroutine_threadsafe(
                self._await_recompute(remote), remote.client.loop.asyncio_loop
            )
            return
        try:
            status = remote.status
            if status == "finished":
                resolve(self, _NOT_FETCHED)
            elif status == "cancelled":
                super().cancel()
            else:
                fail(self, _as_pool_error(remote.exception(), self._retry_lost))
        except Exception as error:  # reading the task's error failed: the caller sees why
            fail(self, _as_pool_error(error, self._retry_lost))
        finally:
            self._end()

    def _end(self) -> None:
        """Calls done() once, however many ways the task is seen to end."""
        with self._ended_lock:
            if self.ended.is_set():
                return
            self.ended.set()
        if self._on_done is not None:
            self._on_done()

    def abandon(self, error: BaseException) -> None:
        """Fails this future with error and ends it (done(), once), and cancels its Dask
        task: for a task Dask will never settle (its worker lost, say), which closing the
        ClusterPool gives up on."""
        fail(self, error)
        self._end()
        with contextlib.suppress(Exception):  # the scheduler gone, say: nothing to cancel
            self.dask_future.cancel()

    async def _await_recompute(self, remote: distributed.Future) -> None:
        """On the client's loop: waits while Dask computes a lost task again, then settles."""
        while remote.status in ("lost", "pending"):
            await asyncio.sleep(_LOST_POLL_SECONDS)
        remote.add_done_callback(self._settle)

    def result(self, timeout: float | None = None) -> Any:
        """The task's value (see the class docstring), fetched here on the first call;
        timeout (seconds) bounds the wait and the fetch together."""
        since = time.monotonic()
        value = super().result(timeout)
        if value is not _NOT_FETCHED:
            return value
        fetched = self._fetch(remaining(timeout, since))
        if fetched.error is not None:
            raise fetched.error
        return fetched.value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The task's exception, or one fetching or converting its value raised; else None."""
        since = time.monotonic()
        error = super().exception(timeout)
        if error is not None:
            return error
        return self._fetch(remaining(timeout, since)).error

    def _fetch(self, timeout: float | None) -> _Fetched:
        """Fetches and converts a finished task's value once; raises TimeoutError (and keeps
        nothing) when that takes longer than timeout."""
        since = time.monotonic()
        if not self._fetch_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError("the task's value is being fetched by another thread")
        try:
            if self._fetched is None:
                self._fetched = self._read(remaining(timeout, since))
            return self._fetched
        finally:
            self._fetch_lock.release()

    def _read(self, timeout: float | None) -> _Fetched:
        try:
            value = self.dask_future.result(timeout=timeout)
        except Exception as error:
            if timeout is not None and isinstance(error, TimeoutError):
                raise  # not here within the timeout (lost data computed again, say): try later
            return _Fetched(None, _as_pool_error(error, self._retry_lost))
        try:
            return _Fetched(value if self._convert is None else self._convert(value), None)
        except Exception as error:  # converting failed (a compile's own failure, say)
            return _Fetched(None, error)

    def cancel(self) -> bool:
        """Cancels the Dask task (if it has not run, it never will); True once cancelled."""
        if self.done():
            return False
        self.dask_future.cancel()
        return super().cancel()


_NOT_FETCHED = object()
"""A done ClusterFuture's result until result() fetches the value."""

_LOST_POLL_SECONDS = 0.05
"""How often a ClusterFuture whose task's data was lost looks whether Dask has it again."""


def _as_pool_error(error: BaseException | None, retry_lost: bool | None) -> BaseException:
    """The exception a caller sees: a lost Dask worker as NodeLostError, a carried one as
    the original, others unchanged."""
    if isinstance(error, CarriedError):
        return original_error(error)
    if isinstance(error, distributed.scheduler.KilledWorker):
        if retry_lost is False:
            why = "ClusterPool(retry_lost=False) runs a run that has begun at most once"
        else:
            why = (
                "every worker Dask ran it on was lost, using up the scheduler's "
                f"distributed.scheduler.allowed-failures ({error.allowed_failures})"
            )
        lost = NodeLostError(
            f"the Dask worker running task {error.task!r} was lost and the task was not "
            f"run again: {why}. A run is a pure function of its inputs: submit it again"
        )
        lost.__cause__ = error
        return lost
    return error if error is not None else PoolError("the Dask task failed without an error")
