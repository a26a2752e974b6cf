"""What runs on each Ray node: its NodeActor, owning the node's Pool (a NodePool).

A RayClusterPool starts one NodeActor per node (pool.cluster.ray.nodes), a
threaded Ray actor: each call runs in one of its threads, through the
node's Pool (pool.cluster.node_pool: started as the actor is made, every
failure carried to the client), so a plugin crash fails that call with the
Pool's exception and the actor goes on serving. Calls that must not wait
behind runs (its facts, the figures, fetching a value, closing) have a
concurrency group of their own.

The actor also holds the values runs kept on its node (keep=): DeviceValues
of its Pool, by ids of its own (pool.cluster.ray.values), until the client
drops them. The node's Pool lets go of a value when the actor does.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import ray

from pool.cluster.carried import CarriedError
from pool.cluster.node_pool import NodePool, Question, SpecCall
from pool.cluster.ray.values import Held, KeptOnNode
from pool.executor.compile_many import CompileCall, CompileResult
from pool.executor.values import DeviceValue
from worker.plugin.platforms.registry import platform_named
from worker.plugin.runtime import default_platform
from worker.plugin.topology import TopologySpec
from worker.records import LoweredProgram

CONTROL = "control"
"""The concurrency group of the calls that must not wait behind runs."""

_CLOSED = "this Ray node's pjrt-pool actor is closed (its RayClusterPool was closed)"


class NodeFacts(NamedTuple):
    """What a node's actor says of itself as it starts."""

    node_id: str
    pid: int
    platform: str
    host_topology: TopologySpec | None
    """A TPU host's topology, to compile for on the nodes without chips (None elsewhere)."""


class NodeActor:
    """One node's Pool of a RayClusterPool, and the values kept there (see the module
    docstring). pool_options are the Pool's; tpu_chips, for a TPU host's actor, the chips
    Ray gave it (its TPU resource), which its Pool's device workers hold."""

    def __init__(self, pool_options: dict[str, Any], tpu_chips: int = 0) -> None:
        self._node = NodePool(_CLOSED, **pool_options)
        # Made for one RayClusterPool, whose calls are on their way: its Pool starts now,
        # while the client waits for the actors and lowers (NodePool.start).
        self._node.start()
        self._tpu_chips = tpu_chips
        self._values: dict[int, DeviceValue] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @ray.method(concurrency_group=CONTROL)
    def facts(self) -> NodeFacts:
        """This node's id, the actor's pid, the platform its Pool runs, and a TPU host's
        topology."""
        topology = None
        if self._tpu_chips:
            topology = platform_named("tpu").host_topology(self._tpu_chips)
        platform = self._node.pool_options.get("platform") or default_platform()
        return NodeFacts(ray.get_runtime_context().get_node_id(), os.getpid(), platform, topology)

    def run(
        self,
        program: LoweredProgram,
        arguments: Any,
        name: str,
        timeout: float | None,
        compile_options: bytes | None,
        keep: tuple[int, ...],
        drops: Sequence[int],
    ) -> list[Any] | CarriedError:
        """Runs a program in the node's Pool: its outputs (kept ones as KeptOnNode), or its
        failure carried. drops are values the client let go of."""
        self._drop(drops)
        arguments = self._arguments(arguments)
        if isinstance(arguments, CarriedError):
            return arguments
        outputs = self._node.run(program, arguments, name, timeout, compile_options, keep)
        if isinstance(outputs, CarriedError) or not keep:
            return outputs
        return [self._kept(o) if type(o) is DeviceValue else o for o in outputs]

    def run_spec(self, call: SpecCall) -> list[np.ndarray] | CarriedError:
        """Runs the executable a ProgramSpec names in the node's Pool."""
        arguments = self._arguments(call.arguments)
        if isinstance(arguments, CarriedError):
            return arguments
        return self._node.run_spec(call._replace(arguments=arguments))

    def compile(self, call: CompileCall) -> CompileResult | CarriedError:
        """Compiles in the node's Pool (NodePool.compile)."""
        return self._node.compile(call)

    def check(self, call: CompileCall) -> CarriedError | None:
        """A never-compile ClusterPool's check (NodePool.check)."""
        return self._node.check(call)

    @ray.method(concurrency_group=CONTROL)
    def answer(self, question: Question) -> Any:
        """The node's answer about its Pool (NodePool.answer)."""
        return self._node.answer(question)

    @ray.method(concurrency_group=CONTROL)
    def fetch(self, value_id: int, drops: Sequence[int]) -> np.ndarray | CarriedError:
        """A kept value's array, copied out of its worker."""
        self._drop(drops)
        try:
            return self._held(value_id).fetch()
        except Exception as error:
            return CarriedError.of(error)

    @ray.method(concurrency_group=CONTROL)
    def close(self) -> None:
        """Closes the node's Pool (those running finish first); later calls are refused."""
        with self._lock:
            self._values.clear()
        self._node.close()

    def _arguments(self, arguments: Any) -> Any:
        """A call's arguments as the Pool takes them: held values as the node's DeviceValues,
        and data on the cluster (ObjectRefs in the list, which Ray does not resolve) fetched.
        A whole list given as another run's ObjectRef that failed is that failure."""
        if isinstance(arguments, CarriedError) or type(arguments) not in (list, tuple):
            return arguments
        try:
            return [
                self._held(x.id)
                if type(x) is Held
                else ray.get(x)
                if isinstance(x, ray.ObjectRef)
                else x
                for x in arguments
            ]
        except Exception as error:
            return CarriedError.of(error)

    def _held(self, value_id: int) -> DeviceValue:
        with self._lock:
            value = self._values.get(value_id)
        if value is None:
            raise ValueError(
                f"this node holds no value {value_id}: its handle was dropped, or it was kept "
                "by an actor of this node before this one (which was lost with its values)"
            )
        return value

    def _kept(self, value: DeviceValue) -> KeptOnNode:
        with self._lock:
            value_id = next(self._ids)
            self._values[value_id] = value
        return KeptOnNode(value_id, value.array_type, value.nbytes)

    def _drop(self, drops: Sequence[int]) -> None:
        if drops:
            with self._lock:
                for value_id in drops:
                    self._values.pop(value_id, None)
