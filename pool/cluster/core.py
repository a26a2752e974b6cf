"""ClusterPoolBase: what a ClusterPool does on any engine, written once; each engine sends.

    ClusterPoolBase (this module)                 an engine: pool.cluster.dask, pool.cluster.ray
    ─────────────────────────────                 ──────────────────────────────────────────────
    checks each call with Pool's checks           sends a task to a node's Pool (a Dask task
    routes it by its program (routing.py):          in the node's PoolPlugin; a call of the
      runs to the nodes that hold it,               node's Ray actor)
      compiles to the program's home node         follows it: a future that settles once
    counts runs in flight, ended and pending      asks the nodes for figures and platforms
    sums the nodes' figures; counts compiles      closes the nodes' Pools
    turns a node's CarriedError back              says which nodes run, which compile
    holds long programs on the cluster (an LRU)
    keeps the client's side of values kept on
      a node (keep=, where the engine can)
    closes: waits, closes the nodes, waits

A ClusterPool on any engine takes the calls a Pool takes (PoolFace: run,
submit, submit_spec, submit_compile, compile, compile_many, map, function,
close, the with block, the figures) and every Pool option, applied on each
node (pool.cluster.options). A node lost with tasks on it is the engine's to
notice: Dask's scheduler runs its tasks again itself; on Ray the engine asks
resend() for another node. Either way a task's future settles once, and a
task run at most once (retry_lost=False), or lost too often, fails with
NodeLostError.
"""

from __future__ import annotations

import abc
import collections
import functools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

from pool.cluster.carried import CarriedError, NodeLostError, original_error
from pool.cluster.node_pool import SpecCall
from pool.cluster.options import check_cluster_options, node_options
from pool.cluster.routing import Router, home_of
from pool.errors import PoolClosedError, PoolError
from pool.executor.compile_many import CompileCall, CompileResult
from pool.executor.programs import program_id
from pool.executor.settings import check_devices
from pool.executor.values import DeviceValue, check_values, values_in
from pool.executor.worker_memory import WorkerMemory
from pool.face import PoolFace
from worker.bundle.urls import bundle_source
from worker.cache import CacheCounters
from worker.cache.remote import RemoteCounters
from worker.compile.arguments import prepare_arguments
from worker.identity.keys import check_key
from worker.identity.options import checked_compile_options
from worker.records import (
    ArrayType,
    CompileStatistics,
    LoweredProgram,
    ProgramSpec,
    check_program,
)

HOLD_TEXT_CHARS = 64 << 10
"""Programs with a longer text are sent to the cluster once (as a Dask task of their own, or a
Ray object) and runs name that; shorter ones travel with each run (cheaper than a lookup)."""

_HELD_PROGRAMS = 1024
"""How many held programs a ClusterPool keeps on the cluster (the oldest go first)."""

STUCK_SECONDS = 20.0
"""How long close() waits for a task its engine says cannot end (see close) before failing
it: longer than a lost node's tasks take to be placed again, or a restarted node to join."""

STUCK_CHECK_SECONDS = 2.0
"""How often a waiting close() asks the engine which tasks cannot end."""

SETTLE_SECONDS = 60.0
"""How long close() waits, once the nodes' Pools are closed, for the last tasks to settle."""


def _cannot_end_text(engine: str, why: str) -> str:
    return (
        f"this task cannot end: {why}; the {engine} cluster did not settle it in "
        f"{STUCK_SECONDS:g} s, so closing the pool gave up on it. A run is a pure function of "
        "its inputs: submit it again on a cluster with nodes"
    )


def _not_settled(engine: str, seconds: float | None) -> str:
    return (
        f"the pool was closed, and this task had not ended {seconds:g} s after the nodes' "
        f"Pools closed (its {engine} node lost, or the cluster not answering)"
    )


class RunCall(NamedTuple):
    """One run as a node's Pool takes it: program (or what holds it on the cluster), its
    arguments (checked here, or the engine's futures of them), and Pool.run's options; and
    the program's identity, which it is routed by."""

    identity: str
    program: Any
    arguments: Any
    name: str
    timeout: float | None
    compile_options: bytes | None
    keep: tuple[int, ...] = ()


class ClusterPoolBase(PoolFace):
    """A Pool on every node of a cluster, behind the face of one Pool (see the module
    docstring). Each engine's class documents its constructor; this one takes the node
    options as given (pool.cluster.options.node_options checks them) and the cluster's own
    (retry_lost, spread_at: see the engines' docstrings)."""

    _engine = "cluster"
    """The engine's name, for messages ("Dask", "Ray")."""

    def __init__(
        self, given: dict[str, Any], retry_lost: bool, spread_at: int | None, threads: int
    ) -> None:
        check_cluster_options(retry_lost, spread_at)
        self._options = node_options(given, type(self).__name__)
        self._devices = (self._options["devices_per_worker"], self._options["topology"])
        self._platform: str | None = self._options["platform"]
        self._never_compile: bool = self._options["never_compile"]
        self._retry_lost = retry_lost
        # spread_at's default: twice what a node runs at once, so that a program's runs stay
        # on its nodes until they queue.
        self._router = Router(self._run_addresses, spread_at or 2 * max(1, threads))
        self._statistics = CompileStatistics()
        self._held: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._pending: dict[Any, Any] = {}  # the engine's handles of tasks not yet ended
        self._finished = 0
        self._closed = False
        self._lock = threading.Lock()

    # -- what each engine implements ------------------------------------------------------

    @abc.abstractmethod
    def _run_addresses(self) -> list[str]:
        """The addresses of the nodes that run programs (a round trip to the cluster)."""

    def _compile_addresses(self) -> list[str]:
        """The addresses of the nodes that compile, sorted: those that run, unless the engine
        has nodes that compile for the ones that run (Ray's CPU nodes for its TPU hosts)."""
        return self._router.addresses()

    @abc.abstractmethod
    def _send_run(self, address: str, call: RunCall) -> Future[Any]:
        """Sends a run to `address`'s Pool; returns a future of its outputs, which settles
        once, raising the node Pool's exception. Once the run has ended, whatever the
        outcome, the engine calls _ended(the address it ended on) once."""

    @abc.abstractmethod
    def _send_spec(self, address: str, call: SpecCall) -> Future[Any]:
        """Sends a run of a ProgramSpec's executable to `address`'s Pool (as _send_run)."""

    @abc.abstractmethod
    def _send_compile(self, address: str, call: CompileCall) -> Future[CompileResult]:
        """Sends a compile (its program checked, its name and options given; for JAX's cache,
        with call.jax) to `address`'s Pool; returns a future of its CompileResult (converted
        by _unwrap, so that it is counted once)."""

    @abc.abstractmethod
    def _check_on(self, address: str, call: CompileCall) -> CarriedError | None:
        """For a never-compile ClusterPool: `address`'s refusal of a program (its Pool's
        NeverCompileError, carried), or None when it has it (a round trip to the node)."""

    @abc.abstractmethod
    def _node_answers(self, question: str) -> list[Any]:
        """Every node's answer to a question about its Pool of this ClusterPool (one of
        "platform", "cache_counters", "remote_counters", "statistics": a platform's name,
        or a figure as a dict, empty where the Pool has not started)."""

    @abc.abstractmethod
    def _close_nodes(self) -> None:
        """Closes every node's Pool of this ClusterPool (those running finish first); a node
        lost meanwhile (its Pool gone with it) raises nothing."""

    @abc.abstractmethod
    def _wait(self, handles: list[Any], timeout: float) -> list[Any]:
        """Waits at most timeout seconds for the engine's tasks of these handles (_pending's
        values: the futures handed out) to end; returns those that have not."""

    def _cannot_end(self, handles: list[Any]) -> list[str | None]:
        """For each handle of a task not ended: why its task can no longer end by itself (a
        round trip to the cluster), or None. An engine that settles every task of a lost
        node itself (Ray fails a dead actor's calls) says None (the default)."""
        return [None] * len(handles)

    @abc.abstractmethod
    def _abandon(self, handle: Any, error: BaseException) -> None:
        """Fails a future whose task will not end (close gives up on it) with error, counts
        it ended once (as the engine's own end would), and cancels its task."""

    def _is_cluster_data(self, value: Any) -> bool:
        """Whether an input is the engine's own reference to data on the cluster (a Dask
        future, a Ray ObjectRef), which the node fetches and its Pool checks."""
        return False

    def _hold(self, identity: str, program: LoweredProgram, home: str) -> Any:
        """What holds a long program on the cluster, made once per program (default: the
        program itself, sent with each run)."""
        return program

    def _node_holding(self, memory: WorkerMemory) -> str:
        """The node whose values this record mirrors (engines that keep values say)."""
        raise PoolError(f"a {type(self).__name__} keeps no values")

    # -- running ---------------------------------------------------------------------------

    def submit(
        self,
        program: LoweredProgram,
        inputs: Any,
        *,
        name: str | None = None,
        timeout: float | None = None,
        compile_options: bytes | None = None,
        keep: int | Sequence[int] = (),
    ) -> Future[Any]:
        """Runs a program on a node (compiling or loading it there first); returns a Future.

        The future is a concurrent.futures.Future of the outputs (numpy arrays,
        fetched here when it is read). inputs are arrays (checked and
        converted here, raising what Pool.submit raises), or the engine's
        references to data on the cluster (Dask futures, Ray ObjectRefs:
        checked on the node). A plugin crash, timeout or quarantine fails the
        run with the node Pool's exception. name, timeout and compile_options
        are as for Pool.submit; keep (where the engine keeps values: Ray) too.
        A closed ClusterPool raises PoolClosedError.
        """
        self._check_open()
        program = check_program(program, f"{type(self).__name__}.submit")
        compile_options = checked_compile_options(compile_options)
        check_devices(program.partitioning, *self._devices)
        kept = self._kept_positions(keep)
        identity = program_id(program, compile_options)
        name = name or program.name
        values = values_in(inputs)
        arguments = self._arguments(inputs, program.input_types)
        if values:  # they stay where they are: the run goes there
            held = check_values(self, values, program.input_types)
            address = self._router.pin(identity, self._node_holding(held))  # type: ignore[arg-type]
        else:
            admit = None
            if self._never_compile:
                call = CompileCall(program, name, timeout, compile_options)
                admit = functools.partial(self._admit, call)
            address = self._router.choose(identity, admit)
        try:
            carried: Any = program
            if len(program.text) > HOLD_TEXT_CHARS:
                carried = self._held_program(identity, program)
            call = RunCall(identity, carried, arguments, name, timeout, compile_options, kept)
            return self._send_run(address, call)
        except BaseException:
            self._router.done(address)
            raise

    def run(self, program: LoweredProgram, inputs: Any, /, **options: Any) -> list[Any]:
        """Runs a program on a node and returns its outputs (submit's options: name, timeout,
        compile_options, keep)."""
        return self.submit(program, inputs, **options).result()  # type: ignore[no-any-return]

    def submit_spec(
        self,
        spec: ProgramSpec,
        inputs: Any,
        *,
        timeout: float | None = None,
        bundle: Any = None,
    ) -> Future[Any]:
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
        arguments = self._arguments(inputs, spec.input_types)
        address = self._router.choose(spec.key)
        try:
            return self._send_spec(address, SpecCall(spec, arguments, timeout, source))
        except BaseException:
            self._router.done(address)
            raise

    def _kept_positions(self, keep: int | Sequence[int]) -> tuple[int, ...]:
        """keep= as positions; TypeError where the engine keeps no values (Dask)."""
        positions = (keep,) if isinstance(keep, int) and not isinstance(keep, bool) else keep
        if not isinstance(positions, (tuple, list)) or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in positions
        ):
            raise TypeError(f"keep must be an output's index or a sequence of them, not {keep!r}")
        if positions and not self._keeps_values:
            raise TypeError(
                f"{type(self).__name__} takes no keep=: a Dask task's outputs go back to "
                "Dask, so no value stays in a node's Pool between calls; use a Pool, or a "
                "RayClusterPool (each node's actor keeps its values)"
            )
        return tuple(positions)

    def _arguments(self, inputs: Any, types: Sequence[ArrayType] | None) -> Any:
        """A run's inputs, checked and converted here except the engine's references to
        data on the cluster (checked on the node, by its Pool, with the same errors once
        their data is there) and kept values (checked by check_values)."""
        if self._is_cluster_data(inputs):
            return inputs
        if type(inputs) in (list, tuple) and any(
            self._is_cluster_data(x) or type(x) is DeviceValue for x in inputs
        ):
            if types is not None and len(inputs) != len(types):
                prepare_arguments(inputs, types)  # raises the count's TypeError
            return [
                x
                if self._is_cluster_data(x) or type(x) is DeviceValue
                else prepare_arguments([x], None if types is None else [types[i]])[0]
                for i, x in enumerate(inputs)
            ]
        return prepare_arguments(inputs, types)

    def _held_program(self, identity: str, program: LoweredProgram) -> Any:
        """What holds a long program on the cluster (the engine's _hold), made once and kept
        for the _HELD_PROGRAMS most recent."""
        with self._lock:
            held = self._held.get(identity)
            if held is not None:
                self._held.move_to_end(identity)
                return held
        held = self._hold(identity, program, home_of(identity, self._router.addresses()))
        with self._lock:
            held = self._held.setdefault(identity, held)
            while len(self._held) > _HELD_PROGRAMS:
                self._held.popitem(last=False)
        return held

    def _admit(self, call: CompileCall, address: str) -> BaseException | None:
        """In never-compile mode, before a program's first run on a node: that node's
        refusal of it (NeverCompileError, raised by its Pool before any PJRT worker does
        anything), or None (see pool.cluster.routing)."""
        refusal = self._check_on(address, call)
        return None if refusal is None else original_error(refusal)

    def _ended(self, address: str | None) -> None:
        """A run (or spec run) routed to `address` has ended: counted once, whatever the
        outcome (the engine calls it; None: its node's count was let go of already)."""
        if address is not None:
            self._router.done(address)
        with self._lock:
            self._finished += 1

    def _track(self, key: Any, handle: Any) -> None:
        """Notes an engine task sent, until _untrack (close waits for the tasks noted)."""
        with self._lock:
            self._pending[key] = handle

    def _untrack(self, key: Any) -> None:
        with self._lock:
            self._pending.pop(key, None)

    def _check_open(self) -> None:
        """Raises PoolClosedError once close() has begun."""
        if self._closed:
            raise PoolClosedError(f"the {type(self).__name__} is closed")

    @property
    def platform(self) -> str | None:
        """The platform the nodes' plugins run: the platform option, else the nodes' own
        (asked once: PJRT_POOL_PLATFORM on the nodes, else cpu). Pool.function lowers for it."""
        if self._platform is None:
            answers = set(self._node_answers("platform"))
            if len(answers) > 1:
                raise PoolError(
                    f"the cluster's nodes run different platforms ({', '.join(sorted(answers))}):"
                    f" give {type(self).__name__}(platform=) the one to run"
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

    # -- compiling ---------------------------------------------------------------------------

    def _route(self, program: LoweredProgram, compile_options: bytes | None = None) -> str:
        """The node a program compiles on: its home among the nodes that compile (stable, so
        each compiles once; where they are the nodes that run, the node its first run goes
        to)."""
        return home_of(program_id(program, compile_options), self._compile_addresses())

    def _submit_compile(self, call: CompileCall) -> Future[CompileResult]:
        """submit_compile (see PoolFace's): on the node the program's hash picks."""
        self._check_open()
        program = check_program(call.program, f"{type(self).__name__}.submit_compile")
        options = checked_compile_options(call.options)
        check_devices(program.partitioning, *self._devices)
        address = self._route(program, options)
        checked = call._replace(program=program, name=call.name or program.name, options=options)
        return self._send_compile(address, checked)

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
        for counters in self._node_answers("cache_counters"):
            if counters:
                total = total.add(CacheCounters(**counters))
        return total

    @property
    def remote_counters(self) -> RemoteCounters:
        """The remote tier's hits, misses, publishes, waits (compiles saved by waiting on
        another host's lease) and so on, summed over every node Pool's PJRT workers."""
        total = RemoteCounters()
        for counters in self._node_answers("remote_counters"):
            if counters:
                total = total.add(RemoteCounters(**counters))
        return total

    # -- closing -----------------------------------------------------------------------------

    def close(self, cancel_pending: bool = False) -> None:
        """Closes every node's Pool of this ClusterPool (the cluster stays as it is).

        It first waits for the runs and compiles submitted; with
        cancel_pending, those not begun fail with PoolClosedError instead of
        running (as a Pool's queued tasks do), and those running finish. It
        returns when every node's Pool is closed and each of those futures
        has settled. From then on every call raises PoolClosedError; a node
        that gets a task of it anyway refuses it, starting nothing. Calling
        close again does nothing. Runs cancelled count as ended: close never
        raises for them, and whatever the wait raises, the nodes' Pools are
        closed.

        It never waits for a task that can no longer end: one the engine
        says cannot (its node lost and the engine never settling it, or no
        node left to run it: see _cannot_end) for STUCK_SECONDS fails with
        NodeLostError, and one still pending SETTLE_SECONDS after the nodes'
        Pools closed (which ends what they held) fails with PoolClosedError.
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
            self._close_nodes()
        self._wait_pending(SETTLE_SECONDS)  # those not begun fail at once on their nodes

    def _wait_pending(self, settle: float | None = None) -> None:
        """Waits for the tasks noted in _pending to end, giving up on those that cannot
        (see close); with settle, on every task still pending after that many seconds."""
        deadline = None if settle is None else time.monotonic() + settle
        stuck_since: dict[int, float] = {}
        while True:
            with self._lock:
                pending = list(self._pending.values())
            step = STUCK_CHECK_SECONDS
            if deadline is not None:
                step = min(step, max(0.0, deadline - time.monotonic()))
            pending = self._wait(pending, step) if pending else []
            if not pending:
                return
            if deadline is not None and time.monotonic() >= deadline:
                for handle in pending:
                    self._abandon(handle, PoolClosedError(_not_settled(self._engine, settle)))
                return
            now = time.monotonic()
            for handle, why in zip(pending, self._cannot_end(pending), strict=True):
                if why is None:
                    stuck_since.pop(id(handle), None)
                elif now - stuck_since.setdefault(id(handle), now) >= STUCK_SECONDS:
                    self._abandon(handle, NodeLostError(_cannot_end_text(self._engine, why)))

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        """Leaving the block closes the ClusterPool; by an exception, without running the
        runs not begun (close(cancel_pending=True))."""
        self.close(cancel_pending=value is not None)
