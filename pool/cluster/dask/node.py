"""What runs on each Dask worker: its NodePool (in a WorkerPlugin) and the tasks that use it.

The node's side is pool.cluster.node_pool's, on any engine: a Pool started on
the first task, every failure carried to the client. Here it is a Dask
WorkerPlugin, registered by each ClusterPool under a name of its own, and the
Dask tasks that find it by that name. A task that raises goes to the client
as the Dask task's error (a CarriedError, raised outside any except clause so
that Dask pickles no __context__).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import distributed
import numpy as np
from distributed.diagnostics.plugin import WorkerPlugin

from pool.cluster.carried import CarriedError
from pool.cluster.dask.run_once import begin_once
from pool.cluster.node_pool import NodePool, Question, SpecCall
from pool.errors import PoolClosedError
from pool.executor.compile_many import CompileCall, CompileResult
from pool.face import Pool
from worker.records import LoweredProgram

PLUGIN_PREFIX = "pjrt-pool-"
"""Each ClusterPool registers its PoolPlugin under this prefix and a uuid of its own, so
that ClusterPools on one cluster (of other options, other users) never share node Pools,
and closing one closes only its own; its tasks name the plugin they run in."""

_CLOSED = (
    "this Dask worker's pjrt-pool plugin is closed (its ClusterPool was closed, or the Dask "
    "worker is closing)"
)


class PoolPlugin(WorkerPlugin):
    """A Dask worker plugin that gives each Dask worker its own NodePool (pool.cluster.node_pool).

    It closes when the Dask worker does, or when the plugin is unregistered
    (ClusterPool.close): a task that still reaches it fails with
    PoolClosedError.
    """

    idempotent = False

    def __init__(self, **pool_options: Any) -> None:
        self.pool_options = pool_options
        self.node = NodePool(_CLOSED, **pool_options)

    def __getstate__(self) -> dict[str, Any]:
        return {"pool_options": self.pool_options}  # sent to workers: no pool, no lock

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state["pool_options"])  # type: ignore[misc]

    async def teardown(self, worker: distributed.Worker) -> None:
        """Closes the NodePool in a thread: Pool.close waits for the running tasks, and the
        Dask worker's event loop (its heartbeats) goes on."""
        await asyncio.get_running_loop().run_in_executor(None, self.node.close)

    def close(self) -> None:
        """Closes the NodePool (see NodePool.close)."""
        self.node.close()

    def pool(self) -> Pool:
        """This Dask worker's Pool, started on first use; PoolClosedError once closed."""
        return self.node.pool()

    @property
    def started(self) -> Pool | None:
        """The Pool if it has started, else None (nothing is started to answer)."""
        return self.node.started


def plugin_of(worker: distributed.Worker, name: str) -> PoolPlugin:
    """The PoolPlugin registered under `name` on a Dask worker; PoolClosedError if none is."""
    plugin = worker.plugins.get(name)
    if not isinstance(plugin, PoolPlugin):
        raise PoolClosedError(
            f"this Dask worker has no pjrt-pool plugin {name!r}: its ClusterPool was closed "
            "(or was never made on this cluster)"
        )
    return plugin


def _node(name: str) -> NodePool | CarriedError:
    """The NodePool of plugin `name` on the Dask worker this task runs on, or why not."""
    try:
        return plugin_of(distributed.get_worker(), name).node
    except PoolClosedError as error:
        return CarriedError.of(error)


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


def run_task(
    plugin: str,
    program: LoweredProgram,
    arguments: Sequence[Any],
    name: str,
    timeout: float | None,
    compile_options: bytes | None,
) -> list[np.ndarray]:
    """Runs a program in this node's Pool of `plugin` and returns its outputs; every
    failure, the Pool's start included, is carried to the client."""
    node = _node(plugin)
    if isinstance(node, CarriedError):
        return _raised(node)
    return _raised(node.run(program, arguments, name, timeout, compile_options, begins=begin_once))


def run_spec_task(plugin: str, call: SpecCall) -> list[np.ndarray]:
    """Runs the executable a ProgramSpec names, from this node's cache (or from the bundle at
    that path or URL), in its Pool."""
    node = _node(plugin)
    if isinstance(node, CarriedError):
        return _raised(node)
    return _raised(node.run_spec(call, begins=begin_once))


def _raised(outputs: list[Any] | CarriedError) -> list[Any]:
    """A run task's outputs, or its failure raised: outside any except clause, so with no
    __context__, which Dask would pickle with tblib."""
    if isinstance(outputs, CarriedError):
        raise outputs
    return outputs


def compile_task(plugin: str, call: CompileCall) -> CompileResult | CarriedError:
    """Compiles in this node's Pool (for JAX's cache, with call.jax); a program's failure is
    returned, not raised (see NodePool.compile)."""
    node = _node(plugin)
    if isinstance(node, CarriedError):
        return node
    return node.compile(call)


def check_task(plugin: str, address: str, call: CompileCall) -> CarriedError | None:
    """For a never-compile ClusterPool: the node's refusal of a program (NodePool.check), or
    None when it has the program or this task ran on a node other than `address` (that
    node's Pool then refuses the runs themselves if need be)."""
    if distributed.get_worker().address != address:
        return None
    node = _node(plugin)
    if isinstance(node, CarriedError):
        return None  # a run meets it itself
    return node.check(call)


async def close_plugin(name: str, dask_worker: distributed.Worker) -> None:
    """Removes and closes this node's PoolPlugin `name`, if it still has one (for client.run,
    where unregistering the plugin did not reach every node)."""
    if isinstance(dask_worker.plugins.get(name), PoolPlugin):
        await dask_worker.plugin_remove(name)


def node_answer(name: str, question: Question, dask_worker: distributed.Worker) -> Any:
    """This node's answer to a question about its Pool of plugin `name` (for client.run; see
    NodePool.answer): a NodePool not registered here answers as one not started."""
    plugin = dask_worker.plugins.get(name)
    if isinstance(plugin, PoolPlugin):
        return plugin.node.answer(question)
    return NodePool(_CLOSED).answer(question)
