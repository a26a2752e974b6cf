"""WorkerPool: the worker processes behind pool.Pool, compiling and running programs.

pool.Pool (pool.face) is this class behind the face it shares with
ClusterPool: submit_compile, compile, compile_many, map and function are
written there, on the primitives written here (submit, run, submit_spec,
_submit_compile, close, terminate, the figures).

Data flow::

    caller threads                  manager thread                 workers
    ──────────────                  ──────────────                 ───────
    submit(program, args)
      check + convert + copy args
      ──▶ pending ──▶ claim an idle worker (any thread) ──send──▶ python -m worker
      return Future                 (prefer one that has the       compile or load
                                     program loaded)               (shared disk cache)
                                                                   run: PJRT reads the
                                    reply + output memfd  ◀─────── inputs, writes outputs
    Future.result() ◀── numpy views of the output memfd             into shared memory
      (the waiting thread reads the reply itself when it can: TaskFuture)
                                    worker died? ──▶ its task failed (it had started:
                                                     signal, program, output tail) or
                                                     sent again (it had not); respawn
                                    deadline passed? ──▶ kill that worker, fail, respawn

    run(program, args): claims an idle worker and does send + receive in the
    caller's thread (one thread switch less per call), then gives it back; a
    run that keeps every output only sends, and its reply is read by the
    next call to that worker or by the manager (dispatch_ahead).

The WorkerPool is the front: it checks what callers give, makes and stages
their tasks, and stops the pool; two of its own sections are written in
modules of their own, which it inherits: making and staging tasks
(task_making.TaskMaking) and the arrays that outlive a call, put, fetch,
empty and asarray (arrays.PoolArrays). The work is done by parts, each
owning its state, and calls go from here down, never back up:

    WorkerPool           what callers call: checks, tasks, staging, close, terminate
     ├─ CallerPath       what a caller's thread does itself: queueing, the direct
     │                   run, reading a waited-for reply, relaying callbacks, and
     │                   putting right what an exception in a caller's call leaves
     ├─ Closing          close() and terminate(): the tasks told, the manager awaited
     ├─ Manager          the manager thread: deadlines, deaths, replacements, the end
     ├─ Dispatcher       sending claimed tasks, replies, settling (any thread)
     ├─ Requests         each task's message for its worker; programs' output types
     ├─ WorkerStarts     starting workers, replacing those that end, failed starts
     ├─ Workers          the worker processes: claims, holders, reaping
     ├─ Tasks            the queue, orphans, whether the pool takes tasks
     ├─ Quarantine       crash counts, quarantined programs
     ├─ SegmentCache     shared memory for large inputs and outputs, kept for reuse
     └─ WaitSet          the manager's one wait point, and its wake-up

(each above uses only those below it). One lock, the Pool's, guards the
queue and every worker's and task's state; every move of a worker or a task
between states is checked against a table (pool.executor.worker_process,
pool.executor.tasks), and each record is changed only by its owner's methods.

The direct path of Pool.run, the hot path for small programs: run ->
_new_task -> _stage -> CallerPath.claim -> CallerPath.run_directly ->
Dispatcher.send (-> Requests.build) -> Dispatcher.receive (-> _handle ->
_outcome -> _finish -> Task.complete). After a program's first run in a
worker, whose reply gives it a hot slot (WorkerProcess.hot), a run with its
inputs and outputs in the arena goes as a HotRun frame of a few bytes and
comes back as a HotReply (Dispatcher._handle_hot): see worker.wire.protocol.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import ArrayLike

from pool.errors import PoolError, WorkerStartupError
from pool.executor import forks
from pool.executor.arrays import PoolArrays, ValueOwner
from pool.executor.caller import CallerPath
from pool.executor.closing import Closing, terminate_at_exit
from pool.executor.compile_many import CompileCall, CompileResult
from pool.executor.dispatch import Dispatcher, PoolCore
from pool.executor.inputs import Layouts
from pool.executor.manager import Manager
from pool.executor.never_compile_check import NeverCompileCheck
from pool.executor.options import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_MAX_FDS,
    MAX_DISPATCH_AHEAD,
    DeviceStart,
)
from pool.executor.quarantine import Quarantine
from pool.executor.requests import Requests
from pool.executor.segments import SegmentCache
from pool.executor.settings import PoolSettings
from pool.executor.starts import WorkerStarts
from pool.executor.task_making import TaskMaking
from pool.executor.tasks import Kind, Task, Tasks
from pool.executor.values import DeviceValue, values_in
from pool.executor.wait_set import WaitSet
from pool.executor.workers import Workers
from worker.bundle.urls import bundle_source
from worker.cache import CacheCounters
from worker.cache.remote.location import resolve_remote
from worker.identity.keys import check_key
from worker.plugin.conformance_records import warn_known_failures
from worker.plugin.topology import TopologySpec
from worker.records import (
    CompileStatistics,
    LoweredProgram,
    ProgramSpec,
    check_program,
)

if TYPE_CHECKING:
    from pool.manifest import Manifest
    from worker.cache.remote import RemoteCounters


class WorkerPool(TaskMaking, PoolArrays):
    """The worker processes behind pool.Pool, and the machinery that feeds them.

    It implements what the Pool's face (pool.face.PoolFace) is built on:
    submit, run, submit_spec, _submit_compile, close, terminate, the with
    block's end, and the figures (statistics, counters, worker_info).
    pool.face.Pool is this class with that face; its docstring says what
    each option means (pool.executor.options declares them).
    """

    def __init__(
        self,
        workers: int | None = None,
        *,
        platform: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        task_timeout: float | None = None,
        start_timeout: float = 120.0,
        initializer: Callable[..., Any] | None = None,
        initargs: Sequence[Any] = (),
        max_loaded: int = 64,
        max_crashes: int = 2,
        zero_copy: bool = True,
        stop_grace: float = 2.0,
        segment_cache_bytes: int = DEFAULT_CACHE_BYTES,
        segment_fds: int = DEFAULT_MAX_FDS,
        never_compile: bool | None = None,
        preload: Manifest | str | os.PathLike[str] | None = None,
        preload_names: Sequence[str] | None = None,
        prime: bool = False,
        remote: str | Literal[False] | None = None,
        topology: str | TopologySpec | None = None,
        run_workers: int | None = None,
        devices_per_worker: int = 1,
        device_start: DeviceStart = DeviceStart.WHEN_NEEDED,
        dispatch_ahead: int = MAX_DISPATCH_AHEAD,
    ) -> None:
        # The options pool.executor.options declares (tests/test_pool_options.py: they agree).
        given = dict(locals())
        del given["self"]
        self._pid = forks.pid  # first after that: every call compares it (pool.executor.forks)
        # Every option is checked before anything starts (see pool.executor.settings).
        settings = self._settings = PoolSettings.check(given)
        self._assemble(settings)
        # Whatever stops __init__ from here on (a failed start, or a Ctrl-C at any step:
        # the caller never gets the pool to close) stops what it started.
        try:
            self._manager.start()
            # Read once: Thread.ident is a property, and every run compares it.
            self._manager_ident = self._manager.ident
            if not self._starts.started.wait(settings.start_timeout):
                raise WorkerStartupError(
                    f"the workers did not start within {settings.start_timeout:.0f} s "
                    "(plugin loading hung?); raise start_timeout if plugins load slowly here"
                )
            if self._starts.startup_error is not None:
                raise self._starts.startup_error
            terminate_at_exit(self)
            self._started(settings)
            # Here, not in _started: the warning names the caller of Pool() (stacklevel 3).
            warn_known_failures(self._workers.plugin.get("path"), settings.cache_dir)
        except BaseException:
            self.terminate()
            raise

    def _assemble(self, settings: PoolSettings) -> None:
        """Makes the parts of the pool (see the module docstring), each given what it uses."""
        lock = self._lock = threading.Lock()
        self._value_owner = ValueOwner(self)  # what this pool's DeviceValues name as theirs
        wait_set = self._wait_set = WaitSet()
        self._tasks = Tasks(wait_set)
        self._quarantine = Quarantine(lock, settings.max_crashes)
        self._segments = SegmentCache(
            settings.segment_cache_bytes, settings.segment_fds, settings.input_stream_bytes
        )
        self._workers = Workers(settings.plan, lock, wait_set, self._tasks)
        self._starts = WorkerStarts(settings, lock, self._workers, self._tasks, wait_set)
        self._requests = Requests(self._segments)
        core = PoolCore(
            lock, self._tasks, self._workers, self._starts, self._quarantine, self._segments,
            wait_set,
        )  # fmt: skip
        self._dispatcher = Dispatcher(core, self._requests, self._value_owner)
        self._layouts = Layouts()
        # Programs a compile task of this pool compiled or loaded (by program id): their
        # runs need no compile first (Pool._needs_compile). Read without the lock: a miss
        # costs one more compile task, which finds the executable in the cache.
        self._compiled: set[str] = set()
        self._never_compile_check: NeverCompileCheck | None = None
        # The manager spawns the workers: their PR_SET_PDEATHSIG follows the
        # thread that spawned them, and the manager outlives every worker.
        self._manager = Manager(core, self._dispatcher, settings.stop_grace, settings.start_timeout)
        self._closing = Closing(self, lock, self._tasks, self._workers, wait_set, self._manager)
        self._caller = CallerPath(
            lock,
            self._tasks,
            self._workers,
            self._dispatcher,
            self._quarantine,
            wait_set,
            self._manager,
            self._pid,
            self._requests,
            settings.dispatch_ahead,
        )

    def _started(self, settings: PoolSettings) -> None:
        """What follows the workers' start: never-compile mode's check at submit, which
        needs the key parts they said."""
        if settings.never_compile:
            self._never_compile_check = NeverCompileCheck(
                settings.cache_dir,
                self._workers.plugin.get("key_parts"),
                remote=resolve_remote(settings.remote) is not None,
            )

    # -- public API -------------------------------------------------------

    def submit(
        self,
        program: LoweredProgram,
        arguments: Sequence[ArrayLike],
        *,
        name: str | None = None,
        timeout: float | None = None,
        zero_copy: bool | None = None,
        compile_options: bytes | None = None,
        keep: int | Sequence[int] = (),
    ) -> Future[list[np.ndarray]]:
        """Runs a program in a worker (compiling or loading it there first); returns a Future.

        The arguments are checked, converted to the program's input types and
        copied here, raising the same TypeError or ValueError as
        Executable.run; changing them after submit returns does not change
        the task. Two kinds of argument are not copied: an array in the pool's
        shared memory (a result's, Pool.empty's or Pool.asarray's, larger than
        the arena's share) goes as it is, so changes made to it before the run
        starts reach the run; and a DeviceValue (Pool.put, or an output kept
        by keep=) stays in its worker, and the task runs on that worker. The
        Future's result is the list of outputs as numpy arrays (large ones view
        shared memory, freed when the arrays are), with a DeviceValue in place
        of each output `keep` names (its index, or a sequence of them): those
        stay in the worker. timeout (seconds; inf for none) overrides the
        pool's task_timeout. compile_options compiles the program with other
        options than the default, as submit_compile does. A thread that waits
        in the Future's result() reads the worker's reply itself when it can,
        as run does (its done-callbacks still run on the manager thread); a
        Ctrl-C there while the reply is awaited leaves the task running.
        """
        program = check_program(program, "Pool.submit")
        pinned = self._pinned(values_in(arguments), program.input_types)
        task = self._new_task(
            Kind.RUN, program, name, timeout, compile_options, keep=keep, pinned=pinned
        )
        if self._needs_compile(task):
            return self._submit_after_compile(task, arguments, zero_copy)
        return self._submit(task, arguments, zero_copy)

    def run(
        self,
        program: LoweredProgram,
        arguments: Sequence[ArrayLike],
        *,
        name: str | None = None,
        timeout: float | None = None,
        compile_options: bytes | None = None,
        keep: int | Sequence[int] = (),
    ) -> list[np.ndarray]:
        """Runs a program in a worker and returns its outputs (see submit).

        When a worker is idle and no task waits, the calling thread talks to
        the worker itself instead of going through the manager thread: one
        thread switch less per call, which is most of a small program's
        round trip. An exception while it runs (Ctrl-C) stops the task: its
        worker, if it had the task, is killed and replaced (and the values it
        kept with it), and the pool goes on. A run that keeps every output
        returns its DeviceValues once it is sent, before the worker answers
        (the Pool's dispatch_ahead): an error of that run is raised where its
        values are next used (a call taking one, fetch, np.asarray).
        """
        self._refuse_on_manager("Pool.run")
        program = check_program(program, "Pool.run")
        values = values_in(arguments)
        pinned = None if not values else self._pinned(values, program.input_types)
        task = self._new_task(
            Kind.RUN,
            program,
            name,
            timeout,
            compile_options,
            handed_out=False,
            keep=keep,
            pinned=pinned,
        )
        if self._needs_compile(task):
            # On a compile worker first (see pool.executor.roles); the device worker loads it.
            self.submit_compile(
                program, name=name, timeout=timeout, compile_options=compile_options
            ).result()
        return self._call(task, arguments, values)

    def _call(
        self, task: Task, arguments: Sequence[Any], values: dict[int, DeviceValue] | None = None
    ) -> Any:
        """Stages a task, runs it on an idle worker from this thread (or queues it), and
        returns its result (Pool.run's path; put and fetch take it too); `values` are the
        arguments that are DeviceValues, where the caller found them already."""
        caller = self._caller
        try:
            self._stage(task, arguments, None, caller_waits=True, values=values)
            worker = caller.claim(task)
            if worker is None:
                caller.enqueue(task)
            else:
                caller.run_directly(worker, task)
            return task.future.result()
        except BaseException as error:
            caller.recover(task, error)
            raise

    def submit_spec(
        self,
        spec: ProgramSpec,
        arguments: Sequence[ArrayLike],
        *,
        timeout: float | None = None,
        bundle: str | os.PathLike[str] | None = None,
    ) -> Future[list[np.ndarray]]:
        """Runs the executable a ProgramSpec names (by its cache key), as a manifest does.

        The executable must be in the pool's disk cache (put there by warming
        or compiling the program with the same plugin); no program is needed.
        With bundle (a bundle's path or URL: Manifest.run passes its own), the
        workers load the program from that bundle instead, read-only: the
        entry of the program built for their plugin and host, checked as it
        is read (worker.bundle.loading), each bundle opened once per worker.
        A key that is not a cache key raises InvalidKeyError (a ValueError);
        the worker refuses inputs that do not fit the executable's own types.
        """
        if not isinstance(spec, ProgramSpec):
            raise TypeError(f"submit_spec takes a ProgramSpec, not {type(spec).__name__}")
        check_key(spec.key, f"the key of ProgramSpec {spec.name!r}")
        source = bundle_source(bundle)
        task = self._new_task(Kind.RUN, None, spec.name, timeout, None, spec=spec, bundle=source)
        return self._submit(task, arguments, None)

    def _submit_compile(self, call: CompileCall) -> Future[CompileResult]:
        """Pool.submit_compile (pool.face.PoolFace writes its signature and docstring)."""
        program = check_program(call.program, "Pool.submit_compile")
        task = self._new_task(
            Kind.COMPILE, program, call.name, call.timeout, call.options, jax=call.jax
        )
        future = self._submit(task, None, None)
        if self._settings.compiles_apart:
            identity = task.request.program_id

            def note(done: Future[CompileResult]) -> None:
                if not done.cancelled() and done.exception() is None:
                    self._compiled.add(identity)

            future.add_done_callback(note)
        return future

    @property
    def platform(self) -> str | None:
        """The platform of the workers' plugin ("cpu", "cuda", ...): the programs it runs."""
        return self._workers.plugin.get("platform") or self._settings.platform

    @property
    def cache_counters(self) -> CacheCounters:
        """Disk cache hits, misses, repairs and evictions, summed over every worker."""
        self._refuse_in_child()
        with self._lock:
            return self._workers.counters_locked()

    @property
    def remote_counters(self) -> RemoteCounters:
        """The remote cache tier's hits, misses, refusals, publishes and waits, summed over
        every worker (all zero without a remote)."""
        self._refuse_in_child()
        with self._lock:
            return self._workers.remote_counters_locked()

    @property
    def key_parts(self) -> dict[str, Any] | None:
        """The cache key parts of the workers' plugin and host (a program adds its own), when
        the workers said them: in never-compile mode or with a remote tier; else None."""
        parts = self._workers.plugin.get("key_parts")
        return dict(parts) if isinstance(parts, dict) else None

    @property
    def worker_info(self) -> list[dict[str, Any]]:
        """Each worker's pid, state, start-up seconds, plugin, loaded program count, task,
        "hot_runs": the runs it answered as HotRuns (worker.wire.protocol), "role":
        what it is for ("compile and run"; on a TPU host, or with run_workers, "compile" or
        "device": see pool.executor.roles), and "values" and "value_bytes": the values it
        keeps on its device (pool.executor.values) and their bytes, and "ahead": the runs
        sent to it ahead of their replies (Pool's dispatch_ahead). A device worker that
        starts when first needed (device_start) is listed until then with no pid, in
        state "not started": it starts at the first run, or once the compiles are done.

        "task" names the task a worker was given, from the moment it is
        claimed for it; "started" says whether the worker has begun it. Until
        then the task is not yet the worker's: if the worker dies first, the
        task goes to another worker instead of failing.
        """
        self._refuse_in_child()
        with self._lock:
            return self._workers.info_locked(self._starts.not_started_locked())

    @property
    def preload_statistics(self) -> CompileStatistics:
        """What the workers' preloading loaded (Pool(preload=...)), summed over every worker,
        replacements too; Pool.statistics counts the tasks' loads apart from these."""
        self._refuse_in_child()
        with self._lock:
            return self._starts.preload_statistics

    @property
    def statistics(self) -> CompileStatistics:
        """Compile and load time and counts, summed over every task so far."""
        self._refuse_in_child()
        with self._lock:
            return self._dispatcher.statistics

    def _check_open(self) -> None:
        """Raises what a task submitted now would meet: PoolClosedError once the pool is
        closed (or the error that broke it)."""
        self._refuse_in_child()
        with self._lock:
            refusal = self._tasks.refusal_locked()
        if refusal is not None:
            raise refusal

    def _parallelism(self) -> int:
        """How many runs the workers run at once: one per worker that runs programs."""
        return self._settings.runners

    def close(self, cancel_pending: bool = False) -> None:
        """Waits for submitted tasks (or stops queued ones), then stops every worker.

        It returns when the last running task ends (bounded by the tasks'
        timeouts, if any) plus the time to stop the workers: an Exit request,
        then SIGTERM after stop_grace seconds, then SIGKILL after as many
        again, all workers at once. With cancel_pending, queued tasks fail
        with a PoolClosedError that says so instead of running. Calling
        close again does nothing.
        """
        self._refuse_in_child()
        self._closing.close("closed with cancel_pending=True" if cancel_pending else None)

    def terminate(self) -> None:
        """Stops at once: kills the workers; queued and running tasks fail with PoolClosedError.

        Returns as soon as the killed workers are reaped (well under a
        second unless the system is stalled).
        """
        self._refuse_in_child()
        self._closing.terminate("terminated")

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        """Leaving the block closes the pool; by an exception, queued tasks fail instead of
        running, and by KeyboardInterrupt the pool terminates. A forked child leaves
        its parent's pool alone."""
        if self._pid != forks.pid:
            return
        if isinstance(value, KeyboardInterrupt):
            self._closing.terminate(f"terminated (its with block was interrupted by {value!r})")
        elif value is not None:
            self._closing.close(f"closed (its with block raised {type(value).__name__}: {value})")
        else:
            self._closing.close(None)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle, copy.copy and copy.deepcopy all come here.
        raise TypeError(
            "a Pool cannot be pickled or copied: it owns this process's worker processes, "
            "their sockets and shared memory. Make a Pool where one is needed, and send it "
            "LoweredPrograms or ProgramSpecs (which pickle)."
        )

    def _refuse_in_child(self) -> None:
        """Raises PoolForkedError in a process forked from the one that made this pool."""
        forks.refuse_in_child(self._pid)

    def _refuse_on_manager(self, what: str) -> None:
        """Refuses a call that waits for tasks when it comes from a Future's done-callback."""
        # The id first (cheap); a thread that ended may leave its id to another.
        manager = self._manager
        if threading.get_ident() == self._manager_ident and threading.current_thread() is manager:
            raise PoolError(
                f"{what} cannot wait inside a Future's done-callback: callbacks run on the "
                "pool's manager thread, which must stay free to read the workers' replies; "
                "call pool.submit there (and add_done_callback for its result)"
            )
