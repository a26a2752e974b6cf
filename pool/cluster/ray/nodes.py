"""A RayClusterPool's nodes: which run, which compile, which hold TPU chips; their actors.

Every alive node of the Ray cluster that has CPUs or TPU chips gets one
NodeActor of this RayClusterPool, pinned to it (NodeAffinitySchedulingStrategy,
not soft), taking no CPU of Ray's (it runs nothing itself: its Pool's
workers do). What a node does follows from its resources and the pool's
platform:

    platform "tpu"   a node with TPU chips (Ray's "TPU" resource) is a TPU host:
                     its actor asks Ray for all of them (so no other job gets
                     them while it lives), and its Pool holds them (one device
                     worker per chip, beside its compile workers:
                     pool.executor.roles); runs go to TPU hosts.
                     A node with CPUs alone compiles for the TPU hosts'
                     topology without a chip (Pool(topology=...)): the pool's
                     topology option, else what a TPU host says its own is.
                     Compiles go to those nodes when there are any, else to
                     the TPU hosts' own compile workers.
    other platforms  every node with CPUs compiles and runs.

A head started with no CPUs (ray start --head --num-cpus=0) hosts none.
Nodes are listed again when routing asks (at most every second,
pool.cluster.routing): a node that joined gets its actor then. A node whose
actor died (its node lost, or the actor killed) is dropped at once, its
values lost, and gets no new actor for LOST_COOLDOWN_SECONDS (Ray may take
that long to mark a lost node dead), then one if it is still alive.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pool.cluster.ray.actor import CONTROL, NodeActor, NodeFacts
from pool.errors import WorkerStartupError
from pool.executor.worker_memory import WorkerMemory
from worker.plugin.topology import TopologySpec

LOST_COOLDOWN_SECONDS = 30.0
"""How long a node whose actor died gets no new one (see the module docstring)."""

LOST = "was lost with its Ray node"
"""How a lost node's values are said to be lost (WorkerMemory.lose: "the worker (pid P) that
held N value(s) was lost with its Ray node, and they are lost: ...")."""

CLOSE_SECONDS = 120.0
"""How long closing waits for the nodes' Pools to close before their actors are killed."""

_ACTOR = ray.remote(concurrency_groups={CONTROL: 4})(NodeActor)


class Role(enum.Enum):
    """What a node does for a RayClusterPool (see the module docstring)."""

    RUN = "compiles and runs"
    COMPILE = "compiles for the TPU hosts' topology, without a chip"
    TPU_HOST = "holds its TPU chips and runs (compiling where no node compiles for it)"


class _NoSegments:
    """A node's WorkerMemory mirror sends no segments (WorkerMemory.pending asks)."""

    closings = 0

    def is_open(self, segment_id: int) -> bool:
        return True


NO_SEGMENTS = _NoSegments()


@dataclass(eq=False)
class Node:
    """A node's actor, as this RayClusterPool knows it: its role, the facts it gave as it
    started (a Ray ObjectRef until read), and the client's mirror of the values it keeps
    (memory: its pid is the actor's), changed under lock."""

    node_id: str
    role: Role
    actor: Any
    facts_ref: Any
    concurrency: int
    memory: WorkerMemory = field(default_factory=lambda: WorkerMemory(0))
    lock: threading.Lock = field(default_factory=threading.Lock)
    facts: NodeFacts | None = None


class Nodes:
    """This RayClusterPool's actors, one per node (see the module docstring).

    options are the nodes' Pool options (checked); workers is their workers
    option (None: each node's CPU count), which sets each actor's threads.
    """

    def __init__(self, options: dict[str, Any], on_lost: Callable[[str], None]) -> None:
        self._options = options
        self._tpu = options["platform"] == "tpu"
        self._on_lost = on_lost
        self._nodes: dict[str, Node] = {}
        self._lost_at: dict[str, float] = {}
        self._topology: TopologySpec | None = options["topology"]
        self._closed = False
        self._lock = threading.Lock()

    def refresh(self) -> None:
        """Lists the cluster's nodes, and starts an actor on each new one that has a role."""
        alive = [n for n in ray.nodes() if n.get("Alive")]
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return
            for gone in set(self._nodes) - {n["NodeID"] for n in alive}:
                self._drop_locked(gone, LOST, now)
            for info in sorted(alive, key=lambda n: n["NodeID"]):
                node_id = info["NodeID"]
                if node_id in self._nodes or now - self._lost_at.get(node_id, -1e9) < (
                    LOST_COOLDOWN_SECONDS
                ):
                    continue
                started = self._start_locked(node_id, info.get("Resources", {}))
                if started is not None:
                    self._nodes[node_id] = started

    def _start_locked(self, node_id: str, resources: dict[str, float]) -> Node | None:
        chips = int(resources.get("TPU", 0))
        cpus = int(resources.get("CPU", 0))
        options = dict(self._options)
        extra: dict[str, Any] = {}
        if self._tpu and chips:
            role = Role.TPU_HOST
            options["topology"] = None  # its Pool holds the chips; it compiles for them too
            extra["resources"] = {"TPU": chips}
        elif self._tpu and cpus and self._topology is not None:
            role, options["topology"] = Role.COMPILE, self._topology
        elif not self._tpu and cpus:
            role = Role.RUN
        else:
            return None
        concurrency = max(4, 4 * (options["workers"] or cpus or 1))
        actor = _ACTOR.options(
            num_cpus=0,
            max_concurrency=concurrency,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            **extra,
        ).remote(options, chips if role is Role.TPU_HOST else 0)
        return Node(node_id, role, actor, actor.facts.remote(), concurrency)

    def await_started(self, timeout: float | None) -> None:
        """Waits for every actor to start (its facts); a TPU host's tells the topology the
        CPU nodes compile for, when the pool was given none. Raises WorkerStartupError for
        an actor that did not start in time (its resources held by another job, say)."""
        with self._lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            try:
                node.facts = ray.get(node.facts_ref, timeout=timeout)
            except ray.exceptions.GetTimeoutError:
                raise WorkerStartupError(
                    f"the pjrt-pool actor of Ray node {node.node_id} ({node.role.value}) did not "
                    f"start in {timeout:g} s: Ray has not placed it (are the node's resources, "
                    "its TPU chips say, held by another job?); start_timeout bounds this wait"
                ) from None
            except ray.exceptions.RayActorError as error:
                self.lost(node.node_id, node, "died as it started")
                raise WorkerStartupError(
                    f"the pjrt-pool actor of Ray node {node.node_id} died as it started: {error}"
                ) from None
            node.memory.pid = node.facts.pid
        if self._tpu and self._topology is None:
            named = [n.facts.host_topology for n in nodes if n.facts and n.facts.host_topology]
            if named:
                with self._lock:
                    self._topology = named[0]
                self.refresh()  # the CPU nodes compile for it from now on
                self.await_started(timeout)

    def get(self, address: str) -> Node | None:
        """The node's actor, or None when it has none now (lost, or never had a role)."""
        with self._lock:
            return self._nodes.get(address)

    def addresses(self, *roles: Role) -> list[str]:
        """The nodes of these roles, sorted (stable while they are: pool.cluster.routing)."""
        with self._lock:
            return sorted(a for a, node in self._nodes.items() if node.role in roles)

    def all(self) -> list[Node]:
        """Every node's actor."""
        with self._lock:
            return list(self._nodes.values())

    def lost(self, address: str, node: Node | None, how: str) -> None:
        """A node's actor died (`how`, as a lost value's error says it): dropped, its values
        lost, no new one there for LOST_COOLDOWN_SECONDS. A node already dropped, or whose
        actor is another by now, is left as it is."""
        with self._lock:
            if node is not None and self._nodes.get(address) is not node:
                return
            self._drop_locked(address, how, time.monotonic())

    def _drop_locked(self, address: str, how: str, now: float) -> None:
        node = self._nodes.pop(address, None)
        if node is None:
            return
        self._lost_at[address] = now
        with node.lock:
            node.memory.lose(how)
        with contextlib.suppress(Exception):
            ray.kill(node.actor)  # an actor that is unreachable but alive goes too
        self._on_lost(address)

    def close(self) -> None:
        """Closes every actor's Pool (those running finish; bounded by CLOSE_SECONDS), then
        ends the actors. Later refreshes start nothing."""
        with self._lock:
            self._closed = True
            nodes, self._nodes = list(self._nodes.values()), {}
        closing = [node.actor.close.remote() for node in nodes]
        deadline = time.monotonic() + CLOSE_SECONDS  # for all of them: they close at once
        for ref in closing:
            with contextlib.suppress(Exception):  # a node lost meanwhile: nothing to close
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        for node in nodes:
            with contextlib.suppress(Exception):
                ray.kill(node.actor)
