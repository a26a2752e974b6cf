"""Pool: compile and run programs in crash-isolated PJRT worker processes.

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
                                    worker died? ──▶ its task failed (it had started:
                                                     signal, program, output tail) or
                                                     sent again (it had not); respawn
                                    deadline passed? ──▶ kill that worker, fail, respawn

    run(program, args): claims an idle worker and does send + receive in the
    caller's thread (one thread switch less per call), then gives it back.

The Pool is three parts: this module (what callers call: checking and
staging arguments, the direct path of run, and putting right what an
exception in a caller's call leaves, _recover), pool.executor.dispatch (claiming
workers, sending, replies, settling tasks exactly once: any thread) and
pool.executor.manager (the manager thread: deadlines, deaths, replacements). Every
move of a worker between states is checked against the table in
pool.executor.workers, under one lock.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from pool.errors import (
    PoolClosedError,
    PoolError,
    PoolForkedError,
    ProgramQuarantinedError,
    WorkerStartupError,
)
from pool.executor.compiling import CompileResult, CompilesMany
from pool.executor.dispatch import close_all
from pool.executor.manager import Manager
from pool.executor.never import CachedOnly
from pool.executor.segments import DEFAULT_CACHE_BYTES, DEFAULT_MAX_FDS, SegmentCache
from pool.executor.settings import (
    check_count,
    check_directory,
    check_flag,
    check_grace,
    check_initargs,
    check_platform,
    check_timeout,
    finite,
)
from pool.executor.tasks import (
    ManagerThread,
    PoolFuture,
    Task,
    program_id,
    program_text_digest,
    stage_inputs,
)
from pool.executor.watch import Watch
from pool.executor.workers import ARENA_SIZE, WorkerProcess, pickle_initializer
from worker import compile_mode, protocol, shm
from worker.arguments import prepare_arguments
from worker.cache import CacheCounters, check_cache_dir
from worker.cache.key import check_key
from worker.conformance_memo import warn_known_failures
from worker.records import ArrayType, CompileStatistics, LoweredProgram, ProgramSpec

if TYPE_CHECKING:
    from pool.lowering.function import PoolFunction


DIRECT_SPIN_SECONDS = 500e-6
"""How long Pool.run polls for a worker's reply before sleeping (protocol.spin_until_readable)."""

ARENA_INPUT_LIMIT = ARENA_SIZE // 4
"""Inputs up to this many bytes go through the worker's arena; outputs use the rest.

Smaller tasks then cost no system calls for memory, and their outputs are
copied out of the arena (cheaper than mapping a segment for a few KB). Larger
outputs get a segment of their own that the returned arrays view, with no copy.
"""

_live_pools: weakref.WeakSet[Pool] = weakref.WeakSet()

_pid = os.getpid()
"""This process's id, renewed in a forked child: a pool made under another id is the parent's."""


def _after_fork_in_child() -> None:
    # The child has its parent's pools but none of their threads, and a lock
    # another thread held at the fork stays held here: nothing of them may
    # run in the child, not even at exit. So no lock is taken here.
    global _pid
    _pid = os.getpid()
    _live_pools.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _terminate_live_pools() -> None:
    for live in list(_live_pools):
        live.terminate()


class Pool(Manager, CompilesMany):
    """Worker processes that compile and run LoweredPrograms, each with its own plugin.

    workers is the number of processes (default: the CPU count). platform
    names the plugin to load (default: PJRT_POOL_PLATFORM, else "cpu").
    cache_dir is the shared disk cache (default: PJRT_POOL_CACHE_DIR, else
    the user cache directory). task_timeout bounds each task's time in a
    worker (None or inf: no bound); a task past it has its worker killed
    and replaced. initializer(*initargs) runs in each worker after its
    plugin loads, for example to register custom calls; if it raises, the
    pool does not start. A program that crashes max_crashes workers is
    quarantined. never_compile=True (default: PJRT_POOL_COMPILE=never in the
    environment) makes the pool load what its cache holds and never compile:
    a program that is not there fails with NeverCompileError, a LookupError,
    raised when it is submitted, before any worker is used (see
    worker.compile_mode). Each worker keeps max_loaded executables loaded. Up to
    segment_cache_bytes of shared memory from finished large inputs and
    dropped results is kept for reuse (counting what live results will give
    back), since fresh shared memory is slow to fault in; a result's memory
    past that goes with its arrays. segment_fds bounds the descriptors the
    pool keeps for shared memory beyond those of running tasks (queued large
    inputs, live large results, segments kept for reuse), so a deep queue or
    many kept results never exhaust the process's descriptor limit. Every
    setting is checked here, before any worker starts.

    Submission is thread-safe. The pool is a context manager; close() waits
    for submitted tasks and stops the workers, and may be called twice.
    Futures' done-callbacks run on the pool's manager thread: they may
    submit, but not wait (run, compile and compile_many raise there); one
    that raises is logged and the pool goes on. A process forked from this
    one cannot use the pool (PoolForkedError). A Pool is not picklable.
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
    ) -> None:
        self._pid = _pid  # first: every call compares it (see PoolForkedError)
        # Every setting is checked before anything starts (see pool.executor.settings).
        self._worker_count = (
            (os.cpu_count() or 1)
            if workers is None
            else check_count(workers, "workers", 1, "worker processes")
        )
        self._platform = check_platform(platform)
        self._cache_dir = check_directory(cache_dir, "cache_dir")
        self._task_timeout = finite(check_timeout(task_timeout, "task_timeout"))
        start_limit = finite(check_timeout(start_timeout, "start_timeout"))
        self._max_loaded = check_count(
            max_loaded, "max_loaded", 1, "executables each worker keeps loaded"
        )
        self._max_crashes = check_count(
            max_crashes, "max_crashes", 1, "worker crashes that quarantine a program"
        )
        self._zero_copy = check_flag(zero_copy, "zero_copy")
        self._stop_grace = check_grace(stop_grace, "stop_grace")
        cache_bytes = check_count(
            segment_cache_bytes, "segment_cache_bytes", 0, "bytes of shared memory kept for reuse"
        )
        segment_fds = check_count(
            segment_fds, "segment_fds", 0, "descriptors kept for shared memory"
        )
        self._initializer = pickle_initializer(initializer, check_initargs(initargs))
        check_cache_dir(self._cache_dir)  # fail fast on a cache directory others could write
        self._never_compile = compile_mode.never_compile(never_compile)
        self._cached_only: CachedOnly | None = None

        self._lock = threading.Lock()
        self._pending: collections.deque[Task] = collections.deque()
        self._closing = False
        self._broken: BaseException | None = None
        self._task_ids = itertools.count()
        self._crashes: collections.Counter[str] = collections.Counter()
        self._quarantined: dict[str, str] = {}
        self._statistics = CompileStatistics()
        self._output_types: dict[str, tuple[ArrayType, ...]] = {}  # by program id
        self._input_layouts: dict[str, tuple[tuple[ArrayType, ...], tuple[int, ...], int]] = {}
        self._segments = SegmentCache(cache_bytes, segment_fds)
        self._orphans: list[tuple[Task, BaseException]] = []
        self._retired_counters = CacheCounters()
        self._startup_failures = 0
        self._respawns: dict[int, float] = {}  # worker index -> when to try starting it again
        self._started = threading.Event()
        self._startup_error: BaseException | None = None

        self._watch = Watch()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._watch.add(self._wake_r, None)
        self._workers: list[WorkerProcess] = []
        # The manager spawns the workers: their PR_SET_PDEATHSIG follows the
        # thread that spawned them, and the manager outlives every worker.
        self._manager = ManagerThread(target=self._manage, name="pjrt-pool-manager", daemon=True)
        self._manager.start()
        if not self._started.wait(start_limit):
            self.terminate()
            raise WorkerStartupError(
                f"the workers did not start within {start_timeout:.0f} s "
                "(plugin loading hung?); raise start_timeout if plugins load slowly here"
            )
        if self._startup_error is not None:
            self.terminate()
            raise self._startup_error
        _live_pools.add(self)
        if self._never_compile:
            parts = self._workers[0].plugin.get("key_parts")
            self._cached_only = CachedOnly(self._cache_dir, parts)
        warn_known_failures(self._workers[0].plugin.get("path"), self._cache_dir)

    def _spawn_worker(self, index: int) -> WorkerProcess:
        return WorkerProcess(
            index,
            self._platform,
            self._cache_dir,
            self._max_loaded,
            self._initializer,
            self._never_compile,
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
    ) -> Future[list[np.ndarray]]:
        """Runs a program in a worker (compiling or loading it there first); returns a Future.

        The arguments are checked, converted to the program's input types and
        copied here, raising the same TypeError or ValueError as
        Executable.run; changing them after submit returns does not change
        the task. The Future's result is the list of outputs as numpy arrays
        (large ones view shared memory, freed when the arrays are).
        timeout (seconds; inf for none) overrides the pool's task_timeout.
        compile_options compiles the program with other options than the
        default, as submit_compile does.
        """
        task = self._new_task("run", self._check_program(program), name, timeout, compile_options)
        return self._submit(task, arguments, zero_copy)

    def run(
        self,
        program: LoweredProgram,
        arguments: Sequence[ArrayLike],
        *,
        name: str | None = None,
        timeout: float | None = None,
        compile_options: bytes | None = None,
    ) -> list[np.ndarray]:
        """Runs a program in a worker and returns its outputs (see submit).

        When a worker is idle and no task waits, the calling thread talks to
        the worker itself instead of going through the manager thread: one
        thread switch less per call, which is most of a small program's
        round trip. An exception while it runs (Ctrl-C) stops the task: its
        worker, if it had the task, is killed and replaced, and the pool goes on.
        """
        self._refuse_on_manager("Pool.run")
        task = self._new_task("run", self._check_program(program), name, timeout, compile_options)
        try:
            self._staged(task, arguments, None, caller_waits=True)
            worker = self._claim_for_caller(task)
            if worker is None:
                self._enqueue(task)
            else:
                self._run_directly(worker, task)
            return task.future.result()
        except BaseException as error:
            self._recover(task, error)
            raise

    def submit_spec(
        self,
        spec: ProgramSpec,
        arguments: Sequence[ArrayLike],
        *,
        timeout: float | None = None,
    ) -> Future[list[np.ndarray]]:
        """Runs the executable a ProgramSpec names (by its cache key), as a manifest does.

        The executable must be in the pool's disk cache (put there by warming
        or compiling the program with the same plugin); no program is needed.
        A key that is not a cache key raises InvalidKeyError (a ValueError);
        the worker refuses inputs that do not fit the executable's own types.
        """
        if not isinstance(spec, ProgramSpec):
            raise TypeError(f"submit_spec takes a ProgramSpec, not {type(spec).__name__}")
        check_key(spec.key, f"the key of ProgramSpec {spec.name!r}")
        task = self._new_task("run", None, spec.name, timeout, None, spec=spec)
        return self._submit(task, arguments, None)

    def submit_compile(
        self,
        program: LoweredProgram,
        *,
        name: str | None = None,
        timeout: float | None = None,
        compile_options: bytes | None = None,
    ) -> Future[CompileResult]:
        """Compiles (or loads) a program in a worker; the Future's result is a CompileResult.

        compile_options replaces the default serialized CompileOptionsProto
        (one replica, one partition); it is part of the program's identity,
        so the spec's key is the one compile_program gives for these options,
        and runs with other options use their own executable. The plugin
        checks it: malformed options can make the plugin abort, which fails
        only this task.
        """
        task = self._new_task(
            "compile", self._check_program(program), name, timeout, compile_options
        )
        return self._submit(task, None, None)

    def compile(
        self, program: LoweredProgram, *, name: str | None = None, timeout: float | None = None
    ) -> ProgramSpec:
        """Compiles (or loads) a program in a worker and returns its ProgramSpec."""
        self._refuse_on_manager("Pool.compile")
        return self.submit_compile(program, name=name, timeout=timeout).result().spec

    def function(
        self,
        function: Callable[..., Any],
        *,
        static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = (),
        platform: str | None = None,
        custom_calls: Sequence[str] = (),
        name: str | None = None,
        static_argnames: str | Sequence[str] | None = None,
    ) -> PoolFunction:
        """Returns function as a callable that runs in this pool's workers, like jax.jit(function).

        Calling it lowers the function in this process once per signature (the
        arguments' tree structure, shapes, dtypes and weak types, the static
        arguments' types and values, and JAX's trace context: the config that
        changes programs, such as jax_enable_x64, numpy_rank_promotion and
        threefry_partitionable, as jax.jit caches), then runs the program with
        Pool.run: a worker compiles it or loads it from the disk cache. It
        returns the result in the structure jax.jit(function)(*args) returns,
        with numpy arrays as leaves; typed PRNG keys come back as keys and
        float0 results as float0 arrays. Arguments are pytrees of numpy
        arrays, JAX arrays, Python scalars (weakly typed, as in jax.jit) and
        typed keys. static_argnums, static_argnames and custom_calls mean what
        they mean for jax.jit and lower (a static argument a call leaves out
        takes the function's default; other keyword arguments are dynamic);
        platform is the one to lower for (default: that of this pool's
        plugin); name names the tasks (default: the program's name). Its
        submit method returns a Future of the result and its lower method the
        LoweredProgram a call runs. Crash isolation, timeouts and quarantine
        are those of submit. It runs in another process, so it cannot be
        traced: jax.grad, jax.vmap or jax.jit of it raise TypeError (make the
        PoolFunction of the transformed function instead).

        donate_argnums is accepted and ignored, with a warning: arguments are
        copied into shared memory for the worker, so donated arrays stay
        valid and no memory is saved.
        """
        from pool.lowering.function import PoolFunction

        self._refuse_in_child()
        return PoolFunction(
            self,
            function,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            platform=platform,
            custom_calls=custom_calls,
            name=name,
        )

    @property
    def cache_counters(self) -> CacheCounters:
        """Disk cache hits, misses, repairs and evictions, summed over every worker."""
        self._refuse_in_child()
        with self._lock:
            total = self._retired_counters
            for worker in self._workers:
                total = total.add(CacheCounters(**worker.counters))
            return total

    @property
    def worker_info(self) -> list[dict[str, Any]]:
        """Each worker's pid, state, start-up seconds, plugin, loaded program count and task."""
        self._refuse_in_child()
        with self._lock:
            return [
                {
                    "pid": w.pid,
                    "state": w.state.value,
                    "startup_seconds": w.startup_seconds,
                    "plugin": dict(w.plugin),
                    "loaded": len(w.loaded),
                    "task": None if w.task is None else w.task.name,
                }
                for w in self._workers
            ]

    @property
    def statistics(self) -> CompileStatistics:
        """Compile and load time and counts, summed over every task so far."""
        self._refuse_in_child()
        return super().statistics

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
        self._close("closed with cancel_pending=True" if cancel_pending else None)

    def terminate(self) -> None:
        """Stops at once: kills the workers; queued and running tasks fail with PoolClosedError.

        Returns as soon as the killed workers are reaped (well under a
        second unless the system is stalled).
        """
        self._refuse_in_child()
        self._terminate("terminated")

    def __enter__(self) -> Pool:
        self._refuse_in_child()
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        """Leaving the block closes the pool; by an exception, queued tasks fail instead of
        running, and by KeyboardInterrupt the pool terminates. A forked child leaves
        its parent's pool alone."""
        if self._pid != _pid:
            return
        if isinstance(value, KeyboardInterrupt):
            self._terminate(f"terminated (its with block was interrupted by {value!r})")
        elif value is not None:
            self._close(f"closed (its with block raised {type(value).__name__}: {value})")
        else:
            self._close(None)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle, copy.copy and copy.deepcopy all come here.
        raise TypeError(
            "a Pool cannot be pickled or copied: it owns this process's worker processes, "
            "their sockets and shared memory. Make a Pool where one is needed, and send it "
            "LoweredPrograms or ProgramSpecs (which pickle)."
        )

    def _close(self, stop_queued: str | None) -> None:
        """close(); with stop_queued (how the pool was stopped), queued tasks fail instead."""
        with self._lock:
            self._closing = True
            if stop_queued is not None:
                self._fail_queued_locked(
                    PoolClosedError, f"the pool was {stop_queued} before the task ran"
                )
            self._wake()
        self._await_manager()

    def _terminate(self, how: str) -> None:
        """terminate(); `how` says how the pool was stopped, in the tasks' errors."""
        with self._lock:
            self._closing = True
            self._broken = self._broken or PoolClosedError(f"the pool was {how}")
            self._fail_queued_locked(PoolClosedError, f"the pool was {how} before the task ran")
            for worker in self._workers:
                task = worker.task
                if task is not None and not task.done and task.kill_error is None:
                    task.kill_error = PoolClosedError(
                        f"the pool was {how} during the task; its worker was killed"
                    )
                self._kill_locked(worker)
            self._wake()
        self._await_manager()

    def _await_manager(self) -> None:
        """Waits for the manager thread to end, unless this is it, and completes what it left.

        The manager completes the tasks a stop failed (so their done-callbacks
        run on it, like every other callback); one stopped after the manager
        had ended is completed here.
        """
        _live_pools.discard(self)
        manager = getattr(self, "_manager", None)
        if threading.current_thread() is manager:
            return  # a done-callback stopped the pool: the manager's next turn does the rest
        if manager is not None and manager.is_alive():
            manager.join()
        self._complete_orphans()

    def _refuse_in_child(self) -> None:
        """Raises PoolForkedError in a process forked from the one that made this pool."""
        if self._pid != _pid:
            raise PoolForkedError(
                f"this Pool belongs to process {self._pid}, which this process ({os.getpid()}) "
                "was forked from: a forked child cannot use its parent's workers (it has none "
                "of the parent's threads, and a lock one of them held stays held). Make a Pool "
                "in this process instead."
            )

    # -- tasks -------------------------------------------------------------

    @staticmethod
    def _check_program(program: Any) -> LoweredProgram:
        if not isinstance(program, LoweredProgram):
            raise TypeError(
                f"the pool runs LoweredPrograms (from pool.lower), not {type(program).__name__}"
            )
        return program

    def _new_task(
        self,
        kind: str,
        program: LoweredProgram | None,
        name: str | None,
        timeout: float | None,
        compile_options: bytes | None,
        spec: ProgramSpec | None = None,
    ) -> Task:
        """A task for a program, or (program None) for the executable a ProgramSpec names.

        Everything a caller gives is checked here, before any worker is claimed.
        """
        if self._pid != _pid:
            self._refuse_in_child()
        seconds = self._task_timeout if timeout is None else finite(check_timeout(timeout))
        if compile_options is not None and not isinstance(compile_options, bytes):
            raise TypeError("compile_options must be bytes (a serialized CompileOptionsProto)")
        if program is None:
            assert spec is not None
            identity, name, key = spec.key, name or spec.name, spec.key
        else:
            identity = program_id(program, compile_options)
            if self._cached_only is not None:
                digest = program_text_digest(program)
                self._cached_only.check(program, identity, digest, compile_options, name)
            name, key = name or program.name, None
        return Task(
            id=next(self._task_ids),
            kind=kind,
            program=program,
            program_id=identity,
            name=name,
            future=PoolFuture(),
            timeout=seconds,
            cache_key=key,
            spec_types=None if spec is None else spec.input_types,
            compile_options=compile_options,
        )

    def _submit(
        self, task: Task, arguments: Sequence[ArrayLike] | None, zero_copy: bool | None
    ) -> Future[Any]:
        """Stages a task's arguments (for a run) and queues it; returns its future.

        Whatever cuts this short (bad arguments, a closed pool, a Ctrl-C at
        any step), Pool._recover stops the task and gives back its shared memory.
        """
        try:
            if arguments is not None:
                self._staged(task, arguments, zero_copy, caller_waits=False)
            return self._enqueue(task)
        except BaseException as error:
            self._recover(task, error)
            raise

    def _staged(
        self,
        task: Task,
        arguments: Sequence[ArrayLike],
        zero_copy: bool | None,
        caller_waits: bool,
    ) -> None:
        """Checks and converts a run task's arguments and stages them (see stage_inputs)."""
        types = task.program.input_types if task.program is not None else task.spec_types
        arrays = prepare_arguments(arguments, types)
        task.zero_copy = self._zero_copy if zero_copy is None else zero_copy
        # A ProgramSpec's types are what its caller says, and specs of one key may
        # say different things: its inputs are laid out as they are and the worker
        # checks them against the executable's own (worker.server.check_run_inputs).
        task.declared_types = types is not None and task.cache_key is None
        layout = self._input_layout(task.program_id, types) if task.declared_types else None
        stage_inputs(task, arrays, ARENA_INPUT_LIMIT, self._segments, layout, caller_waits)

    def _input_layout(
        self, program_key: str, types: tuple[ArrayType, ...] | None
    ) -> tuple[tuple[ArrayType, ...], tuple[int, ...], int] | None:
        """The shared-memory layout of a program's declared inputs, computed once."""
        if types is None:
            return None
        layout = self._input_layouts.get(program_key)
        if layout is None:
            offsets, size = shm.layout(types)
            layout = self._input_layouts[program_key] = (types, offsets, size)
        return layout

    def _enqueue(self, task: Task) -> Future[Any]:
        """Queues a task and dispatches what is queued; the caller's except clause runs
        Pool._recover for whatever raises here."""
        with self._lock:
            refusal = self._refusal_locked(task)
            if refusal is None:
                self._pending.append(task)
        if refusal is not None:
            raise refusal
        # Dispatch from the caller's thread: waking the manager thread for it
        # would cost a thread switch (and a GIL hand-off) on every task.
        self._dispatch(threading.get_ident())
        return task.future

    def _refusal_locked(self, task: Task) -> BaseException | None:
        if self._closing or self._broken is not None:
            return self._broken or PoolClosedError("the pool is closed")
        reason = self._quarantined.get(task.program_id)
        return None if reason is None else ProgramQuarantinedError(reason)

    def _refuse_on_manager(self, what: str) -> None:
        """Refuses a call that waits for tasks when it comes from a Future's done-callback."""
        if threading.current_thread() is self._manager:
            raise PoolError(
                f"{what} cannot wait inside a Future's done-callback: callbacks run on the "
                "pool's manager thread, which must stay free to read the workers' replies; "
                "call pool.submit there (and add_done_callback for its result)"
            )

    def _before_waiting(self, what: str) -> None:  # CompilesMany's hook
        self._refuse_in_child()
        self._refuse_on_manager(what)

    # -- the direct path of Pool.run -----------------------------------------

    def _claim_for_caller(self, task: Task) -> WorkerProcess | None:
        """Claims an idle worker for the caller's thread, or returns None (use the queue)."""
        with self._lock:
            if self._pending or self._refusal_locked(task) is not None:
                return None  # the queue keeps the order, or reports the refusal
            worker = self._idle_worker_locked(task.program_id)
            if worker is None:
                return None
            task.future.set_running_or_notify_cancel()
            self._claim_locked(worker, task, threading.get_ident())
        return worker

    def _run_directly(self, worker: WorkerProcess, task: Task) -> None:
        """Sends a claimed worker its task and reads the reply in the caller's thread.

        Handling the reply gives the worker back (idle); a dead worker is
        given back for the manager to reap (which fails or requeues the
        task); one that breaks the protocol is retired. An exception of
        this thread's own is put right by Pool._recover.
        """
        message, fds = self._request_for(task, worker)
        task.sending = True
        try:
            worker.send(message, fds)
        except OSError:
            self._retire(worker)  # dead or broken; it cannot have started the task
            return
        protocol.spin_until_readable(worker.sock, DIRECT_SPIN_SECONDS)
        reply_fds: list[int] = []
        try:
            reply, reply_fds = worker.receive()
        except protocol.DescriptorLimitError as error:
            self._on_message(worker, error.message, [], error)
        except (protocol.ConnectionLostError, OSError):
            self._give_back(worker)  # it died: the manager reaps it and settles the task
        except Exception:
            self._retire(worker)  # not a frame of ours: the worker broke the protocol
        else:
            try:
                self._on_message(worker, reply, reply_fds)
            finally:
                if reply_fds:  # an interrupt at _on_message's entry: it took none
                    close_all(reply_fds)
        if self._pending:  # queued meanwhile, or the reply asked to send the task again
            self._dispatch(threading.get_ident())

    def _recover(self, own: Task, error: BaseException) -> None:
        """Puts right what an exception left in a caller's call: its workers and its task.

        Runs in the except clause of every call that may claim a worker (run,
        and _submit for the submits), so that an exception (a Ctrl-C lands
        at any call) anywhere between claiming a worker and giving it back
        leaves the pool as it should be. A worker this thread still holds
        goes back to the manager: killed and replaced if its request may be
        out or cut short (another thread's task then goes to another worker),
        idle if nothing was sent (another thread's task back to the queue).
        The caller's own task is stopped: failed with the error, or with a
        PoolError for an interruption; a task settled already gets its shared
        memory back (giving back twice is harmless). Cheap and harmless when
        nothing is held, as after the task's own error.
        """
        me = threading.get_ident()
        failure = (
            error
            if isinstance(error, Exception)
            else PoolError(f"the call was interrupted ({type(error).__name__}); its task stopped")
        )
        settled = False
        with self._lock:
            for worker in self._workers:
                if worker.holder != me:
                    continue
                held = worker.task
                if held is not None and held.sending:
                    self._retire_locked(worker)
                    continue
                if held is not None and held is not own:
                    held.sending = False
                    self._pending.appendleft(held)
                self._unclaim_locked(worker)
            if not own.done:
                running = next((w for w in self._workers if w.task is own), None)
                if running is not None:
                    own.kill_error = own.kill_error or failure
                    self._kill_locked(running)
                else:
                    if own in self._pending:
                        self._pending.remove(own)
                    settled = self._settle_locked(own)
            if self._pending:
                self._wake()
        if settled:
            self._complete(own, failure)
        elif own.done:
            own.release()  # settled before, but the interrupt may have cut its completion short
