"""The futures ClusterPool hands out: concurrent.futures' Futures that follow Dask's.

ClusterPool.submit returns a ClusterFuture, a concurrent.futures.Future
whose result is fetched to this process when it is first read; its dask_future
attribute is Dask's own future of the same run, to chain Dask work on (pass
it to client.submit, or as the inputs of another ClusterPool run), whose
outputs stay in the node's memory while it is referenced. Dask's future
gives a ClusterFuture back with ClusterPool.follow.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import distributed

from pool.errors import PoolError
from pool.executor.futures import fail, resolve


class NodeLostError(PoolError):
    """The Dask worker running a task was lost, and the task was not run again.

    With ClusterPool(retry_lost=False) this is the first loss; otherwise Dask
    ran it again on other workers until its allowed-failures were used up.
    """


class CarriedError(Exception):
    """A node Pool's exception on its way to the client, pickled with the standard pickle.

    Dask pickles a task's exception with tblib, which cannot rebuild
    exceptions of two bases (TaskTimeoutError is a PoolError and a
    TimeoutError): the client got a bare Exception of its text. So a node's
    task raises (or returns) this instead, and the client raises the
    original (uncarry). Dask's own future of such a task shows this, whose
    text names the original.
    """

    def __init__(self, payload: bytes, text: str) -> None:
        super().__init__(payload, text)
        self.payload = payload

    def __str__(self) -> str:
        return str(self.args[1])

    @classmethod
    def of(cls, error: BaseException) -> CarriedError:
        """Carries an exception (one that does not pickle travels as a PoolError of its text)."""
        text = f"{type(error).__name__}: {error}"
        try:
            payload = pickle.dumps(error)
            pickle.loads(payload)
        except Exception:
            payload = pickle.dumps(PoolError(text))
        return cls(payload, text)


def uncarry(error: BaseException) -> BaseException:
    """The exception a CarriedError carries; any other exception as it is."""
    if isinstance(error, CarriedError):
        return pickle.loads(error.payload)  # from the cluster's nodes, as all Dask data is
    return error


class ClusterFuture(Future):  # type: ignore[type-arg]
    """A Future of a task on the cluster; dask_future is Dask's own (see the module docstring).

    It is done when the Dask task is. Its result, convert(the task's value),
    is fetched from the node by the first call of result() (in the calling
    thread, so that many results come in parallel and a run whose
    dask_future is passed on is never fetched here); the task's error (the
    node Pool's exception, unchanged; a lost worker as NodeLostError) is
    its exception. done(), if given, is called once the task has ended,
    whatever the outcome. Cancelling it cancels the Dask task.
    """

    def __init__(
        self,
        dask_future: distributed.Future,
        convert: Callable[[Any], Any] | None = None,
        done: Callable[[], object] | None = None,
    ) -> None:
        super().__init__()
        self.dask_future = dask_future
        self._convert = convert
        self._on_done = done
        self._fetch = threading.Lock()
        self._fetched = False
        dask_future.add_done_callback(self._settle)

    def _settle(self, remote: distributed.Future) -> None:
        try:
            status = remote.status
            if status == "finished":
                resolve(self, _NOT_FETCHED)
            elif status == "cancelled":
                super().cancel()
            else:
                fail(self, _as_pool_error(remote.exception()))
        except Exception as error:  # reading the task's state failed: the caller sees why
            fail(self, _as_pool_error(error))
        finally:
            if self._on_done is not None:
                self._on_done()

    def result(self, timeout: float | None = None) -> Any:
        """The task's value (see the class docstring), fetched here on the first call."""
        value = super().result(timeout)
        if value is not _NOT_FETCHED:
            return value
        with self._fetch:
            if not self._fetched:
                try:
                    value = self.dask_future.result()
                    if self._convert is not None:
                        value = self._convert(value)
                except Exception as error:  # fetching or converting failed
                    self._result, self._exception = None, _as_pool_error(error)
                else:
                    self._result = value
                self._fetched = True
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The task's exception, or one fetching or converting its value raised; else None."""
        error = super().exception(timeout)
        if error is None and not self._fetched:
            try:
                self.result()
            except Exception as failure:
                return failure
        return self._exception

    def cancel(self) -> bool:
        """Cancels the Dask task (if it has not run, it never will); True once cancelled."""
        if self.done():
            return False
        self.dask_future.cancel()
        return super().cancel()


_NOT_FETCHED = object()
"""A done ClusterFuture's result until result() fetches the value."""


def _as_pool_error(error: BaseException | None) -> BaseException:
    """The exception a caller sees: a lost Dask worker as NodeLostError, a carried one as
    the original, others unchanged."""
    if isinstance(error, CarriedError):
        return uncarry(error)
    if isinstance(error, distributed.scheduler.KilledWorker):
        lost = NodeLostError(
            f"the Dask worker running task {error.task!r} was lost and the task was not "
            f"run again ({error}); its run is a pure function of its inputs: submit it again, "
            "or keep ClusterPool's retry_lost=True to let Dask run it elsewhere"
        )
        lost.__cause__ = error
        return lost
    return error if error is not None else PoolError("the Dask task failed without an error")
