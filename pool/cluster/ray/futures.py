"""The futures a RayClusterPool hands out: concurrent.futures' Futures that follow a node's
actor call, and send it again elsewhere when the node is lost.

A RayFuture sends its call to the node it was routed to and follows the
call's ObjectRef (object_ref: Ray's own, to pass as another run's inputs).
When the actor dies before answering (its node lost, or the actor killed:
Ray's RayActorError), the future asks its pool where to send the call next
(reroute: the node forgotten, another chosen), off Ray's callback thread, and
follows that call instead; reroute raises, and the future fails with, what
ends the retries (NodeLostError, the kept values' loss, PoolClosedError).
The future settles once, with the node Pool's outputs (converted: kept
outputs as DeviceValues) or its exception (a CarriedError's original), and
calls ended(itself) once the call has ended (its address: the node it ended
on, or None once rerouting let go of it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import ray

from pool.cluster.carried import CarriedError, original_error
from pool.executor.futures import fail, resolve

_resends: concurrent.futures.ThreadPoolExecutor | None = None
_resends_lock = threading.Lock()


def _off_ray_thread(call: Callable[[], None]) -> None:
    """Runs a resend, or a conversion, off Ray's callback thread: a resend calls Ray, and a
    conversion may wait for a lock a thread holds while it calls Ray."""
    global _resends
    with _resends_lock:
        if _resends is None:
            _resends = concurrent.futures.ThreadPoolExecutor(2, "pjrt-pool-ray-resend")
    _resends.submit(call)


class RayFuture(Future):  # type: ignore[type-arg]
    """A Future of a call on a node's actor (see the module docstring).

    send(address) makes the call on that node's actor and returns its
    ObjectRef (or raises, its node gone: a loss like any other);
    reroute(address, error, losses) says where to send it after its node was
    lost, or raises why not; convert(value, address) makes the result of the
    actor's answer.
    """

    def __init__(
        self,
        send: Callable[[str], ray.ObjectRef],
        address: str,
        *,
        reroute: Callable[[str, BaseException, int], str],
        convert: Callable[[Any, str], Any] | None = None,
        ended: Callable[[RayFuture], None] | None = None,
    ) -> None:
        super().__init__()
        self._send = send
        self._reroute = reroute
        self._convert = convert
        self._ended = ended
        self._losses = 0
        self.address: str | None = address
        self.object_ref: ray.ObjectRef | None = None
        self.finished = threading.Event()
        """Set once the call has ended (close waits for it: a cancelled future is done at
        once, its call perhaps not)."""
        self._finishing = False
        self._finish_lock = threading.Lock()
        self._start(address)

    def _start(self, address: str) -> None:
        self.address = address
        try:
            ref = self._send(address)
        except Exception as error:  # its node's actor went meanwhile
            self._lost(error)
            return
        self.object_ref = ref
        ref.future().add_done_callback(self._settle)

    def _settle(self, inner: Future[Any]) -> None:
        """On Ray's callback thread: the actor answered, failed, or died."""
        try:
            value = inner.result()
        except ray.exceptions.RayActorError as error:
            _off_ray_thread(functools.partial(self._lost, error))
            return
        except BaseException as error:
            self._finish(None, error)
            return
        if isinstance(value, CarriedError):
            self._finish(None, original_error(value))
        elif self._convert is None:
            self._finish(value, None)
        else:
            _off_ray_thread(functools.partial(self._converted, value))

    def _converted(self, value: Any) -> None:
        assert self._convert is not None
        try:
            converted = self._convert(value, self.address)
        except Exception as error:  # converting failed: the caller sees why
            self._finish(None, error)
            return
        self._finish(converted, None)

    def _lost(self, error: BaseException) -> None:
        self._losses += 1
        try:
            address = self._reroute(self.address or "", error, self._losses)
        except BaseException as failure:
            self.address = None  # rerouting let go of the node it ran on
            self._finish(None, failure)
            return
        self._start(address)

    def _finish(self, value: Any, error: BaseException | None) -> None:
        with self._finish_lock:  # once: Ray's answer, or abandon, whichever comes first
            if self._finishing:
                return
            self._finishing = True
        try:
            if self._ended is not None:
                self._ended(self)
        finally:
            if error is None:
                resolve(self, value)
            else:
                fail(self, error)
            self.finished.set()

    def abandon(self, error: BaseException) -> None:
        """Fails this future with error and ends its call (ended(), once), cancelling it on
        its node: for a call that does not end, which closing the pool gives up on."""
        if self.object_ref is not None:
            with contextlib.suppress(Exception):
                ray.cancel(self.object_ref)
        self._finish(None, error)

    def cancel(self) -> bool:
        """Cancels the call if it has not begun on its node (Ray's cancel); True once
        cancelled here."""
        if self.done():
            return False
        if self.object_ref is not None:
            with contextlib.suppress(Exception):
                ray.cancel(self.object_ref)
        return super().cancel()
