"""ClusterPool: Pool's API (run, submit, submit_spec, map, function, compile) on a Dask cluster.

Each call becomes one Dask task that runs in the Pool of the node it is
routed to (pool.cluster.routing; pool.cluster.node for the node's side).
Inputs and outputs travel as Dask's own task arguments and results (numpy
arrays as out-of-band buffers, without pickling copies); a Dask future (of
one array, or of a whole list of inputs, such as another run's
dask_future) is passed as a dependency, so its data goes from the node that
holds it to the node that runs, never through this process.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import distributed
import numpy as np

from pool.cluster.futures import ClusterFuture, uncarry
from pool.cluster.node import (
    PLUGIN_NAME,
    PoolPlugin,
    compile_task,
    hold,
    node_counters,
    run_spec_task,
    run_task,
)
from pool.cluster.routing import Router, home_of
from pool.cluster.run_once import ONCE_PREFIX, RUN_ONCE_NAME, RunOnce
from pool.executor.compile_many import CompileResult, Progress, compile_many
from pool.executor.programs import program_id
from pool.executor.settings import check_remote
from worker.arguments import prepare_arguments
from worker.cache import CacheCounters
from worker.cache.key import check_key
from worker.compile.identity import checked_compile_options
from worker.compile.never_compile import never_compile_on
from worker.errors import NeverCompileError
from worker.records import ArrayType, CompileStatistics, LoweredProgram, ProgramSpec, check_program

if TYPE_CHECKING:
    from pool.lowering.function import PoolFunction

HOLD_TEXT_CHARS = 64 << 10
"""Programs with a longer text are sent to the nodes once, as a Dask task of their own
(node.hold) that runs depend on; shorter ones travel with each run (cheaper than a
dependency)."""

_HELD_PROGRAMS = 1024
"""How many held programs a ClusterPool keeps on the cluster (the oldest go first)."""


class ClusterPool:
    """Compiles and runs programs on a Dask cluster, a Pool per Dask worker, as Pool does.

    client is a connected distributed.Client. workers_per_node is each Dask
    worker's number of PJRT worker processes (default: its CPU count);
    platform, cache_dir, task_timeout, initializer, never_compile and remote
    are as for Pool and apply on every node (never_compile also refuses, at
    submit, a program its home node's cache lacks, and its remote tier too
    when there is one; remote is the remote cache tier's URL, given to each
    node's PJRT workers: the nodes share the entries one of them compiled,
    and a fleet's other hosts do too). The cluster's Dask workers
    should have as many threads as PJRT workers, so that tasks reach every
    PJRT worker.

    A run whose Dask worker is lost is run again elsewhere by Dask, since a
    run is a pure function of its program and inputs; retry_lost=False
    fails it with NodeLostError instead (it needs the scheduler to accept a
    plugin: distributed.scheduler.pickle). Either way its future settles
    once. spread_at is how many runs in flight on a program's nodes make its
    next run go to a less busy node (default: twice the threads of a node;
    see pool.cluster.routing).
    """

    def __init__(
        self,
        client: distributed.Client,
        *,
        workers_per_node: int | None = None,
        platform: str | None = None,
        cache_dir: str | None = None,
        task_timeout: float | None = None,
        initializer: Callable[[], Any] | None = None,
        never_compile: bool | None = None,
        retry_lost: bool = True,
        spread_at: int | None = None,
        remote: str | None = None,
    ) -> None:
        if not isinstance(retry_lost, bool):
            raise TypeError(f"retry_lost must be True or False, not {retry_lost!r}")
        self.client = client
        self._platform = platform
        self._never_compile = never_compile_on(never_compile)
        options: dict[str, Any] = {
            "workers": workers_per_node,
            "platform": platform,
            "cache_dir": cache_dir,
            "task_timeout": task_timeout,
            "never_compile": self._never_compile,
            "remote": check_remote(remote),  # refused here, before any node starts a Pool
        }
        if initializer is not None:
            options["initializer"] = initializer
        if spread_at is None:
            threads = client.nthreads()
            spread_at = 2 * max(threads.values(), default=1)
        self._router = Router(client.nthreads, spread_at)
        self._key_prefix = "pjrt-run-" if retry_lost else ONCE_PREFIX
        self._run_once = not retry_lost
        client.register_plugin(PoolPlugin(**options), name=PLUGIN_NAME)
        if self._run_once:
            client.register_plugin(RunOnce(), name=RUN_ONCE_NAME)
        self._statistics = CompileStatistics()
        self._held: collections.OrderedDict[str, distributed.Future] = collections.OrderedDict()
        self._in_cache: set[str] = set()
        self._finished = 0
        self._lock = threading.Lock()

    # -- running --------------------------------------------------------------------

    def submit(
        self,
        program: LoweredProgram,
        inputs: Sequence[Any] | distributed.Future,
        *,
        name: str | None = None,
        timeout: float | None = None,
        compile_options: bytes | None = None,
    ) -> ClusterFuture:
        """Runs a program on a node (compiling or loading it there first); returns a Future.

        The future is a concurrent.futures.Future of the outputs (numpy
        arrays, fetched here when the run ends); its dask_future is Dask's
        own future of them. inputs are arrays (checked and converted here,
        raising what Pool.submit raises), Dask futures of arrays, or one Dask
        future of the whole list (checked on the node). A plugin crash,
        timeout or quarantine fails the run with the node Pool's exception.
        name, timeout and compile_options are as for Pool.submit.
        """
        program = check_program(program, "ClusterPool.submit")
        compile_options = checked_compile_options(compile_options)
        identity = program_id(program, compile_options)
        name = name or program.name
        if self._never_compile:
            self._check_in_cache(program, identity, name, timeout, compile_options)
        arguments = _arguments(inputs, program.input_types)
        carried: Any = program
        if len(program.text) > HOLD_TEXT_CHARS:
            carried = self._hold(identity, program)
        return self._submit(identity, run_task, carried, arguments, name, timeout, compile_options)

    def run(
        self,
        program: LoweredProgram,
        inputs: Sequence[Any] | distributed.Future,
        *,
        name: str | None = None,
        timeout: float | None = None,
        compile_options: bytes | None = None,
    ) -> list[np.ndarray]:
        """Runs a program on a node and returns its outputs (see submit)."""
        future = self.submit(
            program, inputs, name=name, timeout=timeout, compile_options=compile_options
        )
        return future.result()

    def submit_spec(
        self,
        spec: ProgramSpec,
        inputs: Sequence[Any] | distributed.Future,
        *,
        timeout: float | None = None,
    ) -> ClusterFuture:
        """Runs the executable a ProgramSpec names on a node, as Pool.submit_spec does.

        The executable must be in that node's disk cache (a shared cache, or
        one each node was warmed into).
        """
        if not isinstance(spec, ProgramSpec):
            raise TypeError(f"submit_spec takes a ProgramSpec, not {type(spec).__name__}")
        check_key(spec.key, f"the key of ProgramSpec {spec.name!r}")
        arguments = _arguments(inputs, spec.input_types)
        return self._submit(spec.key, run_spec_task, spec, arguments, timeout)

    def map(
        self,
        program: LoweredProgram | ProgramSpec,
        batches: Iterable[Sequence[Any]],
        *,
        name: str | None = None,
        timeout: float | None = None,
        compile_options: bytes | None = None,
        max_in_flight: int | None = None,
        return_exceptions: bool = False,
    ) -> Iterator[Any]:
        """Runs a program (or a ProgramSpec's executable) on each inputs of batches; yields
        the outputs in order.

        Runs are submitted as the iterator is read, at most max_in_flight
        (default: four per thread of the cluster) ahead of the one it waits
        for, so a long or endless iterable of batches never floods the
        cluster nor this process's memory. A run's failure raises when its
        turn comes (with return_exceptions, the exception is yielded in its
        place and the runs go on); leaving the iterator early cancels the
        runs not yet done.
        """
        if max_in_flight is None:
            max_in_flight = 4 * max(1, sum(self.client.nthreads().values()))
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be a positive int, not {max_in_flight!r}")
        if isinstance(program, ProgramSpec):
            spec = program

            def submit(inputs: Sequence[Any]) -> ClusterFuture:
                return self.submit_spec(spec, inputs, timeout=timeout)
        else:

            def submit(inputs: Sequence[Any]) -> ClusterFuture:
                return self.submit(
                    program, inputs, name=name, timeout=timeout, compile_options=compile_options
                )

        return _bounded(submit, batches, max_in_flight, return_exceptions)

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
        """Returns function as a callable that runs on the cluster, like Pool.function's.

        It lowers here, once per signature, and runs each call with
        ClusterPool.run (its submit with ClusterPool.submit); everything
        else is as Pool.function says, with the nodes' crash isolation.
        """
        from pool.lowering.function import PoolFunction  # imports JAX (about a second)

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

    def follow(self, dask_future: distributed.Future) -> ClusterFuture:
        """A ClusterFuture of a Dask future (of a run's dask_future, say), fetched when done."""
        if not isinstance(dask_future, distributed.Future):
            raise TypeError(f"follow takes a Dask future, not {type(dask_future).__name__}")
        return ClusterFuture(dask_future)

    def _submit(self, identity: str, task: Callable[..., Any], *args: Any) -> ClusterFuture:
        address = self._router.choose(identity)
        try:
            remote = self.client.submit(
                task,
                *args,
                key=f"{self._key_prefix}{uuid.uuid4().hex}",
                workers=[address],
                allow_other_workers=True,
                pure=False,
            )
        except BaseException:
            self._router.done(address)
            raise
        return ClusterFuture(remote, done=lambda: self._ended(address))

    def _ended(self, address: str) -> None:
        self._router.done(address)
        with self._lock:
            self._finished += 1

    def _hold(self, identity: str, program: LoweredProgram) -> distributed.Future:
        """The Dask future holding a long program on the cluster (see node.hold)."""
        with self._lock:
            held = self._held.get(identity)
            if held is not None:
                self._held.move_to_end(identity)
                return held
        held = self.client.submit(
            hold,
            program,
            key=f"pjrt-program-{identity}",
            workers=[home_of(identity, self._router.addresses())],
            allow_other_workers=True,
            pure=False,
        )
        with self._lock:
            held = self._held.setdefault(identity, held)
            while len(self._held) > _HELD_PROGRAMS:
                self._held.popitem(last=False)
        return held

    def _check_in_cache(
        self,
        program: LoweredProgram,
        identity: str,
        name: str,
        timeout: float | None,
        compile_options: bytes | None,
    ) -> None:
        """In never-compile mode: raises NeverCompileError here if the home node's cache lacks
        the program (its Pool refuses before any PJRT worker does anything); once per program."""
        if identity in self._in_cache:
            return
        outcome = self.client.submit(
            compile_task,
            program,
            name,
            timeout,
            compile_options,
            workers=[home_of(identity, self._router.addresses())],
            allow_other_workers=True,
            pure=False,
        ).result()
        outcome = uncarry(outcome) if isinstance(outcome, BaseException) else outcome
        if isinstance(outcome, NeverCompileError):
            raise outcome
        self._in_cache.add(identity)

    @property
    def platform(self) -> str | None:
        """The platform the nodes' plugins run (the platform option; None: lower's default)."""
        return self._platform

    @property
    def finished_runs(self) -> int:
        """Runs (and spec runs) of this ClusterPool that have ended, each counted once."""
        with self._lock:
            return self._finished

    @property
    def router(self) -> Router:
        """The routing of runs to nodes, with each node's runs in flight (pool.cluster.routing)."""
        return self._router

    # -- compiling ------------------------------------------------------------------

    def _route(self, program: LoweredProgram) -> list[str]:
        """The node a program compiles on: its home (stable, so each compiles once)."""
        # nthreads() asks the scheduler and returns its answer; scheduler_info()
        # returns an attribute that the Client's periodic refresh overwrites with
        # an identity of no workers, so another thread can read it empty.
        addresses = sorted(self.client.nthreads())
        if not addresses:
            raise RuntimeError("the Dask cluster has no workers")
        return [home_of(program_id(program), addresses)]

    def submit_compile(
        self,
        program: LoweredProgram,
        *,
        name: str | None = None,
        timeout: float | None = None,
        compile_options: bytes | None = None,
    ) -> Future[CompileResult]:
        """Compiles a program on the node its hash picks; the future's result is a CompileResult.

        A program's own failure (compile error, PJRT worker crash, timeout)
        is the future's exception, as with Pool.submit_compile.
        """
        program = check_program(program, "ClusterPool.submit_compile")
        remote = self.client.submit(
            compile_task,
            program,
            name or program.name,
            timeout,
            compile_options,
            workers=self._route(program),
            allow_other_workers=True,
            pure=False,
        )
        return ClusterFuture(remote, self._unwrap)

    def _unwrap(self, value: CompileResult | BaseException) -> CompileResult:
        """A node's CompileResult, counted; raises the program's failure the node returned."""
        if isinstance(value, BaseException):
            raise uncarry(value)
        # From another machine: its key goes into manifests and cache paths.
        check_key(value.spec.key, "the key in a cluster node's result")
        with self._lock:
            self._statistics = self._statistics.add(value.statistics)
        return value

    def compile_many(
        self,
        programs: Iterable[LoweredProgram | tuple[str, LoweredProgram]],
        *,
        timeout: float | None = None,
        progress: bool | Progress | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Compiles programs across the cluster, as Pool.compile_many does across workers."""
        return compile_many(
            self.submit_compile,
            programs,
            timeout=timeout,
            progress=progress,
            return_exceptions=return_exceptions,
        )

    @property
    def statistics(self) -> CompileStatistics:
        """Compile and load time and counts of compile_many and submit_compile, summed."""
        with self._lock:
            return self._statistics

    @property
    def cache_counters(self) -> CacheCounters:
        """Disk cache counters summed over every node's Pool."""
        total = CacheCounters()
        for counters in self.client.run(node_counters).values():
            if counters:
                total = total.add(CacheCounters(**counters))
        return total

    def close(self, cancel_pending: bool = False) -> None:
        """Closes every node's Pool (the client and cluster stay as they are).

        A plugin another ClusterPool on the cluster unregistered (or replaced
        and closed) is gone already: that is not an error.
        """
        with self._lock:
            self._held.clear()
        with contextlib.suppress(ValueError):  # "the worker plugin ... does not exist"
            self.client.unregister_worker_plugin(PLUGIN_NAME)
        if self._run_once:
            with contextlib.suppress(ValueError):
                self.client.unregister_scheduler_plugin(RUN_ONCE_NAME)

    def __enter__(self) -> ClusterPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _arguments(
    inputs: Sequence[Any] | distributed.Future, types: Sequence[ArrayType] | None
) -> Sequence[Any] | distributed.Future:
    """A run's inputs, checked and converted here except where they are Dask futures.

    A future of the whole list, or of one input, is checked on the node
    (by its Pool, with the same errors) once its data is there.
    """
    if isinstance(inputs, distributed.Future):
        return inputs
    if type(inputs) in (list, tuple) and any(isinstance(x, distributed.Future) for x in inputs):
        if types is not None and len(inputs) != len(types):
            prepare_arguments(inputs, types)  # raises the count's TypeError
        return [
            x
            if isinstance(x, distributed.Future)
            else prepare_arguments([x], None if types is None else [types[i]])[0]
            for i, x in enumerate(inputs)
        ]
    return prepare_arguments(inputs, types)


def _bounded(
    submit: Callable[[Sequence[Any]], ClusterFuture],
    batches: Iterable[Sequence[Any]],
    max_in_flight: int,
    return_exceptions: bool,
) -> Iterator[Any]:
    """Yields submit(inputs)'s results in order, at most max_in_flight submitted ahead."""
    pending: collections.deque[ClusterFuture] = collections.deque()

    def take() -> Any:
        future = pending.popleft()
        if not return_exceptions:
            return future.result()
        try:
            return future.result()
        except Exception as error:
            return error

    try:
        for inputs in batches:
            pending.append(submit(inputs))
            if len(pending) >= max_in_flight:
                yield take()
        while pending:
            yield take()
    finally:
        for future in pending:
            future.cancel()
