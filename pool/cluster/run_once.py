"""Runs that must not run twice: a scheduler plugin that fails them when their node is lost.

A run is a pure function of its program and inputs, so by default Dask runs
a task again elsewhere when the worker running it is lost (up to the
scheduler's allowed-failures). For ClusterPool(retry_lost=False) the task's
key starts with ONCE_PREFIX, and this plugin marks such a task, as it
starts on a worker, as having used up its allowed failures
(TaskState.suspicious): the scheduler then fails it with KilledWorker at the
first loss, which the client reports as NodeLostError, instead of running
it again.
"""

from __future__ import annotations

from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

ONCE_PREFIX = "pjrt-once-"
"""The key prefix of the tasks that run at most once."""

RUN_ONCE_NAME = "pjrt-pool-run-once"


class RunOnce(SchedulerPlugin):
    """See the module docstring. Registered on the scheduler by ClusterPool(retry_lost=False)."""

    name = RUN_ONCE_NAME

    def __init__(self) -> None:
        self.scheduler: Any = None

    async def start(self, scheduler: Any) -> None:
        """Keeps the scheduler, whose task states transition() marks."""
        self.scheduler = scheduler

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        """Marks a run-once task that begins processing (see the module docstring)."""
        if finish != "processing" or not isinstance(key, str) or not key.startswith(ONCE_PREFIX):
            return
        task = self.scheduler.tasks.get(key)
        if task is not None:
            task.suspicious = max(task.suspicious, self.scheduler.allowed_failures)
