"""Ending a pool: close() and terminate() from a caller, and interpreter exit, which
terminates every pool that was not closed.

A caller ends a pool by telling its tasks (no more are taken; with
terminate, or close(cancel_pending=True), the queued ones fail and, with
terminate, each running task's worker is killed) and waking the manager
thread, whose last act stops every worker (pool.executor.manager); the
caller then waits for that thread, unless it is that thread (a done-callback
that ends the pool), and completes what the manager left.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Protocol

from pool.errors import PoolClosedError
from pool.executor.manager import Manager
from pool.executor.tasks import Tasks
from pool.executor.wait_set import WaitSet
from pool.executor.workers import Workers


class Terminable(Protocol):
    """A pool, as interpreter exit ends it."""

    def terminate(self) -> None:
        """Stops the pool at once."""


_live_pools: set[Terminable] = set()
"""Pools not closed yet: interpreter exit terminates them. (A pool's manager thread does
not hold its Pool, so this set is what keeps an unclosed pool alive until then.)"""

# A forked child has its parent's pools but none of their threads, and a lock
# another thread held at the fork stays held there: nothing of them may run
# in the child, not even at exit (see pool.executor.forks).
os.register_at_fork(after_in_child=_live_pools.clear)


@atexit.register
def _terminate_live_pools() -> None:
    for live in list(_live_pools):
        live.terminate()


def terminate_at_exit(pool: Terminable) -> None:
    """Has interpreter exit terminate a pool that started, unless it is closed first."""
    _live_pools.add(pool)


class Closing:
    """How callers end one pool (see the module docstring)."""

    def __init__(
        self,
        pool: Terminable,
        lock: threading.Lock,
        tasks: Tasks,
        workers: Workers,
        wait_set: WaitSet,
        manager: Manager,
    ) -> None:
        self._pool = pool  # what interpreter exit would terminate, until it is ended here
        self._lock = lock  # the pool's: the queue and the workers' states change under it
        self._tasks = tasks  # told to take no more tasks, and to fail the queued ones
        self._workers = workers  # the running tasks' workers, killed by terminate
        self._wait_set = wait_set  # the manager's: woken to see the pool closing
        self._manager = manager  # whose end stops the workers, waited for

    def close(self, stop_queued: str | None) -> None:
        """close(); with stop_queued (how the pool was stopped), queued tasks fail instead."""
        with self._lock:
            self._tasks.close_locked()
            if stop_queued is not None:
                self._tasks.fail_queued_locked(
                    PoolClosedError, f"the pool was {stop_queued} before the task ran"
                )
            self._wait_set.wake()
        self._await_manager()

    def terminate(self, how: str) -> None:
        """terminate(); `how` says how the pool was stopped, in the tasks' errors."""
        with self._lock:
            self._tasks.close_locked()
            self._tasks.break_locked(PoolClosedError(f"the pool was {how}"))
            self._tasks.fail_queued_locked(
                PoolClosedError, f"the pool was {how} before the task ran"
            )
            killed = f"the pool was {how} during the task; its worker was killed"
            for worker in self._workers:
                self._workers.kill_task_locked(worker, PoolClosedError(killed))
            self._wait_set.wake()
        self._await_manager()

    def _await_manager(self) -> None:
        """Waits for the manager thread to end, unless this is it, and completes what it left.

        The manager completes the tasks a stop failed (so their done-callbacks
        run on it, like every other callback); one stopped after the manager
        had ended is completed here.
        """
        _live_pools.discard(self._pool)
        manager = self._manager
        if threading.current_thread() is manager:
            return  # a done-callback stopped the pool: the manager's next turn does the rest
        if manager.is_alive():
            manager.join()
        with self._lock:
            settled = self._tasks.take_orphans_locked()
        for task, error in settled:
            task.complete(error)
