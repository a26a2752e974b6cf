"""ClusterPool: the face of a Pool (pool.face) on a Dask cluster, a Pool per Dask worker.

It implements the face's primitives (run, submit, submit_spec,
_submit_compile, close, the figures); submit_compile, compile,
compile_many, map and function are PoolFace's, as for a Pool.

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
import functools
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Literal

import distributed
import numpy as np
from distributed.client import FuturesCancelledError

from pool.cluster.futures import ClusterFuture, original_error
from pool.cluster.node import (
    PLUGIN_PREFIX,
    PoolFigure,
    PoolPlugin,
    check_task,
    compile_task,
    node_figures,
    node_platform,
    program_task,
    run_spec_task,
    run_task,
)
from pool.cluster.routing import Router, home_of
from pool.cluster.run_once import ONCE_TASK_PREFIX, RUN_ONCE_PLUGIN_PREFIX, RunOnce
from pool.errors import PoolClosedError, PoolError
from pool.executor.checks import check_flag, pickle_initializer
from pool.executor.compile_many import CompileResult
from pool.executor.options import OPTIONS
from pool.executor.programs import program_id
from pool.executor.settings import check_devices
from pool.face import PoolFace
from worker.bundle.urls import bundle_source
from worker.cache import CacheCounters
from worker.cache.remote import RemoteCounters
from worker.compile.arguments import prepare_arguments
from worker.identity.keys import check_key
from worker.identity.options import checked_compile_options
from worker.plugin.topology import TopologySpec
from worker.records import ArrayType, CompileStatistics, LoweredProgram, ProgramSpec, check_program

HOLD_TEXT_CHARS = 64 << 10
"""Programs with a longer text are sent to the nodes once, as a Dask task of their own
(node.program_task) that runs depend on; shorter ones travel with each run (cheaper than a
dependency)."""

_HELD_PROGRAMS = 1024
"""How many held programs a ClusterPool keeps on the cluster (the oldest go first)."""


class ClusterPool(PoolFace):
    """Compiles and runs programs on a Dask cluster, a Pool per Dask worker, as Pool does.

    It takes the calls a Pool takes (PoolFace: run, submit, submit_spec,
    submit_compile, compile, compile_many, map, function, close, the with
    block, the statistics and counters), routed to the nodes; a Pool's
    terminate, worker_info and key_parts are the nodes' own.

    client is a connected distributed.Client. workers_per_node is each Dask
    worker's number of PJRT worker processes (default: its CPU count);
    platform, cache_dir, task_timeout, initializer, never_compile, remote
    topology and devices_per_worker are as for Pool and apply on every node;
    they are checked here, with Pool's errors (topology: every node compiles
    for it without a device, so a cluster of CPU machines compiles for a TPU;
    devices_per_worker: a program over more devices than that is refused at
    submit, as a Pool refuses it). never_compile
    also refuses, at submit, a program its home node's cache lacks (and its
    remote tier too when there is one), and keeps runs on the nodes whose
    cache has it (pool.cluster.routing).
    remote is the remote cache tier's URL, given to each node's PJRT
    workers (the nodes share the entries one of them compiled, and a
    fleet's other hosts do too); None leaves the nodes' own
    PJRT_POOL_CACHE_REMOTE, False turns it off. The cluster's Dask workers
    should have as many threads as PJRT workers, so that tasks reach every
    PJRT worker.

    Each ClusterPool registers its own plugin on the cluster (plugin_name),
    so several, of other options or other users, share a cluster without
    sharing node Pools; close() closes this one's alone.

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
        cache_dir: str | os.PathLike[str] | None = None,
        task_timeout: float | None = None,
        initializer: Callable[[], Any] | None = None,
        never_compile: bool | None = None,
        retry_lost: bool = True,
        spread_at: int | None = None,
        remote: str | Literal[False] | None = None,
        topology: str | TopologySpec | None = None,
        devices_per_worker: int = 1,
    ) -> None:
        # Checked here, before any node starts a Pool: a bad setting is refused once,
        # not in every run.
        check_flag(retry_lost, "retry_lost")
        options = _node_options(
            workers_per_node,
            platform,
            cache_dir,
            task_timeout,
            initializer,
            never_compile,
            remote,
            topology,
            devices_per_worker,
        )
        self.client = client
        self._devices = (options["devices_per_worker"], options.get("topology"))
        self._platform: str | None = options["platform"]
        self._never_compile: bool = options["never_compile"]
        if spread_at is None:
            threads = client.nthreads()
            spread_at = 2 * max(threads.values(), default=1)
        # nthreads() asks the scheduler and returns its answer; scheduler_info()
        # returns an attribute that the Client's periodic refresh overwrites with
        # an identity of no workers, so another thread can read it empty.
        self._router = Router(client.nthreads, spread_at)
        self._retry_lost = retry_lost
        self._key_prefix = "pjrt-run-" if retry_lost else ONCE_TASK_PREFIX
        tag = uuid.uuid4().hex
        self._plugin_name = f"{PLUGIN_PREFIX}{tag}"
        self._run_once_name = None if retry_lost else f"{RUN_ONCE_PLUGIN_PREFIX}{tag}"
        self._statistics = CompileStatistics()
        self._held: collections.OrderedDict[str, distributed.Future] = collections.OrderedDict()
        self._pending: dict[str, distributed.Future] = {}  # tasks submitted, not yet ended
        self._finished = 0
        self._closed = False
        self._lock = threading.Lock()
        client.register_plugin(PoolPlugin(**options), name=self._plugin_name)
        if self._run_once_name is not None:
            client.register_plugin(RunOnce(), name=self._run_once_name)

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
        name, timeout and compile_options are as for Pool.submit. A closed
        ClusterPool raises PoolClosedError.
        """
        self._check_open()
        program = check_program(program, "ClusterPool.submit")
        compile_options = checked_compile_options(compile_options)
        check_devices(program.partitioning, *self._devices)
        identity = program_id(program, compile_options)
        name = name or program.name
        arguments = _arguments(inputs, program.input_types)
        admit = None
        if self._never_compile:
            admit = functools.partial(self._admit, program, name, timeout, compile_options)
        address = self._router.choose(identity, admit)
        try:
            carried: Any = program
            if len(program.text) > HOLD_TEXT_CHARS:
                carried = self._hold(identity, program)
        except BaseException:
            self._router.done(address)
            raise
        return self._submit(address, run_task, carried, arguments, name, timeout, compile_options)

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
        bundle: str | os.PathLike[str] | None = None,
    ) -> ClusterFuture:
        """Runs the executable a ProgramSpec names on a node, as Pool.submit_spec does.

        The executable must be in that node's disk cache (a shared cache, or
        one each node was warmed into), or with bundle in that bundle: a path
        every node can read (a shared filesystem), or a URL.
        """
        self._check_open()
        if not isinstance(spec, ProgramSpec):
            raise TypeError(f"submit_spec takes a ProgramSpec, not {type(spec).__name__}")
        check_key(spec.key, f"the key of ProgramSpec {spec.name!r}")
        check_devices(spec.partitioning, *self._devices)
        source = bundle_source(bundle)
        arguments = _arguments(inputs, spec.input_types)
        return self._submit(
            self._router.choose(spec.key), run_spec_task, spec, arguments, timeout, source
        )

    def follow(self, dask_future: distributed.Future) -> ClusterFuture:
        """A ClusterFuture of a Dask future (of a run's dask_future, say), fetched when done."""
        if not isinstance(dask_future, distributed.Future):
            raise TypeError(f"follow takes a Dask future, not {type(dask_future).__name__}")
        return ClusterFuture(dask_future)

    def _check_open(self) -> None:
        """Raises PoolClosedError once close() has begun."""
        if self._closed:
            raise PoolClosedError("the ClusterPool is closed")

    def _parallelism(self) -> int:
        """How many runs the cluster runs at once: the threads of its Dask workers."""
        return sum(self.client.nthreads().values())

    def _send(
        self, task: Callable[..., Any], address: str, prefix: str, *args: Any
    ) -> distributed.Future:
        """Submits one of this ClusterPool's tasks, routed to a node (loosely, see
        pool.cluster.routing), and keeps it until it ends (close waits for it)."""
        remote = self.client.submit(
            task,
            self._plugin_name,
            *args,
            key=f"{prefix}{uuid.uuid4().hex}",
            workers=[address],
            allow_other_workers=True,
            pure=False,
        )
        with self._lock:
            self._pending[remote.key] = remote
        return remote

    def _submit(self, address: str, task: Callable[..., Any], *args: Any) -> ClusterFuture:
        try:
            remote = self._send(task, address, self._key_prefix, *args)
        except BaseException:
            self._router.done(address)
            raise
        done = functools.partial(self._ended, address, remote.key)
        return ClusterFuture(remote, done=done, retry_lost=self._retry_lost)

    def _ended(self, address: str, key: str) -> None:
        self._router.done(address)
        with self._lock:
            self._finished += 1
            self._pending.pop(key, None)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._pending.pop(key, None)

    def _hold(self, identity: str, program: LoweredProgram) -> distributed.Future:
        """The Dask future holding a long program on the cluster (see node.program_task)."""
        with self._lock:
            held = self._held.get(identity)
            if held is not None:
                self._held.move_to_end(identity)
                return held
        held = self.client.submit(
            program_task,
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

    def _admit(
        self,
        program: LoweredProgram,
        name: str,
        timeout: float | None,
        compile_options: bytes | None,
        address: str,
    ) -> BaseException | None:
        """In never-compile mode, before a program's first run on a node: that node's
        refusal of it (NeverCompileError, raised by its Pool before any PJRT worker does
        anything), or None (see node.check_task and pool.cluster.routing)."""
        refusal = self.client.submit(
            check_task,
            self._plugin_name,
            address,
            program,
            name,
            timeout,
            compile_options,
            workers=[address],
            allow_other_workers=True,
            pure=False,
        ).result()
        return None if refusal is None else original_error(refusal)

    @property
    def plugin_name(self) -> str:
        """The name this ClusterPool's PoolPlugin is registered under on the cluster."""
        return self._plugin_name

    @property
    def platform(self) -> str | None:
        """The platform the nodes' plugins run: the platform option, else the nodes' own
        (asked once: PJRT_POOL_PLATFORM on the nodes, else cpu). Pool.function lowers for it."""
        if self._platform is None:
            answers = set(self.client.run(node_platform, self._plugin_name).values())
            if len(answers) > 1:
                raise PoolError(
                    f"the cluster's nodes run different platforms ({', '.join(sorted(answers))}):"
                    " give ClusterPool(platform=) the one to run"
                )
            with self._lock:
                self._platform = next(iter(answers), None)
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

    def _route(self, program: LoweredProgram, compile_options: bytes | None = None) -> str:
        """The node a program compiles on: its home (stable, so each compiles once), the
        node its first run goes to."""
        return home_of(program_id(program, compile_options), self._router.addresses())

    def _submit_compile(
        self, program: Any, name: str | None, timeout: float | None, options: bytes | None
    ) -> Future[CompileResult]:
        """ClusterPool.submit_compile (see PoolFace's): on the node the program's hash picks."""
        self._check_open()
        program = check_program(program, "ClusterPool.submit_compile")
        options = checked_compile_options(options)
        check_devices(program.partitioning, *self._devices)
        remote = self._send(
            compile_task,
            self._route(program, options),
            "pjrt-compile-",
            program,
            name or program.name,
            timeout,
            options,
        )
        done = functools.partial(self._forget, remote.key)
        return ClusterFuture(remote, self._unwrap, done, retry_lost=self._retry_lost)

    def _unwrap(self, value: CompileResult | BaseException) -> CompileResult:
        """A node's CompileResult, counted; raises the program's failure the node returned."""
        if isinstance(value, BaseException):
            raise original_error(value)
        # From another machine: its key goes into manifests and cache paths.
        check_key(value.spec.key, "the key in a cluster node's result")
        with self._lock:
            self._statistics = self._statistics.add(value.statistics)
        return value

    @property
    def statistics(self) -> CompileStatistics:
        """Compile and load time and counts of its compiles (submit_compile, compile,
        compile_many), summed."""
        with self._lock:
            return self._statistics

    @property
    def cache_counters(self) -> CacheCounters:
        """Disk cache counters summed over every node's Pool."""
        total = CacheCounters()
        for counters in self._node_figures("cache_counters"):
            total = total.add(CacheCounters(**counters))
        return total

    @property
    def remote_counters(self) -> RemoteCounters:
        """The remote tier's hits, misses, publishes, waits (compiles saved by waiting on
        another host's lease) and so on, summed over every node Pool's PJRT workers."""
        total = RemoteCounters()
        for counters in self._node_figures("remote_counters"):
            total = total.add(RemoteCounters(**counters))
        return total

    def _node_figures(self, figures: PoolFigure) -> list[dict[str, Any]]:
        """One figure of each node whose Pool has started (see node.node_figures)."""
        answers = self.client.run(node_figures, self._plugin_name, figures).values()
        return [answer for answer in answers if answer]

    def close(self, cancel_pending: bool = False) -> None:
        """Closes every node's Pool of this ClusterPool (the client and cluster stay as they are).

        It first waits for the runs and compiles submitted; with
        cancel_pending, those not begun fail with PoolClosedError instead of
        running (as a Pool's queued tasks do), and those running finish. It
        returns when every node's Pool is closed and each of those futures
        has settled. From then on every call raises PoolClosedError; a node
        that gets a task of it anyway refuses it, starting nothing. Calling
        close again does nothing. Runs cancelled (ClusterFuture.cancel) count
        as ended: close never raises for them, and whatever the wait raises,
        the nodes' Pools are closed.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._held.clear()
        try:
            if not cancel_pending:
                self._wait_pending()
        finally:
            # Each node closes its Pool in a thread (node.PoolPlugin.teardown), and the call
            # returns when all have: runs running meanwhile finish there first.
            with contextlib.suppress(ValueError):  # its nodes are all gone, say
                self.client.unregister_worker_plugin(self._plugin_name)
            if self._run_once_name is not None:
                with contextlib.suppress(ValueError):
                    self.client.unregister_scheduler_plugin(self._run_once_name)
        self._wait_pending()  # those not begun fail at once on their nodes

    def _wait_pending(self) -> None:
        """Waits until every task submitted has ended (a cancelled one has)."""
        with self._lock:
            pending = list(self._pending.values())
        if pending:
            # A cancelled task leaves _pending when Dask's one callback thread settles it
            # (ClusterFuture._settle): later, while a user's done-callback holds that
            # thread. distributed.wait raises for cancelled futures, once all are done.
            with contextlib.suppress(FuturesCancelledError):
                distributed.wait(pending)

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        """Leaving the block closes the ClusterPool; by an exception, without running the
        runs not begun (close(cancel_pending=True))."""
        self.close(cancel_pending=value is not None)


def _node_options(
    workers_per_node: Any,
    platform: Any,
    cache_dir: Any,
    task_timeout: Any,
    initializer: Any,
    never_compile: Any,
    remote: Any,
    topology: Any = None,
    devices_per_worker: Any = 1,
) -> dict[str, Any]:
    """The nodes' Pool options, checked here by Pool's own checks (pool.executor.options).

    The nodes check them again as their Pools start, with what only a node
    can see (its cache directory, resolved there, and its trust; its plugin).
    """
    options: dict[str, Any] = {
        "workers": OPTIONS["workers"].checked(workers_per_node, "workers_per_node"),
        "platform": OPTIONS["platform"].checked(platform),
        "cache_dir": OPTIONS["cache_dir"].checked(cache_dir),
        "task_timeout": OPTIONS["task_timeout"].checked(task_timeout),
        "never_compile": OPTIONS["never_compile"].checked(never_compile),
        "remote": OPTIONS["remote"].checked(remote),
        "devices_per_worker": OPTIONS["devices_per_worker"].checked(devices_per_worker),
    }
    if topology is not None:  # each node's Pool compiles for it without a device
        options["topology"] = OPTIONS["topology"].checked(topology)
    if initializer is not None:
        pickle_initializer(initializer, ())  # it must reach the nodes' workers
        options["initializer"] = initializer
    return options


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
