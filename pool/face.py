"""The face of a pool: what a Pool and a ClusterPool both offer, written once; and Pool.

    PoolFace        submit_compile, compile, compile_many, map, function and the with
      │             block, written once here on the primitives below, which each pool
      │             implements
      ├─ Pool         (this module) the Pool users import: pool.executor's WorkerPool,
      │               worker processes on this machine, behind the face
      └─ ClusterPoolBase  (pool.cluster.core) a Pool on each node of a cluster: ClusterPool
                          on Dask's workers, RayClusterPool in an actor on each Ray node

The primitives: submit, run and submit_spec (a run of a program, or of the
executable a ProgramSpec names), _submit_compile (submit_compile's work),
close and the end of a with block; the figures platform, statistics, cache_counters and
remote_counters; and, for the methods written here, _check_open (the
pool's refusal once it is closed) and _parallelism (how many runs it runs
at once). _refuse_in_child and _refuse_on_manager refuse a call where the
pool cannot serve it (a Pool in a forked child, or a wait on its manager
thread); they refuse nothing unless a pool says otherwise.

What each worker of a Pool is for (compiling, running on a device, or both:
pool.executor.roles) stays behind the face: a TPU host's compile workers and
device workers take the same calls, and Pool.worker_info says each one's
role.

Importing this module imports no JAX: function imports pool.lowering.function
(and JAX, about a second) when it is called.
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Self

from pool.errors import PoolClosedError
from pool.executor.compile_many import CompileCall, CompileResult, Progress, compile_many
from pool.executor.options import document
from pool.executor.pool import WorkerPool
from worker.records import CompileStatistics, JaxCompile, LoweredProgram, ProgramSpec

if TYPE_CHECKING:
    import numpy as np

    from pool.lowering.function import PoolFunction
    from worker.cache import CacheCounters
    from worker.cache.remote import RemoteCounters


class PoolFace(abc.ABC):
    """What a Pool and a ClusterPool both offer: runs, compiles, map, function, with blocks.

    Its methods submit_compile, compile, compile_many, map and function, and
    entering a with block, are written once, here, on primitives each pool
    implements (see the module docstring). A function that takes a PoolFace
    takes either pool.
    """

    _keeps_values = False
    """Whether its runs can keep outputs in a worker (keep=): a Pool's can."""

    # -- the primitives each pool implements -------------------------------------------

    @abc.abstractmethod
    def submit(self, program: LoweredProgram, inputs: Any, /, **options: Any) -> Future[Any]:
        """Runs a program (compiling or loading it first); returns a Future of its outputs."""

    @abc.abstractmethod
    def run(self, program: LoweredProgram, inputs: Any, /, **options: Any) -> list[np.ndarray]:
        """Runs a program (compiling or loading it first) and returns its outputs."""

    @abc.abstractmethod
    def submit_spec(self, spec: ProgramSpec, inputs: Any, /, **options: Any) -> Future[Any]:
        """Runs the executable a ProgramSpec names (by its cache key); returns a Future."""

    @abc.abstractmethod
    def _submit_compile(self, call: CompileCall) -> Future[CompileResult]:
        """submit_compile's work, as this pool does it (the program is what the caller gave,
        unchecked)."""

    @abc.abstractmethod
    def close(self, cancel_pending: bool = False) -> None:
        """Waits for the tasks submitted (with cancel_pending, fails those not begun), then
        stops the pool; calling it again does nothing."""

    @abc.abstractmethod
    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        """Leaving the with block stops the pool (each pool says how)."""

    @property
    @abc.abstractmethod
    def platform(self) -> str | None:
        """The platform whose plugin runs the programs ("cpu", "cuda", "tpu", ...)."""

    @property
    @abc.abstractmethod
    def statistics(self) -> CompileStatistics:
        """Compile and load time and counts, summed."""

    @property
    @abc.abstractmethod
    def cache_counters(self) -> CacheCounters:
        """Disk cache hits, misses, repairs and evictions, summed over the workers."""

    @property
    @abc.abstractmethod
    def remote_counters(self) -> RemoteCounters:
        """The remote cache tier's counters, summed over the workers."""

    @abc.abstractmethod
    def _check_open(self) -> None:
        """Raises PoolClosedError (or what broke the pool) once the pool takes no tasks."""

    @abc.abstractmethod
    def _parallelism(self) -> int:
        """How many runs the pool runs at once (map keeps four times as many in flight)."""

    def _refuse_in_child(self) -> None:
        """Raises where this process cannot use the pool (a Pool in a forked child)."""
        return  # by default nowhere (a ClusterPool)

    def _refuse_on_manager(self, what: str) -> None:
        """Raises where a call that waits for tasks would never return (a Pool's manager
        thread, in a Future's done-callback); `what` names the call."""
        return  # by default nowhere (a ClusterPool)

    # -- written once ---------------------------------------------------------------

    def submit_compile(
        self,
        program: LoweredProgram,
        *,
        name: str | None = None,
        timeout: float | None = None,
        compile_options: bytes | None = None,
        jax: JaxCompile | None = None,
    ) -> Future[CompileResult]:
        """Compiles (or loads) a program in a worker; the Future's result is a CompileResult.

        A program's own failure (a compile error, a worker crash, a timeout)
        is the Future's exception. compile_options replaces the default
        serialized CompileOptionsProto (one replica, one partition); it is
        part of the program's identity, so the spec's key is the one
        compile_program gives for these options, and runs with other options
        use their own executable. The plugin checks it: malformed options can
        make the plugin abort, which fails only this task. A ClusterPool
        compiles each program on the node its hash picks, so that nodes with
        caches of their own still compile it once. With jax (pool.jax_cache makes it), the
        program is compiled for JAX's own persistent cache instead, in the form JAX keeps,
        and filed under JAX's key in the disk cache and remote tier; the result's spec
        names that entry (its key) and carries no types.
        """
        return self._submit_compile(CompileCall(program, name, timeout, compile_options, jax))

    def compile(
        self, program: LoweredProgram, *, name: str | None = None, timeout: float | None = None
    ) -> ProgramSpec:
        """Compiles (or loads) a program in a worker and returns its ProgramSpec.

        It waits for submit_compile's CompileResult, and raises what failed
        the compile.
        """
        self._refuse_on_manager(f"{type(self).__name__}.compile")
        return self.submit_compile(program, name=name, timeout=timeout).result().spec

    def compile_many(
        self,
        programs: Iterable[LoweredProgram | tuple[str, LoweredProgram]],
        *,
        timeout: float | None = None,
        progress: bool | Progress | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Compiles programs in parallel across the workers; returns their ProgramSpecs in order.

        programs are LoweredPrograms or (name, LoweredProgram) pairs. With
        return_exceptions, a program that failed has its exception in its
        place (one the pool refused, or that a stop of the pool failed, too:
        the programs compiled before keep their specs); otherwise the first
        failure (in order) is raised after all have finished. progress=True
        shows progress on stderr (a live bar on a terminal, a line per program
        otherwise); a callable gets (done, total, spec or exception) as each
        finishes. A ClusterPool compiles across its nodes, each program on
        the node its hash picks.
        """
        self._refuse_in_child()
        self._refuse_on_manager("compile_many")
        return compile_many(
            self.submit_compile,
            programs,
            timeout=timeout,
            progress=progress,
            return_exceptions=return_exceptions,
        )

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
        (default: four per worker that runs programs; a ClusterPool's, four
        per thread of its cluster) ahead of the one it waits for, so a long
        or endless iterable of batches never floods the pool nor this
        process's memory. A run's failure, or a batch's refusal at submit
        (bad inputs, say), raises when its turn comes (with
        return_exceptions, the exception is yielded in its place and the
        runs go on); leaving the iterator early cancels the runs not yet
        done. A closed pool raises PoolClosedError, here or, closed
        meanwhile, in the iteration. name, timeout and compile_options are
        as for submit (a ProgramSpec's run takes timeout alone, as
        submit_spec does).
        """
        self._refuse_in_child()
        self._refuse_on_manager(f"{type(self).__name__}.map")
        self._check_open()
        if max_in_flight is None:
            max_in_flight = 4 * max(1, self._parallelism())
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be a positive int, not {max_in_flight!r}")
        if isinstance(program, ProgramSpec):
            spec = program

            def submit(inputs: Sequence[Any]) -> Future[Any]:
                return self.submit_spec(spec, inputs, timeout=timeout)
        else:

            def submit(inputs: Sequence[Any]) -> Future[Any]:
                return self.submit(
                    program, inputs, name=name, timeout=timeout, compile_options=compile_options
                )

        return _results_in_order(submit, batches, max_in_flight, return_exceptions)

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
        in_shardings: Any = None,
        out_shardings: Any = None,
        keep: int | Sequence[int] | bool = (),
    ) -> PoolFunction:
        """Returns function as a callable that runs in this pool's workers, like jax.jit(function).

        Calling it lowers the function in this process once per signature (the
        arguments' tree structure, shapes, dtypes and weak types, the static
        arguments' types and values, and JAX's trace context: the config that
        changes programs, such as jax_enable_x64, numpy_rank_promotion and
        threefry_partitionable, as jax.jit caches), then runs the program with
        the pool's run: a worker compiles it or loads it from the disk cache. It
        returns the result in the structure jax.jit(function)(*args) returns,
        with numpy arrays as leaves; typed PRNG keys come back as keys and
        float0 results as float0 arrays. Arguments are pytrees of numpy
        arrays, JAX arrays, Python scalars (weakly typed, as in jax.jit) and
        typed keys. static_argnums, static_argnames and custom_calls mean what
        they mean for jax.jit and lower (a static argument a call leaves out
        takes the function's default; other keyword arguments are dynamic);
        platform is the one to lower for (default: that of this pool's
        plugin; a ClusterPool's nodes', see its platform); name names the
        tasks (default: the program's name). Its submit method returns a
        Future of the result (a ClusterPool's is fetched and rebuilt in the
        thread that reads it) and its lower method the LoweredProgram a call
        runs. Crash isolation, timeouts and quarantine are those of submit.
        It runs in another process, so it cannot be traced: jax.grad,
        jax.vmap or jax.jit of it raise TypeError (make the PoolFunction of
        the transformed function instead). Called with tracers while a
        PoolFunction (or lower) is lowering, it traces into its function as
        a nested jax.jit does, so that the outer program runs it.

        keep makes parts of the result stay in the worker instead of coming
        back: True keeps all of it, an int or a sequence of them the elements
        of the result's tuple at those positions. Each kept array comes back as
        a DeviceValue (pool.executor.values) that later calls take in place of
        the array, and they run on the worker that holds it: a training step
        `step = pool.function(train_step, keep=0)` returning (params, loss)
        gives params as values, which the next call takes as they are, so the
        parameters never leave the worker between steps (np.asarray or fetch()
        copies them out). A Pool's, and a RayClusterPool's (each node's actor keeps
        them): a Dask ClusterPool refuses it. A call whose result is kept whole
        (keep=True) returns once its request is sent, as jax.jit returns once it
        dispatched (dispatch_ahead): an error of that run is raised where its values
        are next used.

        donate_argnums is accepted and ignored, with a warning: arguments are copied into
        shared memory for the worker, so donated arrays stay valid and no memory is saved.
        in_shardings and out_shardings are as jax.jit takes them (a sharding, or a pytree
        prefix of the dynamic positional arguments and of the result): the program runs over
        the devices of their mesh, as does a function that is a jax.jit with shardings, or a
        shard_map, or is called with arrays placed on a mesh (its shardings are kept). It
        still takes and returns whole arrays; each worker needs that many devices (Pool's
        devices_per_worker). See docs/sharding.md.
        """
        # Here: it imports JAX (a second), which a pool running warmed programs never needs.
        from pool.lowering.function import PoolFunction

        self._refuse_in_child()
        if keep is not False and not _no_keep(keep) and not self._keeps_values:
            raise TypeError(
                f"{type(self).__name__}.function takes no keep=: its tasks run on whichever "
                "node is free, so no value stays between calls; use a Pool, or a RayClusterPool"
            )
        return PoolFunction(self, function, static_argnums=static_argnums,
                            static_argnames=static_argnames, donate_argnums=donate_argnums,
                            platform=platform, custom_calls=custom_calls, name=name,
                            in_shardings=in_shardings, out_shardings=out_shardings,
                            keep=keep)  # fmt: skip

    def __enter__(self) -> Self:
        self._refuse_in_child()
        return self


def _results_in_order(
    submit: Callable[[Sequence[Any]], Future[Any]],
    batches: Iterable[Sequence[Any]],
    max_in_flight: int,
    return_exceptions: bool,
) -> Iterator[Any]:
    """Yields submit(inputs)'s results in order, at most max_in_flight submitted ahead.

    A batch that submit refuses (bad inputs, a never-compile refusal) fails
    in its place, as a failed run does; a closed pool raises.
    """
    pending: collections.deque[Future[Any]] = collections.deque()

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
            try:
                pending.append(submit(inputs))
            except PoolClosedError:
                raise
            except Exception as error:
                refused: Future[Any] = Future()
                refused.set_exception(error)
                pending.append(refused)
            if len(pending) >= max_in_flight:
                yield take()
        while pending:
            yield take()
    finally:
        for future in pending:
            future.cancel()


class Pool(WorkerPool, PoolFace):
    # The docstring's options section is made of the options' declarations
    # (pool.executor.options), so that it says what the signature takes.
    __doc__ = "\n\n".join(
        (
            """Worker processes that compile and run LoweredPrograms, each with its own plugin.

The constructor returns once every worker it waits for has started: loaded its
plugin, run the initializer and preloaded what preload names. A pool with compile
workers does not wait for its device workers (pool.executor.roles.start_awaits):
they start beside it, and runs wait for them in the queue.""",
            document(),
            """Submission is thread-safe. The pool is a context manager; close() waits
for submitted tasks and stops the workers, and may be called twice.
Futures' done-callbacks run on the pool's manager thread: they may
submit, but not wait (run, compile, compile_many and map raise there); one
that raises is logged and the pool goes on. A process forked from this
one cannot use the pool (PoolForkedError). A Pool is not picklable.
What it shares with a ClusterPool (submit_compile, compile, compile_many,
map, function) is PoolFace's; the options are declared in
pool.executor.options.""",
            """Large arrays move at memory speed: a worker maps each shared-memory
segment once and the pool reuses segments (so their pages fault in once), the
plugin reads inputs where they are and writes outputs into shared memory, and
results view it. empty() and asarray() make arrays in that memory, which calls
pass without a copy; put() and keep= leave arrays on a worker's device
(DeviceValue), for later calls to take there.""",
        )
    )

    _keeps_values = True


def _no_keep(keep: Any) -> bool:
    """Whether keep= asks to keep nothing: an empty sequence ([] and () alike)."""
    return isinstance(keep, (tuple, list)) and not keep
