"""Starting a pool's workers and replacing them: the first start, each replacement, and what
a failed start does.

Only the pool's manager thread starts workers (their PR_SET_PDEATHSIG is
tied to the thread that spawned them, which outlives them all), each with
pool.executor.processes.spawn_worker, and adds them to pool.executor.workers.
A worker is STARTING until its Ready (on_ready): then it is IDLE, or, if the
Ready carries an error, it is killed and its end is a failed start. A dead
worker's slot gets a replacement (replace); a replacement that fails to
start is tried again later, each failure in a row doubling the wait, and
while no running worker takes them, the queued tasks of a kind fail after
FAILED_STARTS_TO_FAIL_QUEUE such failures. A device worker whose chip is held
or missing (DeviceUnavailableError) does not fail the pool: its slot is tried
again. The pool's start waits for the workers of the roles start_awaits
names: a pool with compile workers is ready once they are, its device
workers starting beside them (expire_starts bounds their start then), or,
with DeviceStart.WHEN_NEEDED (pool.executor.roles.deferred_roles), only
when first needed: start_when_needed, at each turn of the manager's loop,
starts them once a task only they take was made (need_devices, which wakes
the manager) or once the compile workers have had nothing queued or running,
and sent nothing, for DEVICE_START_IDLE_SECONDS since the pool started. Until then they are
"not started" (Pool.worker_info); each is then started as a replacement is,
so what follows (a failed start, its chip held, start_timeout from then on)
is the same.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from pool.errors import WorkerStartupError, rebuild_error
from pool.executor.processes import spawn_worker
from pool.executor.roles import Role, deferred_roles, start_awaits
from pool.executor.settings import PoolSettings
from pool.executor.tasks import Kind, Tasks
from pool.executor.wait_set import WaitSet
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


DEVICE_START_IDLE_SECONDS = 1.0
"""How long the compile workers of a started pool must have had nothing queued or running
before its deferred device workers start (DeviceStart.WHEN_NEEDED): long enough for the
caller that made the pool to give it its first compiles, which then run alone, and short
enough that a pool left idle opens its chip all but at once."""

_COMPILES = frozenset({Kind.COMPILE})
_COMPILE_WORKERS = frozenset({Role.COMPILE})


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
        self,
        settings: PoolSettings,
        lock: threading.Lock,
        workers: Workers,
        tasks: Tasks,
        wait_set: WaitSet,
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
        # The roles whose workers the pool's start waits for (see start_awaits).
        self._awaited = start_awaits(settings.plan, bool(settings.preload))
        self._wait_set = wait_set  # the manager's: woken when deferred workers are needed
        # The slots started only when first needed (deferred_roles), by index: "not started"
        # until a worker of theirs is added (not_started_locked).
        later = deferred_roles(settings.plan, bool(settings.preload), settings.device_start)
        self._deferred = tuple(i for i, slot in enumerate(settings.plan) if slot.role in later)
        # Whether they still wait to be started: read without the lock by every new task's
        # maker (need_devices), as a hint; it only ever goes from True to False, under the
        # lock, as start_when_needed starts them.
        self.deferring = bool(self._deferred)
        self._needed = False  # a task only deferred workers take was made (under the lock)
        self._idle_since: float | None = None  # since when the compile workers are idle

    def start(self) -> None:
        """Spawns the pool's workers, but those started when first needed; raises what
        spawning one raised."""
        for index in range(self._settings.workers):
            if index not in self._deferred:
                self._spawn(index)

    def need_devices(self) -> None:
        """A task only the deferred workers take was made (any thread): they start at the
        manager's next turn, which this wakes."""
        with self._lock:
            if not self.deferring or self._needed:
                return
            self._needed = True
            self._wait_set.wake()

    def not_started_locked(self) -> list[Role]:
        """The roles of the slots started when first needed that have no worker yet, by index
        (a slot whose first spawning failed too, until it is tried again)."""
        slots = self._workers.slots_locked() if self._deferred else ()
        return [self._settings.plan[i].role for i in self._deferred if i not in slots]

    def start_when_needed(self, quiet: bool) -> float | None:
        """Starts the deferred workers once they are needed (see the module), on the manager
        thread, whose last wait saw nothing if `quiet`; returns the seconds until the
        compile workers' idle time would start them, None when nothing is to wait for.

        Until they start, the pool's workers are all compile workers: a message
        from one (a compile's reply, which may come and go between two turns of
        the manager) is work on the compile side, as a queued compile or a busy
        compile worker is.

        Not before the pool's start is over (its first compiles are to come), nor
        after it failed, broke, or began to close with nothing queued: as for a
        replacement, no worker is started then.
        """
        if not self.deferring or not self.started.is_set() or self.startup_error is not None:
            return None
        now = time.monotonic()
        with self._lock:
            tasks = self._tasks
            if tasks.broken is not None or (tasks.closing and not tasks.queued):
                return None
            compiling = tasks.queued_of(_COMPILES) or self._workers.busy_locked(_COMPILE_WORKERS)
            if compiling or not quiet or self._idle_since is None:
                self._idle_since = now
            idle = now - self._idle_since
            if not self._needed and idle < DEVICE_START_IDLE_SECONDS:
                return DEVICE_START_IDLE_SECONDS - idle
            why = "a task needs them" if self._needed else "the compile workers are idle"
            self.deferring = False
        logger.info("starting the pool's device workers: %s", why)
        for index in self._deferred:
            try:
                self._spawn(index)
            except Exception as error:  # tried again later, as a replacement is
                self.start_failed(index, WorkerStartupError(f"a worker could not start: {error}"))
        return None

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
            everyone = not self._workers.starting_locked(self._awaited)
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
        if failures < FAILED_STARTS_TO_FAIL_QUEUE:
            return
        with self._lock:
            for kind in Kind:  # the tasks no running worker takes (a pool's runs, say)
                if not self._workers.working_locked(kind):
                    failed = WorkerStartupError(
                        f"no worker is running that takes it ({kind.value} tasks), and the "
                        f"last {failures} attempts to start one failed ({error}); the pool "
                        f"tries again in {delay:.1f} s"
                    )
                    failed.__cause__ = error
                    self._tasks.fail_queued_of_locked(kind, failed)

    def expire_starts(self, timeout: float) -> None:
        """Kills the workers of a started pool still starting after `timeout` seconds
        (Workers.expire_starts_locked); the constructor's own wait bounds the first start."""
        if self.started.is_set():
            with self._lock:
                self._workers.expire_starts_locked(timeout)

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
            everyone = not self._workers.starting_locked(self._awaited)
        delay = DEVICE_HELD_RETRY_SECONDS if foreign else DEVICE_RETRY_SECONDS
        self._respawns[index] = time.monotonic() + delay
        logger.info("the device worker could not take its chip; trying again: %s", error)
        if everyone and not self.started.is_set():
            self.started.set()
