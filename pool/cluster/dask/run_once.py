"""Runs that must not run twice: a scheduler plugin that fails them when their node is lost.

A run is a pure function of its program and inputs, so by default Dask runs
a task again elsewhere when the worker running it is lost (up to the
scheduler's allowed-failures). For ClusterPool(retry_lost=False) the task's
key starts with ONCE_TASK_PREFIX; such a task tells the scheduler, through this
plugin's handler, as it begins (before its node's Pool gets the run), and
the plugin marks it as having used up its allowed failures
(TaskState.suspicious). Lost after that, it fails with KilledWorker, which
the client reports as NodeLostError; lost before, while it waited in the
node's queue, it had not begun, so Dask runs it elsewhere.
"""

from __future__ import annotations

from typing import Any

import distributed
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils import sync

ONCE_TASK_PREFIX = "pjrt-once-"
"""The key prefix of the tasks that run at most once."""

RUN_ONCE_PLUGIN_PREFIX = "pjrt-pool-run-once-"
"""Each ClusterPool(retry_lost=False) registers its RunOnce under this prefix and a uuid,
so that closing it leaves other ClusterPools' plugins registered."""
_BEGIN = "pjrt_pool_run_begins"
"""The scheduler handler a run-once task calls as it begins."""


class RunOnce(SchedulerPlugin):
    """See the module docstring. Registered on the scheduler by ClusterPool(retry_lost=False).

    Every RunOnce on a scheduler installs the same handler, which any of them
    serves (it reads only the scheduler): one ClusterPool's going leaves the
    others' runs at most once.
    """

    def __init__(self) -> None:
        self.scheduler: Any = None

    async def start(self, scheduler: Any) -> None:
        """Adds the handler that run-once tasks call as they begin."""
        self.scheduler = scheduler
        scheduler.handlers[_BEGIN] = self.begins

    def begins(self, key: str) -> None:
        """A run-once task begins: a loss of its worker from now on fails it."""
        task = self.scheduler.tasks.get(key)
        if task is not None:
            task.suspicious = max(task.suspicious, self.scheduler.allowed_failures)


def begin_once() -> None:
    """Called by a run task on its Dask worker: tells the scheduler a run-once task begins
    (one round trip, and only for run-once tasks)."""
    worker = distributed.get_worker()
    key = worker.get_current_task()
    if isinstance(key, str) and key.startswith(ONCE_TASK_PREFIX):
        sync(worker.loop, getattr(worker.scheduler, _BEGIN), key=key)
