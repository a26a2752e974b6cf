"""RayClusterPool: a Pool per Ray node, in an actor, behind the face of a Pool.

What every engine shares (checks, routing, figures, closing, compile
statistics) is ClusterPoolBase's (pool.cluster.core); this module sends its
calls to the nodes' actors (pool.cluster.ray.nodes, .actor) and follows them
(pool.cluster.ray.futures), sending a call whose node was lost to another.
Inputs and outputs travel as the calls' arguments and results (Ray puts
large arrays in its object store); an ObjectRef (of one array, or of the
whole list of inputs, such as another run's object_ref) is fetched by the
node from wherever it is.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import ray

from pool.cluster.carried import CarriedError, NodeLostError, original_error
from pool.cluster.core import ClusterPoolBase, RunCall
from pool.cluster.node_pool import SpecCall
from pool.cluster.options import cluster_signature, documented
from pool.cluster.ray.futures import RayFuture
from pool.cluster.ray.nodes import LOST, NO_SEGMENTS, Node, Nodes, Role
from pool.cluster.ray.values import Held, KeptOnNode
from pool.errors import PoolClosedError
from pool.executor.compile_many import CompileCall
from pool.executor.values import DeviceValue
from pool.executor.worker_memory import WorkerMemory
from worker.records import LoweredProgram

ALLOWED_LOSSES = 3
"""How many times a call is sent again after its node was lost, before it fails with
NodeLostError (as Dask's scheduler allows a task three failures by default)."""


class RayClusterPool(ClusterPoolBase):
    __doc__ = documented(
        """Compiles and runs programs on a Ray cluster, a Pool per node in an actor, as Pool does.

It takes the calls a Pool takes (PoolFace: run, submit, submit_spec,
submit_compile, compile, compile_many, map, function, close, the with
block, the statistics and counters) and every Pool option (below), checked
here with Pool's errors and applied on every node's Pool. It runs on the
Ray cluster this process is connected to (ray.init(address=...), or
pool.cluster.connect_ray); each node gets one NodeActor
(pool.cluster.ray.nodes), which owns the node's Pool.""",
        """Of those: workers_per_node defaults to each node's CPU count;
with platform "tpu", nodes that have TPU chips (Ray's TPU resource) are
TPU hosts, whose actors ask Ray for all their chips and run, and nodes with
CPUs alone compile for the TPU hosts' topology (topology, else the one a
TPU host says it has) without a chip; never_compile refuses at submit a
program its home node's cache lacks, as on Dask.

Runs may keep outputs on their node (keep=, and Pool.function's keep=):
they stay in the node's actor as DeviceValues, which later calls take (and
run on that node); a node lost with them makes every use raise the
WorkerCrashedError a Pool raises when the worker holding a value dies.

A call whose node is lost (its actor died) is sent to another node, up to
ALLOWED_LOSSES times, and its future settles once; retry_lost=False fails
it with NodeLostError instead. A call that takes kept values is not sent
elsewhere: it fails with their loss. spread_at is as for ClusterPool
(default: twice a node's CPUs).""",
    )

    _engine = "Ray"
    _keeps_values = True

    def __init__(
        self,
        *,
        retry_lost: bool = True,
        spread_at: int | None = None,
        **pool_options: Any,
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError(
                "RayClusterPool runs on the Ray cluster this process is connected to: call "
                "ray.init(address=...) first (or use pool.cluster.connect_ray(address))"
            )
        threads = max(
            (int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"]), default=1
        )
        super().__init__(pool_options, retry_lost, spread_at, threads)
        self._nodes = Nodes(self._options, self._router.forget)
        self._nodes.refresh()
        try:
            self._nodes.await_started(self._options["start_timeout"])
        except BaseException:
            self._nodes.close()
            raise

    __init__.__signature__ = cluster_signature([])  # type: ignore[attr-defined]

    # -- the engine ------------------------------------------------------------------------

    def _run_addresses(self) -> list[str]:
        self._nodes.refresh()
        return self._nodes.addresses(Role.RUN, Role.TPU_HOST)

    def _compile_addresses(self) -> list[str]:
        try:
            run = self._router.addresses()  # the nodes listed again when the listing is old
        except RuntimeError:  # no node runs: a TPU pool without TPU hosts compiles only
            run = []
        compilers = self._nodes.addresses(Role.COMPILE) or run
        if not compilers:
            raise RuntimeError(
                "no node of the Ray cluster compiles for this pool: it has no node with CPUs "
                "(nor, for platform 'tpu', a TPU host, or a topology to compile for)"
            )
        return compilers

    def _is_cluster_data(self, value: Any) -> bool:
        return isinstance(value, ray.ObjectRef)

    def _parallelism(self) -> int:
        """How many runs the cluster runs at once: its nodes' PJRT workers."""
        workers = self._options["workers"]
        return sum(workers or max(1, n.concurrency // 4) for n in self._nodes.all()) or 1

    def _node(self, address: str) -> Node:
        node = self._nodes.get(address)
        if node is None:
            raise NodeLostError(f"Ray node {address} has no pjrt-pool actor any longer")
        return node

    def _send_run(self, address: str, call: RunCall) -> RayFuture:
        listed = call.arguments if type(call.arguments) is list else []
        held = [x._memory for x in listed if type(x) is DeviceValue]
        pinned = bool(held)

        def send(address: str) -> ray.ObjectRef:
            node = self._node(address)
            arguments = call.arguments
            if pinned:
                arguments = [Held(x.id) if type(x) is DeviceValue else x for x in arguments]
            with node.lock:
                deliveries = node.memory.pending(NO_SEGMENTS)
                ref = node.actor.run.remote(
                    call.program,
                    arguments,
                    call.name,
                    call.timeout,
                    call.compile_options,
                    call.keep,
                    deliveries.drops,
                )
                node.memory.delivered(deliveries)
            return ref

        reroute = functools.partial(self._reroute_run, call.identity, held[0] if held else None)
        return self._follow(
            RayFuture(
                send,
                address,
                reroute=reroute,
                # Only a run that keeps outputs has any to make DeviceValues of.
                convert=functools.partial(self._outputs, call.name) if call.keep else None,
                ended=self._run_ended,
            )
        )

    def _send_spec(self, address: str, call: SpecCall) -> RayFuture:
        def send(address: str) -> ray.ObjectRef:
            return self._node(address).actor.run_spec.remote(call)

        reroute = functools.partial(self._reroute_run, call.spec.key, None)
        return self._follow(RayFuture(send, address, reroute=reroute, ended=self._run_ended))

    def _send_compile(self, address: str, call: CompileCall) -> RayFuture:
        def send(address: str) -> ray.ObjectRef:
            return self._node(address).actor.compile.remote(call)

        def reroute(address: str, error: BaseException, losses: int) -> str:
            self._lose(address, error, losses)
            return self._route(call.program, call.options)

        return self._follow(
            RayFuture(
                send,
                address,
                reroute=reroute,
                convert=lambda value, _: self._unwrap(value),
                ended=lambda future: self._untrack(id(future)),
            )
        )

    def _follow(self, future: RayFuture) -> RayFuture:
        """Keeps a future until its call has ended (close waits for it)."""
        self._track(id(future), future)
        if future.finished.is_set():  # it ended as it was sent (its node gone, say)
            self._untrack(id(future))
        return future

    def _run_ended(self, future: RayFuture) -> None:
        """A run's call has ended: counted on the node it ended on, and let go of."""
        self._ended(future.address)
        self._untrack(id(future))

    def _reroute_run(
        self,
        identity: str,
        held: WorkerMemory | None,
        address: str,
        error: BaseException,
        losses: int,
    ) -> str:
        """Where a run goes after its node was lost (see the class docstring); a run taking
        values kept there (`held`: their record) fails as a Pool's does when the worker
        holding them dies."""
        self._router.done(address)
        if held is not None:
            self._nodes.lost(address, self._nodes.get(address), LOST)
            raise held.lost or NodeLostError(
                f"Ray node {address} was lost with the values this run takes ({error})"
            )
        self._lose(address, error, losses)
        return self._router.choose(identity)

    def _lose(self, address: str, error: BaseException, losses: int) -> None:
        """A call's node was lost: forgotten (its values lost); raises when the call is not
        to be sent again."""
        self._nodes.lost(address, self._nodes.get(address), LOST)
        if self._closed:
            raise PoolClosedError(f"the {type(self).__name__} is closed") from error
        if not self._retry_lost or losses > ALLOWED_LOSSES:
            why = (
                "RayClusterPool(retry_lost=False) runs a call at most once"
                if not self._retry_lost
                else f"it was lost with {losses} nodes, more than ALLOWED_LOSSES ({ALLOWED_LOSSES})"
            )
            lost = NodeLostError(
                f"the Ray node running this call ({address}) was lost and the call was not sent "
                f"again: {why}. A run is a pure function of its inputs: submit it again"
            )
            raise lost from error

    def _outputs(self, name: str, value: list[Any], address: str | None) -> list[Any]:
        """A run's outputs: kept ones (KeptOnNode) as DeviceValues of this pool, their node's
        memory noting them."""
        if not any(type(o) is KeptOnNode for o in value):
            return value
        node = self._nodes.get(address or "")
        if node is None:  # lost since it answered: its values with it
            raise NodeLostError(f"Ray node {address} was lost with the values run {name!r} kept")
        outputs: list[Any] = []
        with node.lock:
            for index, output in enumerate(value):
                if type(output) is KeptOnNode:
                    output = DeviceValue(
                        self, node.memory, output.id, output.array_type, name, output.nbytes, index
                    )
                    node.memory.keep(output)
                outputs.append(output)
        return outputs

    def _node_holding(self, memory: WorkerMemory) -> str:
        for node in self._nodes.all():
            if node.memory is memory:
                return node.node_id
        raise memory.lost or NodeLostError("the node holding these values was lost")

    def _fetch(self, value: DeviceValue) -> np.ndarray:
        """A kept value's array, copied out of its node (DeviceValue.fetch)."""
        lost = value.lost_error()
        if lost is not None:
            raise lost
        address = self._node_holding(value._memory)
        node = self._node(address)
        with node.lock:
            deliveries = node.memory.pending(NO_SEGMENTS)
            ref = node.actor.fetch.remote(value.id, deliveries.drops)
            node.memory.delivered(deliveries)
        try:
            array = ray.get(ref)
        except ray.exceptions.RayActorError as error:
            self._nodes.lost(address, node, LOST)
            raise node.memory.lost or NodeLostError(str(error)) from error
        if isinstance(array, CarriedError):
            raise original_error(array)
        return array  # type: ignore[no-any-return]

    def _check_on(self, address: str, call: CompileCall) -> CarriedError | None:
        try:
            return ray.get(self._node(address).actor.check.remote(call))  # type: ignore[no-any-return]
        except (NodeLostError, ray.exceptions.RayActorError):
            return None  # a run meets it itself

    def _hold(self, identity: str, program: LoweredProgram, home: str) -> ray.ObjectRef:
        """The program in Ray's object store: runs name it, each node fetching it once."""
        return ray.put(program)

    def _node_answers(self, question: str) -> list[Any]:
        nodes = self._nodes.all()
        answers = []
        for node, ref in [(n, n.actor.answer.remote(question)) for n in nodes]:
            try:
                answers.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                self._nodes.lost(node.node_id, node, LOST)
        return answers

    def _close_nodes(self) -> None:
        self._nodes.close()

    def _wait(self, handles: list[Any], timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        return [f for f in handles if not f.finished.wait(max(0.0, deadline - time.monotonic()))]

    def _abandon(self, handle: Any, error: BaseException) -> None:
        handle.abandon(error)

    # -- Ray's own -------------------------------------------------------------------------

    def follow(self, object_ref: ray.ObjectRef) -> RayFuture:
        """A future of a run's ObjectRef (another run's object_ref, say): its outputs."""
        if not isinstance(object_ref, ray.ObjectRef):
            raise TypeError(f"follow takes a Ray ObjectRef, not {type(object_ref).__name__}")

        def refuse(address: str, error: BaseException, losses: int) -> str:
            raise NodeLostError(f"the node that was to make this ObjectRef was lost ({error})")

        return RayFuture(lambda _: object_ref, "", reroute=refuse)

    def nodes(self) -> dict[str, str]:
        """Each node this pool has an actor on, by Ray node id: what it does (Role's value)."""
        return {node.node_id: node.role.value for node in self._nodes.all()}
