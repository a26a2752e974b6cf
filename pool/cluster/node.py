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

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from pool.cluster.futures import CarriedError
from pool.cluster.run_once import begin_once
from pool.executor.compile_many import CompileResult
from pool.executor.pool import Pool
from worker.records import LoweredProgram, ProgramSpec

try:
    import distributed
    from distributed.diagnostics.plugin import WorkerPlugin
except ImportError as missing:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "pool.cluster needs Dask's distributed package: pip install 'pjrt-pool[cluster]'"
    ) from missing

PLUGIN_NAME = "pjrt-pool"


class PoolPlugin(WorkerPlugin):
    """A Dask worker plugin that gives each Dask worker its own pjrt-pool Pool.

    The Pool starts on the first task (not in setup, which runs on the Dask
    worker's event loop) and closes when the Dask worker does, or when the
    plugin is unregistered (ClusterPool.close).
    """

    idempotent = False

    def __init__(self, **pool_options: Any) -> None:
        self.pool_options = pool_options
        self._pool: Pool | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"pool_options": self.pool_options}  # sent to workers: no pool, no lock

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state["pool_options"])  # type: ignore[misc]

    def setup(self, worker: distributed.Worker) -> None:
        """Makes the plugin findable by this Dask worker's tasks."""
        worker.pjrt_pool_plugin = self  # type: ignore[attr-defined]

    def teardown(self, worker: distributed.Worker) -> None:
        """Closes this Dask worker's Pool, stopping what it has queued."""
        with self._lock:
            if self._pool is not None:
                self._pool.close(cancel_pending=True)
                self._pool = None

    def pool(self) -> Pool:
        """This Dask worker's Pool, started on first use."""
        with self._lock:
            if self._pool is None:
                self._pool = Pool(**self.pool_options)
            return self._pool

    @property
    def started(self) -> Pool | None:
        """The Pool if it has started, else None (nothing is started to answer)."""
        return self._pool


def plugin_of(worker: distributed.Worker) -> PoolPlugin:
    """The PoolPlugin of a Dask worker; RuntimeError when no ClusterPool registered one."""
    plugin = getattr(worker, "pjrt_pool_plugin", None)
    if plugin is None:
        raise RuntimeError(
            "this Dask worker has no pjrt-pool plugin: create a ClusterPool on the client first"
        )
    return plugin


def node_pool() -> Pool:
    """The Pool of the Dask worker this task runs on."""
    return plugin_of(distributed.get_worker()).pool()


def hold(program: LoweredProgram) -> LoweredProgram:
    """A task whose value is the program: runs depend on it instead of each carrying the text.

    A node fetches it once and keeps it while its runs need it; being a
    task (not scattered data), it is computed again if every node that held
    it is lost, so runs stay retryable.
    """
    return program


def run_task(
    program: LoweredProgram,
    arguments: Sequence[Any],
    name: str,
    timeout: float | None,
    compile_options: bytes | None,
) -> list[np.ndarray]:
    """Runs a program in this node's Pool and returns its outputs (see the module docstring)."""
    pool = node_pool()
    begin_once()
    try:
        return pool.run(
            program, arguments, name=name, timeout=timeout, compile_options=compile_options
        )
    except Exception as error:
        carried = CarriedError.of(error)
    raise carried  # outside the except: no __context__, which Dask would pickle with tblib


def run_spec_task(
    spec: ProgramSpec, arguments: Sequence[Any], timeout: float | None
) -> list[np.ndarray]:
    """Runs the executable a ProgramSpec names, from this node's cache, in its Pool."""
    pool = node_pool()
    begin_once()
    try:
        return pool.submit_spec(spec, arguments, timeout=timeout).result()
    except Exception as error:
        carried = CarriedError.of(error)
    raise carried  # outside the except (see run_task)


def compile_task(
    program: LoweredProgram, name: str, timeout: float | None, compile_options: bytes | None
) -> CompileResult | CarriedError:
    """Compiles in this node's Pool; a program's failure is returned, not raised.

    Returning the exception keeps a compile error or a PJRT worker crash a
    value of the program (compile_many reports it per program), not a
    failed Dask task.
    """
    try:
        return (
            node_pool()
            .submit_compile(program, name=name, timeout=timeout, compile_options=compile_options)
            .result()
        )
    except Exception as error:
        return CarriedError.of(error)


def node_counters(dask_worker: distributed.Worker) -> dict[str, int]:
    """This node's disk cache counters (for client.run); empty before its Pool started."""
    plugin = getattr(dask_worker, "pjrt_pool_plugin", None)
    pool = None if plugin is None else plugin.started
    return {} if pool is None else pool.cache_counters._asdict()


def node_statistics(dask_worker: distributed.Worker) -> dict[str, float]:
    """This node's compile statistics (for client.run); empty before its Pool started."""
    plugin = getattr(dask_worker, "pjrt_pool_plugin", None)
    pool = None if plugin is None else plugin.started
    return {} if pool is None else pool.statistics._asdict()
