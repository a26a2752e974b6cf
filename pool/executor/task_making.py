"""WorkerPool's making of tasks: what a caller gives checked, the task's record, its staging.

Runs in the parent, in the callers' threads. TaskMaking is a part of
WorkerPool (pool.executor.pool), written apart: _new_task checks what a
call gives and makes its Task (pool.executor.tasks) and future, _stage
checks and converts a run's arguments and stages them in the worker's arena
or the pool's shared memory (pool.executor.inputs), and _submit queues the
task (after a compile on a compile worker where a pool compiles apart,
pool.executor.roles). The parts it uses are WorkerPool's.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from pool.errors import ConvertedInputWarning, PoolError
from pool.executor import forks
from pool.executor.caller import CallerPath
from pool.executor.checks import check_timeout, finite
from pool.executor.futures import PoolFuture, RunOutcome, TaskFuture
from pool.executor.inputs import Layouts, TaskMemory
from pool.executor.never_compile_check import NeverCompileCheck
from pool.executor.programs import program_id, program_text_digest
from pool.executor.requests import Requests
from pool.executor.segments import SegmentCache, lease_of
from pool.executor.settings import PoolSettings, check_devices
from pool.executor.starts import WorkerStarts
from pool.executor.tasks import Kind, Request, Task, Tasks, ValueOp
from pool.executor.values import DeviceValue, values_in
from pool.executor.worker_memory import WorkerMemory
from pool.executor.worker_process import ARENA_INPUT_LIMIT
from worker.compile.arguments import prepare_arguments
from worker.identity.options import checked_compile_options
from worker.records import JaxCompile, LoweredProgram, ProgramSpec


def _warn_converted_shared(
    task: Task, arguments: Sequence[ArrayLike], prepared: Sequence[Any]
) -> None:
    """Warns of each argument made in a pool's shared memory (Pool.asarray, Pool.empty, a
    result) that the run had to convert to the program's dtype: it is copied for every run,
    which is what making it there was to spare. Python's filter says each once."""
    for index, (given, made) in enumerate(zip(arguments, prepared, strict=True)):
        if made is given or type(given) is not np.ndarray or lease_of(given) is None:
            continue
        warnings.warn(
            f"argument {index} of {task.request.name} lies in the pool's shared memory as "
            f"{given.dtype}, but the program reads {made.dtype}: each run converts it, into a "
            f"copy; make it as the program reads it (pool.asarray(x, dtype=np.{made.dtype}), "
            f"pool.empty(shape, np.{made.dtype}))",
            ConvertedInputWarning,
            stacklevel=5,
        )


def _keep_indices(keep: int | Sequence[int]) -> tuple[int, ...]:
    """keep= as sorted output indices; TypeError or ValueError for what is not."""
    if type(keep) is tuple and (
        not keep
        or (all(type(i) is int for i in keep) and keep[0] >= 0 and list(keep) == sorted(set(keep)))
    ):
        return keep  # the usual cases, on every run's path: none, or Pool.function's
    indices = (keep,) if isinstance(keep, int) and not isinstance(keep, bool) else keep
    if not isinstance(indices, Sequence) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in indices
    ):
        raise TypeError(f"keep must be an output index or a sequence of them, not {keep!r}")
    if any(i < 0 for i in indices) or len(set(indices)) != len(indices):
        raise ValueError(f"keep names outputs by their indices, each once: {keep!r}")
    return tuple(sorted(indices))


class TaskMaking:
    """_new_task, _submit, _stage and the run that waits for a compile, for WorkerPool
    (which inherits them)."""

    _pid: int
    _settings: PoolSettings
    _tasks: Tasks
    _segments: SegmentCache
    _requests: Requests
    _caller: CallerPath
    _layouts: Layouts
    _compiled: set[str]
    _never_compile_check: NeverCompileCheck | None
    _starts: WorkerStarts

    # WorkerPool's (pool.executor.pool, pool.face), which these methods call.
    _refuse_in_child: Callable[[], None]
    submit_compile: Callable[..., Future[Any]]

    def _needs_compile(self, task: Task) -> bool:
        """Whether a run's program must first be compiled on a compile worker: in a pool whose
        compiles and runs go to different workers, before this pool compiled it."""
        return self._settings.compiles_apart and task.request.program_id not in self._compiled

    def _submit_after_compile(
        self, task: Task, arguments: Sequence[ArrayLike] | None, zero_copy: bool | None
    ) -> Future[Any]:
        """Stages a run now, and queues it once a compile worker has compiled its program.

        The compile's failure is the run's; a run cancelled meanwhile is
        dropped when it would have been queued.
        """
        request = task.request
        assert request.program is not None
        try:
            self._stage(task, arguments, zero_copy, caller_waits=False)
            compiled = self.submit_compile(
                request.program,
                name=request.name,
                timeout=request.timeout,
                compile_options=request.compile_options,
            )
        except BaseException as error:
            self._caller.recover(task, error)
            raise
        compiled.add_done_callback(functools.partial(self._caller.enqueue_compiled, task))
        return task.future

    def _new_task(
        self,
        kind: Kind,
        program: LoweredProgram | None,
        name: str | None,
        timeout: float | None,
        compile_options: bytes | None,
        spec: ProgramSpec | None = None,
        handed_out: bool = True,
        bundle: str | None = None,
        keep: int | Sequence[int] = (),
        pinned: WorkerMemory | None = None,
        value: ValueOp | None = None,
        jax: JaxCompile | None = None,
    ) -> Task:
        """A task for a program, or (program None) for the executable a ProgramSpec names, or
        a VALUE task (value: its operation; pinned: the memory of the worker it must run
        on, which holds its values; keep: the outputs a run keeps there).

        Everything a caller gives is checked here, before any worker is claimed.
        A run whose future is handed out gets a TaskFuture, whose result() reads
        the reply; Pool.run's own (handed_out False) is a RunOutcome, read once
        the reply was handled, or waited for when the task was queued.
        """
        if self._pid != forks.pid:
            self._refuse_in_child()
        if kind is not Kind.COMPILE and not self._settings.runs:
            raise PoolError(
                f"this pool compiles for the topology {self._settings.topology} without a device "
                "(Pool(topology=...)): it cannot run programs. Run them where that device is, "
                "with a Pool there (its device workers load what this pool published)"
            )
        seconds = self._settings.task_timeout if timeout is None else finite(check_timeout(timeout))
        compile_options = checked_compile_options(compile_options)
        if value is None:  # a program's or a spec's: its devices fit the pool's workers
            partitioning = program.partitioning if spec is None else spec.partitioning
            check_devices(partitioning, self._settings.devices_per_worker, self._settings.topology)
        if value is not None:
            identity, key = f"({value.op.value})", None
        elif program is None:
            assert spec is not None
            identity, name, key = spec.key, name or spec.name, spec.key
        elif jax is not None:  # JAX's value: no executable of the pool's, its own identity
            identity, name, key = f"jax:{jax.key}", name or program.name, None
        else:
            identity = program_id(program, compile_options)
            if self._never_compile_check is not None:
                digest = program_text_digest(program)
                self._never_compile_check.check(program, identity, digest, compile_options, name)
            name, key = name or program.name, None
        request = Request(
            self._tasks.next_id(),
            kind,
            program,
            identity,
            name,
            seconds,
            key,
            None if spec is None else spec.input_types,
            compile_options,
            bundle,
            pinned,
            self._requests.check_keep(identity, _keep_indices(keep), spec),
            value,
            jax,
        )
        if kind is not Kind.COMPILE and self._starts.deferring:
            # Its device workers start now, even while its program compiles first.
            self._starts.need_devices()
        future: Future[Any] | RunOutcome
        if not handed_out:
            future = RunOutcome()  # Pool.run's own: no callbacks, no cancellation
        elif kind is Kind.RUN:
            future = TaskFuture(self._caller)
        else:
            future = PoolFuture()
        return Task(request, future)

    def _submit(
        self, task: Task, arguments: Sequence[ArrayLike] | None, zero_copy: bool | None
    ) -> Future[Any]:
        """Stages a task's arguments (for a run) and queues it; returns its future.

        Whatever cuts this short (bad arguments, a closed pool, a Ctrl-C at
        any step), CallerPath.recover stops the task and gives back its shared memory.
        """
        try:
            if task.request.kind is Kind.RUN:  # checked as Pool.run checks them, None too
                self._stage(task, arguments, zero_copy, caller_waits=False)
            return self._caller.enqueue(task)
        except BaseException as error:
            self._caller.recover(task, error)
            raise

    def _stage(
        self,
        task: Task,
        arguments: Sequence[ArrayLike] | None,
        zero_copy: bool | None,
        caller_waits: bool,
        values: dict[int, DeviceValue] | None = None,
    ) -> None:
        """Checks and converts a run task's arguments and stages them (TaskMemory.stage);
        `values`, the arguments that are DeviceValues, where the caller found them."""
        request = task.request
        types = request.program.input_types if request.program is not None else request.spec_types
        if values is None:
            values = values_in(arguments)
        arrays = prepare_arguments(arguments, types, values.keys())
        if types is not None:
            _warn_converted_shared(task, arguments, arrays)
        # A ProgramSpec's types are what its caller says, and specs of one key may
        # say different things: its inputs are laid out as they are and the worker
        # checks them against the executable's own (worker.serve.placed.check_run_inputs).
        declared = types is not None and request.cache_key is None
        layout = self._layouts.of(request.program_id, types) if declared else None
        zero_copy = self._settings.zero_copy if zero_copy is None else zero_copy
        memory = TaskMemory(zero_copy, declared)
        task.stage(memory)  # first: what share and copy_in take goes back with the task
        if values or layout is None or layout[2] > ARENA_INPUT_LIMIT:  # else all are small
            memory.share(arrays, values, self._segments, ARENA_INPUT_LIMIT)
            if layout is not None and not memory.plain:
                layout = self._layouts.of(request.program_id, types, memory.skipped())
        memory.lay_out(arrays, layout, types or ())
        memory.copy_in(arrays, ARENA_INPUT_LIMIT, self._segments, caller_waits)
