"""A node's side of a ClusterPool, on any engine: its Pool, and the tasks that use it.

Each node of a ClusterPool holds one NodePool (a Dask worker's PoolPlugin, a
Ray node's actor): a pjrt-pool Pool of PJRT worker processes, started on its
first task (or as its Ray actor is made) and closed with its ClusterPool.
Every task goes through the Pool's public API (run, submit_spec,
submit_compile), so a plugin crash, a hang past the timeout or a
quarantined program fails that task with the Pool's own exception
(WorkerCrashedError, TaskTimeoutError, ProgramQuarantinedError, ...),
carried to the client in a CarriedError (pool.cluster.carried): the
engine's process on the node never loads a plugin, and goes on serving.

A run's outputs are returned as the Pool gives them. Large ones are numpy
views of a shared-memory mapping that the arrays themselves keep alive
(pool.executor.segments: the segment is recycled only once the mapping is
garbage, and a closed Pool leaves live results their memory), so the engine
may hold them, send them without a copy, or spill them, and nothing they
view can go away under them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, TypeVar

import numpy as np

from pool.cluster.carried import CarriedError
from pool.errors import PoolClosedError
from pool.executor.compile_many import CompileCall, CompileResult
from pool.face import Pool
from worker.errors import NeverCompileError
from worker.plugin.runtime import default_platform
from worker.records import LoweredProgram, ProgramSpec

T = TypeVar("T")

Question = Literal["platform", "cache_counters", "remote_counters", "statistics", "worker_info"]
"""What a client asks every node of its Pool (NodePool.answer)."""


class SpecCall(NamedTuple):
    """One run of the executable a ProgramSpec names, as a node's Pool takes it: its
    arguments (checked by the client, or the engine's futures of them), Pool.submit_spec's
    timeout and the bundle (a path every node reads, or a URL) it comes from."""

    spec: ProgramSpec
    arguments: Any
    timeout: float | None
    bundle: str | None


class NodePool:
    """One node's Pool of a ClusterPool (see the module docstring).

    The Pool starts on the first task (pool()), or earlier in a thread of its
    own where the engine says so (start(): a Ray actor, made for its
    ClusterPool alone, starts it as it is made, so the Pool's workers start
    while the client is still lowering and sending; a Dask worker, which may
    serve anything, starts none before a task of this ClusterPool comes).
    close() closes it: a task that still comes fails with PoolClosedError
    instead of starting a Pool that nothing would close. `closed_why` says,
    in that error, why.
    """

    def __init__(self, closed_why: str, **pool_options: Any) -> None:
        self.pool_options = pool_options
        self._closed_why = closed_why
        self._pool: Pool | None = None
        self._start_failed: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()

    def start(self) -> None:
        """Starts the Pool now, in a thread (see the class docstring): tasks that come
        meanwhile wait for it, and the first of them raises what failed the start."""
        threading.Thread(target=self._start, name="pjrt-pool-node-start", daemon=True).start()

    def _start(self) -> None:
        with self._lock:
            if self._closed or self._pool is not None:
                return
            try:
                self._pool = Pool(**self.pool_options)
            except BaseException as error:  # for the first task (pool())
                self._start_failed = error

    def pool(self) -> Pool:
        """This node's Pool, started on first use; PoolClosedError once closed. What failed
        a start begun by start() is raised once, by the first call after it."""
        with self._lock:
            if self._closed:
                raise PoolClosedError(self._closed_why)
            failed, self._start_failed = self._start_failed, None
            if failed is not None:
                raise failed
            if self._pool is None:
                self._pool = Pool(**self.pool_options)
            return self._pool

    @property
    def started(self) -> Pool | None:
        """The Pool if it has started, else None (nothing is started to answer)."""
        return self._pool

    def close(self) -> None:
        """Closes the holder, then its Pool (queued tasks fail with PoolClosedError, running
        ones finish); later tasks fail with PoolClosedError."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(cancel_pending=True)

    def _in_pool(
        self, use: Callable[[Pool], T], carried: type[Exception] = Exception
    ) -> T | CarriedError:
        """use(this node's Pool), or what it (or starting the Pool) raised of the `carried`
        kind, in a CarriedError for the client; other exceptions are raised."""
        try:
            return use(self.pool())
        except carried as error:
            return CarriedError.of(error)

    def run(
        self,
        program: LoweredProgram,
        arguments: Sequence[Any],
        name: str,
        timeout: float | None,
        compile_options: bytes | None,
        keep: tuple[int, ...] = (),
        begins: Callable[[], None] | None = None,
    ) -> list[Any] | CarriedError:
        """Runs a program in the Pool (begins() first, where the engine needs to know);
        its outputs, or every failure (the Pool's start included) carried."""

        def run(pool: Pool) -> list[Any]:
            if begins is not None:
                begins()
            return pool.run(
                program,
                arguments,
                name=name,
                timeout=timeout,
                compile_options=compile_options,
                keep=keep,
            )

        return self._in_pool(run)

    def run_spec(
        self, call: SpecCall, begins: Callable[[], None] | None = None
    ) -> list[np.ndarray] | CarriedError:
        """Runs the executable a ProgramSpec names, from this node's cache (or from the bundle
        at that path or URL), in the Pool."""

        def run(pool: Pool) -> list[np.ndarray]:
            if begins is not None:
                begins()
            spec, arguments, timeout, bundle = call
            return pool.submit_spec(spec, arguments, timeout=timeout, bundle=bundle).result()

        return self._in_pool(run)

    def compile(self, call: CompileCall) -> CompileResult | CarriedError:
        """Compiles in the Pool (for JAX's cache, with call.jax); a program's failure is
        returned, not raised: a compile error or a PJRT worker crash is a value of the
        program (compile_many reports it per program), not a failed task of the engine."""

        def compile_in(pool: Pool) -> CompileResult:
            program, name, timeout, options, jax = call
            return pool.submit_compile(
                program, name=name, timeout=timeout, compile_options=options, jax=jax
            ).result()

        return self._in_pool(compile_in)

    def check(self, call: CompileCall) -> CarriedError | None:
        """For a never-compile ClusterPool: this node's refusal of a program (a
        NeverCompileError, carried), or None when it has the program.

        The Pool loads the program, so its first run finds it loaded; one whose
        cache lacks it refuses in its parent, before any PJRT worker does
        anything. Knowing the key needs the plugin's identity, which only a PJRT
        worker has: the check starts the Pool of the node a run is routed to,
        which that run needs anyway. Any other failure is left to the run, which
        meets it itself.
        """

        def load(pool: Pool) -> None:
            program, name, timeout, options, _ = call  # loaded as it runs: never for JAX
            pool.submit_compile(
                program, name=name, timeout=timeout, compile_options=options
            ).result()

        try:
            return self._in_pool(load, carried=NeverCompileError)
        except Exception:
            return None

    def answer(self, question: Question) -> Any:
        """The node's answer to a client's question (ClusterPoolBase._node_answers): the
        platform its Pool runs (its workers' plugin's once started, else the one it would
        load: PJRT_POOL_PLATFORM, else cpu), its Pool's worker_info, or one of its figures
        as a dict (empty before the Pool started)."""
        pool = self._pool
        if question == "platform":
            return (None if pool is None else pool.platform) or default_platform()
        if question == "worker_info":
            return [] if pool is None else pool.worker_info
        return {} if pool is None else getattr(pool, question)._asdict()
