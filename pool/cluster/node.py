"""What runs on each Dask worker: its Pool (a WorkerPlugin) and the tasks that use it.

Every task goes through the node's Pool by its public API (run,
submit_spec, submit_compile), so a plugin crash, a hang past the timeout or
a quarantined program fails that task with the Pool's own exception
(WorkerCrashedError, TaskTimeoutError, ProgramQuarantinedError, ...), which
goes to the client as the task's error, in a CarriedError (see there): the
Dask worker itself never runs a plugin and goes on serving.

A run's outputs are returned to Dask as the Pool gives them. Large ones are
numpy views of a shared-memory mapping that the arrays themselves keep
alive (pool.executor.segments: the segment is recycled only once the
mapping is garbage, and a closed Pool leaves live results their memory), so
Dask may hold them in the worker's memory, send them from there without a
copy, or spill them, and nothing they view can go away under them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import distributed
import numpy as np
from distributed.diagnostics.plugin import WorkerPlugin

from pool.cluster.futures import CarriedError
from pool.cluster.run_once import begin_once
from pool.errors import PoolClosedError
from pool.executor.compile_many import CompileResult
from pool.face import Pool
from worker.errors import NeverCompileError
from worker.plugin.runtime import default_platform
from worker.records import JaxCompile, LoweredProgram, ProgramSpec

T = TypeVar("T")

PLUGIN_PREFIX = "pjrt-pool-"
"""Each ClusterPool registers its PoolPlugin under this prefix and a uuid of its own, so
that ClusterPools on one cluster (of other options, other users) never share node Pools,
and closing one closes only its own; its tasks name the plugin they run in."""

PoolFigure = Literal["cache_counters", "remote_counters", "statistics"]
"""What node_figures reads of a node's Pool."""


class PoolPlugin(WorkerPlugin):
    """A Dask worker plugin that gives each Dask worker its own pjrt-pool Pool.

    The Pool starts on the first task (not in setup, which runs on the Dask
    worker's event loop). It closes when the Dask worker does, or when the
    plugin is unregistered (ClusterPool.close): the plugin is closed from
    then on, and a task that still reaches it fails with PoolClosedError
    instead of starting a Pool that nothing would close.
    """

    idempotent = False

    def __init__(self, **pool_options: Any) -> None:
        self.pool_options = pool_options
        self._pool: Pool | None = None
        self._closed = False
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"pool_options": self.pool_options}  # sent to workers: no pool, no lock

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state["pool_options"])  # type: ignore[misc]

    async def teardown(self, worker: distributed.Worker) -> None:
        """Closes the plugin and this Dask worker's Pool, in a thread: Pool.close waits for
        the running tasks, and the Dask worker's event loop (its heartbeats) goes on."""
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """Closes the plugin, then its Pool (queued tasks fail with PoolClosedError, running
        ones finish); later tasks fail with PoolClosedError."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(cancel_pending=True)

    def pool(self) -> Pool:
        """This Dask worker's Pool, started on first use; PoolClosedError once closed."""
        with self._lock:
            if self._closed:
                raise PoolClosedError(
                    "this Dask worker's pjrt-pool plugin is closed (its ClusterPool was "
                    "closed, or the Dask worker is closing)"
                )
            if self._pool is None:
                self._pool = Pool(**self.pool_options)
            return self._pool

    @property
    def started(self) -> Pool | None:
        """The Pool if it has started, else None (nothing is started to answer)."""
        return self._pool


def plugin_of(worker: distributed.Worker, name: str) -> PoolPlugin:
    """The PoolPlugin registered under `name` on a Dask worker; PoolClosedError if none is."""
    plugin = worker.plugins.get(name)
    if not isinstance(plugin, PoolPlugin):
        raise PoolClosedError(
            f"this Dask worker has no pjrt-pool plugin {name!r}: its ClusterPool was closed "
            "(or was never made on this cluster)"
        )
    return plugin


def node_pool(name: str) -> Pool:
    """The Pool of plugin `name` on the Dask worker this task runs on."""
    return plugin_of(distributed.get_worker(), name).pool()


def program_task(program: LoweredProgram) -> LoweredProgram:
    """A task whose value is the program: runs depend on it instead of each carrying the text.

    A node fetches it once and keeps it while its runs need it; being a
    task (not scattered data), it is computed again if every node that held
    it is lost, so runs stay retryable.
    """
    return program


def _in_node_pool(
    plugin: str, use: Callable[[Pool], T], carried: type[Exception] = Exception
) -> T | CarriedError:
    """use(this node's Pool of `plugin`), or what it (or starting the Pool) raised of the
    `carried` kind, in a CarriedError for the client; other exceptions are raised."""
    try:
        return use(node_pool(plugin))
    except carried as error:
        return CarriedError.of(error)


def run_task(
    plugin: str,
    program: LoweredProgram,
    arguments: Sequence[Any],
    name: str,
    timeout: float | None,
    compile_options: bytes | None,
) -> list[np.ndarray]:
    """Runs a program in this node's Pool of `plugin` and returns its outputs (see the module
    docstring); every failure, the Pool's start included, is carried to the client."""

    def run(pool: Pool) -> list[np.ndarray]:
        begin_once()
        return pool.run(
            program, arguments, name=name, timeout=timeout, compile_options=compile_options
        )

    return _raised(_in_node_pool(plugin, run))


def run_spec_task(
    plugin: str,
    spec: ProgramSpec,
    arguments: Sequence[Any],
    timeout: float | None,
    bundle: str | None = None,
) -> list[np.ndarray]:
    """Runs the executable a ProgramSpec names, from this node's cache (or from the bundle at
    that path or URL), in its Pool."""

    def run(pool: Pool) -> list[np.ndarray]:
        begin_once()
        return pool.submit_spec(spec, arguments, timeout=timeout, bundle=bundle).result()

    return _raised(_in_node_pool(plugin, run))


def _raised(outputs: list[np.ndarray] | CarriedError) -> list[np.ndarray]:
    """A run task's outputs, or its failure raised: outside any except clause, so with no
    __context__, which Dask would pickle with tblib."""
    if isinstance(outputs, CarriedError):
        raise outputs
    return outputs


def compile_task(
    plugin: str,
    program: LoweredProgram,
    name: str,
    timeout: float | None,
    compile_options: bytes | None,
    jax: JaxCompile | None = None,
) -> CompileResult | CarriedError:
    """Compiles in this node's Pool (for JAX's cache, with jax); a program's failure is
    returned, not raised.

    Returning the exception keeps a compile error or a PJRT worker crash a
    value of the program (compile_many reports it per program), not a
    failed Dask task.
    """

    def compile_in(pool: Pool) -> CompileResult:
        return pool.submit_compile(
            program, name=name, timeout=timeout, compile_options=compile_options, jax=jax
        ).result()

    return _in_node_pool(plugin, compile_in)


def check_task(
    plugin: str,
    address: str,
    program: LoweredProgram,
    name: str,
    timeout: float | None,
    compile_options: bytes | None,
) -> CarriedError | None:
    """For a never-compile ClusterPool: the node's refusal of a program (a NeverCompileError,
    carried), or None when it has the program or this task ran on a node other than
    `address` (that node's Pool then refuses the runs themselves if need be).

    The node's Pool loads the program, so its first run finds it loaded; one
    whose cache lacks it refuses in its parent, before any PJRT worker does
    anything. Knowing the key needs the plugin's identity, which only a PJRT
    worker has: the check starts the Pool of the node a run is routed to,
    which that run needs anyway.
    """
    if distributed.get_worker().address != address:
        return None

    def load(pool: Pool) -> None:
        pool.submit_compile(
            program, name=name, timeout=timeout, compile_options=compile_options
        ).result()

    try:
        return _in_node_pool(plugin, load, carried=NeverCompileError)
    except Exception:  # a run meets any other failure itself
        return None


def node_figures(name: str, figures: PoolFigure, dask_worker: distributed.Worker) -> dict[str, Any]:
    """One of a node Pool's figures as a dict (for client.run): its cache counters, remote
    counters or compile statistics; empty before that Pool started."""
    pool = _started(dask_worker, name)
    return {} if pool is None else getattr(pool, figures)._asdict()


def node_platform(name: str, dask_worker: distributed.Worker) -> str:
    """The platform this node's Pool of plugin `name` runs (for client.run): its workers'
    plugin's once it started, else the one it would load (PJRT_POOL_PLATFORM, else cpu)."""
    pool = _started(dask_worker, name)
    return (None if pool is None else pool.platform) or default_platform()


def _started(dask_worker: distributed.Worker, name: str) -> Pool | None:
    """The Pool of plugin `name` on a Dask worker if it has started (nothing is started)."""
    plugin = dask_worker.plugins.get(name)
    return plugin.started if isinstance(plugin, PoolPlugin) else None
