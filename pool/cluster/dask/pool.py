"""ClusterPool: a Pool per Dask worker, behind the face of a Pool (pool.cluster.core).

What every engine shares (checks, routing, figures, closing, compile
statistics) is ClusterPoolBase's; this module sends its tasks to Dask.

Each call becomes one Dask task that runs in the NodePool of the node it is
routed to (pool.cluster.routing; pool.cluster.dask.node for the node's
side). Inputs and outputs travel as Dask's own task arguments and results
(numpy arrays as out-of-band buffers, without pickling copies); a Dask
future (of one array, or of a whole list of inputs, such as another run's
dask_future) is passed as a dependency, so its data goes from the node that
holds it to the node that runs, never through this process. A lost Dask
worker's tasks are run again elsewhere by Dask's scheduler itself.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import uuid
from collections.abc import Callable
from typing import Any

import distributed
from distributed.client import FuturesCancelledError

from pool.cluster.carried import CarriedError
from pool.cluster.core import ClusterPoolBase, RunCall
from pool.cluster.dask.futures import ClusterFuture
from pool.cluster.dask.node import (
    PLUGIN_PREFIX,
    PoolPlugin,
    check_task,
    close_plugin,
    compile_task,
    node_answer,
    program_task,
    run_spec_task,
    run_task,
)
from pool.cluster.dask.run_once import ONCE_TASK_PREFIX, RUN_ONCE_PLUGIN_PREFIX, RunOnce
from pool.cluster.node_pool import SpecCall
from pool.cluster.options import cluster_signature, documented
from pool.executor.compile_many import CompileCall
from worker.records import LoweredProgram


class ClusterPool(ClusterPoolBase):
    __doc__ = documented(
        """Compiles and runs programs on a Dask cluster, a Pool per Dask worker, as Pool does.

It takes the calls a Pool takes (PoolFace: run, submit, submit_spec,
submit_compile, compile, compile_many, map, function, close, the with
block, the statistics and counters), routed to the nodes; a Pool's
terminate, worker_info and key_parts are the nodes' own. client is a
connected distributed.Client. It takes every Pool option (below), checked
here with Pool's errors and applied on every node's Pool.""",
        """Of those: workers_per_node defaults to each Dask worker's CPU count;
topology makes every node compile for it without a device, so a cluster of
CPU machines compiles for a TPU; never_compile also refuses, at submit, a
program its home node's cache lacks (and its remote tier too when there is
one), and keeps runs on the nodes whose cache has it (pool.cluster.routing);
remote=None leaves the nodes' own PJRT_POOL_CACHE_REMOTE, False turns it off.
The cluster's Dask workers should have as many threads as PJRT workers, so
that tasks reach every PJRT worker. keep= is refused: a Dask task's outputs
go back to Dask (use a RayClusterPool, pool.cluster.ray, to keep values on
a node).

Each ClusterPool registers its own plugin on the cluster (plugin_name),
so several, of other options or other users, share a cluster without
sharing node Pools; close() closes this one's alone.

A run whose Dask worker is lost is run again elsewhere by Dask, since a
run is a pure function of its program and inputs; retry_lost=False
fails it with NodeLostError instead (it needs the scheduler to accept a
plugin: distributed.scheduler.pickle). Either way its future settles
once. spread_at is how many runs in flight on a program's nodes make its
next run go to a less busy node (default: twice the threads of a node;
see pool.cluster.routing).""",
    )

    _engine = "Dask"

    def __init__(
        self,
        client: distributed.Client,
        *,
        retry_lost: bool = True,
        spread_at: int | None = None,
        **pool_options: Any,
    ) -> None:
        # nthreads() asks the scheduler and returns its answer; scheduler_info()
        # returns an attribute that the Client's periodic refresh overwrites with
        # an identity of no workers, so another thread can read it empty.
        threads = max(client.nthreads().values(), default=1)
        super().__init__(pool_options, retry_lost, spread_at, threads)
        self.client = client
        self._key_prefix = "pjrt-run-" if retry_lost else ONCE_TASK_PREFIX
        tag = uuid.uuid4().hex
        self._plugin_name = f"{PLUGIN_PREFIX}{tag}"
        self._run_once_name = None if retry_lost else f"{RUN_ONCE_PLUGIN_PREFIX}{tag}"
        client.register_plugin(PoolPlugin(**self._options), name=self._plugin_name)
        if self._run_once_name is not None:
            client.register_plugin(RunOnce(), name=self._run_once_name)

    __init__.__signature__ = cluster_signature(  # type: ignore[attr-defined]
        [inspect.Parameter("client", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    )

    # -- the engine ------------------------------------------------------------------------

    def _run_addresses(self) -> list[str]:
        return list(self.client.nthreads())

    def _is_cluster_data(self, value: Any) -> bool:
        return isinstance(value, distributed.Future)

    def _parallelism(self) -> int:
        """How many runs the cluster runs at once: the threads of its Dask workers."""
        return sum(self.client.nthreads().values())

    def _send(
        self, task: Callable[..., Any], address: str, prefix: str, *args: Any
    ) -> distributed.Future:
        """Submits one of this ClusterPool's tasks, routed to a node (loosely, see
        pool.cluster.routing)."""
        return self.client.submit(
            task,
            self._plugin_name,
            *args,
            key=f"{prefix}{uuid.uuid4().hex}",
            workers=[address],
            allow_other_workers=True,
            pure=False,
        )

    def _kept(self, future: ClusterFuture) -> ClusterFuture:
        """Keeps a task's future until it ends (close waits for it)."""
        self._track(future.dask_future.key, future)
        if future.ended.is_set():  # it ended before it was noted
            self._untrack(future.dask_future.key)
        return future

    def _follow(self, remote: distributed.Future, address: str) -> ClusterFuture:
        def ended() -> None:
            self._ended(address)
            self._untrack(remote.key)

        return self._kept(ClusterFuture(remote, done=ended, retry_lost=self._retry_lost))

    def _send_run(self, address: str, call: RunCall) -> ClusterFuture:
        remote = self._send(
            run_task,
            address,
            self._key_prefix,
            call.program,
            call.arguments,
            call.name,
            call.timeout,
            call.compile_options,
        )
        return self._follow(remote, address)

    def _send_spec(self, address: str, call: SpecCall) -> ClusterFuture:
        remote = self._send(run_spec_task, address, self._key_prefix, call)
        return self._follow(remote, address)

    def _send_compile(self, address: str, call: CompileCall) -> ClusterFuture:
        remote = self._send(compile_task, address, "pjrt-compile-", call)
        done = functools.partial(self._untrack, remote.key)
        return self._kept(ClusterFuture(remote, self._unwrap, done, retry_lost=self._retry_lost))

    def _check_on(self, address: str, call: CompileCall) -> CarriedError | None:
        return self.client.submit(  # type: ignore[no-any-return]
            check_task,
            self._plugin_name,
            address,
            call,
            workers=[address],
            allow_other_workers=True,
            pure=False,
        ).result()

    def _hold(self, identity: str, program: LoweredProgram, home: str) -> distributed.Future:
        """The Dask future holding a long program on the cluster (see node.program_task)."""
        return self.client.submit(
            program_task,
            program,
            key=f"pjrt-program-{identity}",
            workers=[home],
            allow_other_workers=True,
            pure=False,
        )

    def _node_answers(self, question: str) -> list[Any]:
        return list(self.client.run(node_answer, self._plugin_name, question).values())

    def _close_nodes(self) -> None:
        # Each node closes its Pool in a thread (node.PoolPlugin.teardown), and the call
        # returns when all have: runs running meanwhile finish there first. A node lost
        # meanwhile fails the scheduler's broadcast (its Pool went with it); the nodes that
        # still hold the plugin then close it one by one.
        try:
            self.client.unregister_worker_plugin(self._plugin_name)
        except ValueError:  # not registered: its nodes are all gone, say
            pass
        except (OSError, TimeoutError):  # CommClosedError is an OSError
            with contextlib.suppress(OSError, TimeoutError):
                self.client.run(close_plugin, self._plugin_name, on_error="ignore")
        finally:
            if self._run_once_name is not None:
                with contextlib.suppress(ValueError, OSError, TimeoutError):
                    self.client.unregister_scheduler_plugin(self._run_once_name)

    def _wait(self, handles: list[Any], timeout: float) -> list[Any]:
        # distributed.wait raises for cancelled futures once all are done (a cancelled
        # task leaves _pending when Dask's one callback thread settles it: later, while a
        # user's done-callback holds that thread), and TimeoutError past the timeout.
        with contextlib.suppress(FuturesCancelledError, TimeoutError):
            distributed.wait([h.dask_future for h in handles], timeout=timeout)
        return [h for h in handles if not h.dask_future.done()]

    def _cannot_end(self, handles: list[Any]) -> list[str | None]:
        keys = [h.dask_future.key for h in handles]
        try:
            states = self.client.sync(self.client.scheduler.get_task_status, keys=keys)
            processing = {k for ks in self.client.processing().values() for k in ks}
        except (OSError, TimeoutError) as error:
            return [f"Dask's scheduler does not answer ({error})"] * len(keys)
        return [_why_stuck(states.get(key), key in processing) for key in keys]

    def _abandon(self, handle: Any, error: BaseException) -> None:
        handle.abandon(error)

    # -- Dask's own ------------------------------------------------------------------------

    def follow(self, dask_future: distributed.Future) -> ClusterFuture:
        """A ClusterFuture of a Dask future (of a run's dask_future, say), fetched when done."""
        if not isinstance(dask_future, distributed.Future):
            raise TypeError(f"follow takes a Dask future, not {type(dask_future).__name__}")
        return ClusterFuture(dask_future)

    @property
    def plugin_name(self) -> str:
        """The name this ClusterPool's PoolPlugin is registered under on the cluster."""
        return self._plugin_name


def _why_stuck(state: str | None, processing: bool) -> str | None:
    """Why a task whose future has not settled cannot end, by its state on Dask's scheduler
    and whether a worker the scheduler has is processing it (None: it can still end)."""
    if state is None or state == "forgotten":
        return "Dask's scheduler no longer has it (lost with its worker)"
    if state == "processing" and not processing:
        return "Dask's scheduler has it processing on a worker it no longer has"
    if state == "no-worker":
        return "no Dask worker is left to run it"
    if state in ("memory", "erred"):
        return f"Dask's scheduler has its outcome ({state}), which this client was never sent"
    return None
