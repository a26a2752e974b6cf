"""Starting a pool's workers and replacing them: the first start, each replacement, and what
a failed start does.

Only the pool's manager thread starts workers (their PR_SET_PDEATHSIG is
tied to the thread that spawned them, which outlives them all), each with
pool.executor.processes.spawn_worker, and adds them to pool.executor.workers.
A worker is STARTING until its Ready (on_ready): then it is IDLE, or, if the
Ready carries an error, it is killed and its end is a failed start. A dead
worker's slot gets a replacement (replace); a replacement that fails to
start is tried again later, each failure in a row doubling the wait, and
while no worker runs, the queued tasks fail after FAILED_STARTS_TO_FAIL_QUEUE
such failures. A device worker whose chip is held or missing
(DeviceUnavailableError) does not fail the pool: its slot is tried again.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from pool.errors import WorkerStartupError, rebuild_error
from pool.executor.processes import spawn_worker
from pool.executor.roles import Role
from pool.executor.settings import PoolSettings
from pool.executor.tasks import Kind, Tasks
from pool.executor.worker_process import State, WorkerProcess, check_hot_slots
from pool.executor.workers import Workers
from worker.errors import DeviceUnavailableError
from worker.records import CompileStatistics
from worker.wire import protocol

logger = logging.getLogger("pjrt_pool.pool")

RESPAWN_BACKOFF_SECONDS = 0.5
"""How long after a replacement worker failed to start the pool tries again; the wait
doubles with each failure in a row, up to MAX_RESPAWN_BACKOFF_SECONDS."""

MAX_RESPAWN_BACKOFF_SECONDS = 30.0

FAILED_STARTS_TO_FAIL_QUEUE = 3
"""Failed starts in a row after which, while no worker runs, queued tasks fail (the pool
keeps trying to start workers for later tasks)."""

DEVICE_RETRY_SECONDS = 2.0
"""How soon a device worker whose chip was still held by a dead holder (one of the pool's
own, killed) is started again (WorkerStarts.device_unavailable): the chip frees within seconds."""

DEVICE_HELD_RETRY_SECONDS = 10.0
"""How soon a device worker whose chip another live process holds is started again: each
try costs a process that loads libtpu, so not as often."""


def _alive(pid: int) -> bool:
    """Whether a process of that id exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WorkerStarts:
    """Starts a pool's workers and replaces those that end (the manager thread's, but for
    on_ready, which the thread that reads a worker's Ready calls)."""

    def __init__(
        self, settings: PoolSettings, lock: threading.Lock, workers: Workers, tasks: Tasks
    ) -> None:
        self._settings = settings  # how many workers to keep, and what each starts with
        self._lock = lock  # the pool's: every move of a worker between states is under it
        self._workers = workers  # where a started worker goes, and whose states are read
        # The pool's tasks: whether it is broken or closing (no replacement then), and the
        # queue that fails when no worker can be started.
        self._tasks = tasks
        self.started = threading.Event()  # every first worker started, or the start failed
        self.startup_error: BaseException | None = None  # why the pool could not start
        self._failed_starts = 0  # replacements that failed to start, in a row
        self._respawns: dict[int, float] = {}  # worker index -> when to try starting it again
        # What every worker's preloading (Init.preload) loaded, replacements' too, under the lock.
        self.preload_statistics = CompileStatistics()

    def start(self) -> None:
        """Spawns the pool's workers; raises what spawning one raised."""
        for index in range(self._settings.workers):
            self._spawn(index)

    def _spawn(self, index: int) -> None:
        self._workers.add(spawn_worker(index, self._settings, self._settings.plan[index]))

    def on_ready(self, worker: WorkerProcess, ready: protocol.Ready) -> None:
        """A worker's start-up message: it is IDLE now, or (an error in it) is killed."""
        if ready.error is not None and ready.failed_program is not None:
            # A preloaded program that did not load: raised as the worker raised it
            # (NotInCacheError, NeverCompileError, ...), naming the program.
            error = rebuild_error(ready.error)
            if len(error.args) == 1 and isinstance(error.args[0], str):
                error.args = (f"preloading program {ready.failed_program!r}: {error.args[0]}",)
            error.add_note(
                f"while worker {ready.pid} preloaded program {ready.failed_program!r} "
                "(Pool(preload=...)): the pool did not start"
            )
            with self._lock:
                worker.failed_to_start(error)
                self._workers.kill_locked(worker)
            return
        if ready.error is not None:
            error: BaseException = WorkerStartupError(
                f"a worker failed to start: {ready.error.qualname}: {ready.error.message}"
            )
            cause = rebuild_error(ready.error)
            if worker.role is Role.DEVICE and isinstance(cause, DeviceUnavailableError):
                error = cause  # its chip is held or missing: see start_failed
            else:
                # What the worker raised, as its cause: a caller can tell a plugin that is
                # not one (PluginLoadError) from an initializer that raised.
                error.__cause__ = cause
                error.add_note(f"Raised in the worker:\n{ready.error.traceback}")
            with self._lock:
                worker.failed_to_start(error)
                self._workers.kill_locked(worker)
            return
        try:
            check_hot_slots(ready.hot)
        except (ValueError, TypeError, AttributeError) as problem:
            with self._lock:
                worker.failed_to_start(
                    WorkerStartupError(
                        f"a worker (pid {worker.pid}) broke the protocol at start-up: the hot "
                        f"slots of its preloaded programs do not fit its arena ({problem})"
                    )
                )
                self._workers.kill_locked(worker)
            return
        with self._lock:
            if worker.state is not State.STARTING:
                return  # killed while starting (terminate)
            worker.became_ready(ready.plugin, ready.loaded, ready.hot)
            if ready.counters is not None:
                worker.note_counters(ready.counters)
            if ready.statistics is not None:
                self.preload_statistics = self.preload_statistics.add(ready.statistics)
            self._failed_starts = 0
            everyone = not self._workers.starting_locked()
        if everyone and not self.started.is_set():
            self.started.set()

    def replace(self, index: int, failure: BaseException | None) -> None:
        """After a worker's end: start its replacement, or (it failed to start) see start_failed."""
        if failure is None:
            self._respawn(index)
        else:
            self.start_failed(index, failure)

    def _respawn(self, index: int) -> None:
        """Starts a replacement worker (if that fails, start_failed schedules another try).

        Not after the pool broke, nor while closing with nothing left to run
        (close() waits for queued tasks, which need workers).
        """
        with self._lock:
            tasks = self._tasks
            wanted = tasks.broken is None and (not tasks.closing or tasks.queued)
        if not wanted:
            self._respawns.pop(index, None)
            return
        try:
            self._spawn(index)
        except Exception as error:
            self.start_failed(index, WorkerStartupError(f"a worker could not start: {error}"))
        else:
            self._respawns.pop(index, None)

    def respawn_due(self) -> float | None:
        """Retries the replacements that are due; returns seconds to the next one."""
        now = time.monotonic()
        for index, due in list(self._respawns.items()):
            if due <= now:
                self._respawn(index)
        waits = [due - now for due in self._respawns.values()]
        return max(0.0, min(waits)) if waits else None

    def start_failed(self, index: int, error: BaseException) -> None:
        """A worker did not start: the pool's start fails, or the slot is tried again later.

        After the pool started, each failure in a row doubles the wait before
        the next try and is logged. While no worker runs, queued tasks
        fail once FAILED_STARTS_TO_FAIL_QUEUE starts in a row have failed,
        since nothing could run them; the pool itself goes on trying. A
        device worker whose chip is held or missing is device_unavailable's.
        """
        if isinstance(error, DeviceUnavailableError):
            self.device_unavailable(index, error)
            return
        if not self.started.is_set():
            self.startup_error = error
            self.started.set()
            return
        if self.startup_error is not None:
            return  # another worker of a pool that never started: the pool is being stopped
        self._failed_starts += 1
        failures = self._failed_starts
        delay = min(RESPAWN_BACKOFF_SECONDS * 2 ** (failures - 1), MAX_RESPAWN_BACKOFF_SECONDS)
        self._respawns[index] = time.monotonic() + delay
        logger.warning(
            "a replacement worker failed to start (%d in a row); trying again in %.1f s: %s",
            failures,
            delay,
            error,
        )
        with self._lock:
            running = self._workers.working_locked()
            if not running and failures >= FAILED_STARTS_TO_FAIL_QUEUE:
                self._tasks.fail_queued_locked(
                    WorkerStartupError,
                    f"no worker is running, and the last {failures} attempts to start one "
                    f"failed ({error}); the pool tries again in {delay:.1f} s",
                    error,
                )

    def device_unavailable(self, index: int, error: DeviceUnavailableError) -> None:
        """A device worker found its chip held by another process, or gone: the pool goes on.

        The pool's compile workers keep working and its start does not fail.
        When a live process that is not one of this pool's holds the chip
        (libtpu names it), the queued runs fail with the error, which names
        that process, and the slot is tried again after DEVICE_HELD_RETRY_SECONDS;
        otherwise (the holder was a worker that just died, and the chip is
        being freed) they wait, and it is tried again after DEVICE_RETRY_SECONDS.
        So runs go on once the chip is free, and a run submitted while another
        process holds it fails by the next try.
        """
        holder = error.holder
        if holder == os.getpid():
            error = DeviceUnavailableError(
                f"this process (pid {holder}), the pool's parent, holds the chip its device "
                "worker needs: JAX in it opened the TPU (a JAX computation or jax.devices() "
                "before the pool started, or JAX_PLATFORMS naming tpu). Set JAX_PLATFORMS=cpu "
                "for this process, or lower with platform='tpu' before any other JAX call "
                f"({error})",
                holder,
            )
        with self._lock:
            ours = self._workers.pids_locked()
            foreign = holder is not None and holder not in ours and _alive(holder)
            if foreign:
                self._tasks.fail_queued_of_locked(Kind.RUN, error)
            everyone = not self._workers.starting_locked()
        delay = DEVICE_HELD_RETRY_SECONDS if foreign else DEVICE_RETRY_SECONDS
        self._respawns[index] = time.monotonic() + delay
        logger.info("the device worker could not take its chip; trying again: %s", error)
        if everyone and not self.started.is_set():
            self.started.set()
