"""Compiling on a Dask cluster: one pjrt-pool Pool per Dask worker.

    client (this process)                     Dask worker (each node)
    ─────────────────────                     ───────────────────────
    lower programs                            PoolPlugin: a Pool of PJRT worker
    route each by program hash ──task──▶        processes, started on first use
      to one Dask worker                      task: pool.submit_compile(program)
    collect CompileResults    ◀──result──       → compiled, or loaded from the
    sum CompileStatistics                         node's (or a shared) disk cache

A plugin crash kills a PJRT worker process inside the Dask worker's Pool,
never the Dask worker itself: the task returns that program's failure as a
value. Each program is one Dask task, routed by the hash of its text and
platform to one node (a loose restriction: if that node is lost, Dask runs
the task elsewhere, and the program is still reported once). Because a
program always goes to the same node, nodes with separate cache directories
still compile it once each across repeated runs; with one shared directory
(a shared filesystem) any node can load what another compiled.

Needs the ``distributed`` extra: ``pip install 'pjrt-pool[cluster]'``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

from pool.executor.compile_many import CompileResult, Progress, compile_many
from pool.executor.futures import adapt
from pool.executor.pool import Pool
from pool.executor.programs import program_id
from worker.cache import CacheCounters
from worker.cache.key import check_key
from worker.records import CompileStatistics, LoweredProgram, check_program

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
    worker's event loop) and closes when the Dask worker does.
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
        worker.pjrt_pool_plugin = self  # type: ignore[attr-defined]

    def teardown(self, worker: distributed.Worker) -> None:
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


def _plugin() -> PoolPlugin:
    worker = distributed.get_worker()
    plugin = getattr(worker, "pjrt_pool_plugin", None)
    if plugin is None:
        raise RuntimeError(
            "this Dask worker has no pjrt-pool plugin: create a ClusterPool on the client first"
        )
    return plugin


def _compile_task(
    program: LoweredProgram, name: str, timeout: float | None, compile_options: bytes | None
) -> CompileResult | BaseException:
    """Runs on a Dask worker: compiles in its Pool; a program's failure is returned, not raised.

    Returning the exception keeps Dask from treating a compile error or a
    PJRT worker crash as a failure of the Dask task (which it would retry).
    """
    try:
        return (
            _plugin()
            .pool()
            .submit_compile(program, name=name, timeout=timeout, compile_options=compile_options)
            .result()
        )
    except Exception as error:
        return error


def _node_counters(dask_worker: distributed.Worker) -> dict[str, int]:
    plugin = getattr(dask_worker, "pjrt_pool_plugin", None)
    if plugin is None or plugin._pool is None:
        return {}
    return plugin._pool.cache_counters._asdict()


@contextlib.contextmanager
def local_client(
    n_workers: int = 2, threads_per_worker: int | None = None
) -> Iterator[distributed.Client]:
    """A Client on a new LocalCluster of n_workers processes, listening on loopback only.

    Each Dask worker gets threads_per_worker threads (default: one per CPU,
    so that its Pool's workers all get tasks). For trying clusters out.
    """
    with (
        distributed.LocalCluster(
            n_workers=n_workers,
            threads_per_worker=threads_per_worker or os.cpu_count() or 1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=":0",  # a free port: several clusters may run at once
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.wait_for_workers(n_workers, timeout=120)
        yield client


@contextlib.contextmanager
def connect(scheduler: str) -> Iterator[distributed.Client]:
    """A Client for a scheduler address; "local:N" starts a local cluster (see local_client)."""
    if scheduler.startswith("local"):
        _, _, count = scheduler.partition(":")
        try:
            n_workers = int(count or 2)
        except ValueError:
            raise ValueError(f"--scheduler local:N needs a number, not {count!r}") from None
        with local_client(n_workers) as client:
            yield client
        return
    with distributed.Client(scheduler) as client:
        yield client


class ClusterPool:
    """Compiles programs on a Dask cluster, a Pool per Dask worker, like Pool.compile_many.

    client is a connected distributed.Client. workers_per_node is each Dask
    worker's number of PJRT worker processes (default: its CPU count);
    platform, cache_dir, task_timeout and initializer are as for Pool and
    apply on every node. The cluster's Dask workers should have as many
    threads as PJRT workers, so that tasks reach every PJRT worker.
    """

    def __init__(
        self,
        client: distributed.Client,
        *,
        workers_per_node: int | None = None,
        platform: str | None = None,
        cache_dir: str | None = None,
        task_timeout: float | None = None,
        initializer: Callable[[], Any] | None = None,
    ) -> None:
        self.client = client
        options: dict[str, Any] = {
            "workers": workers_per_node,
            "platform": platform,
            "cache_dir": cache_dir,
            "task_timeout": task_timeout,
        }
        if initializer is not None:
            options["initializer"] = initializer
        client.register_plugin(PoolPlugin(**options), name=PLUGIN_NAME)
        self._statistics = CompileStatistics()
        self._lock = threading.Lock()

    def _route(self, program: LoweredProgram) -> list[str]:
        # nthreads() asks the scheduler and returns its answer; scheduler_info()
        # returns an attribute that the Client's periodic refresh overwrites with
        # an identity of no workers, so another thread can read it empty.
        addresses = sorted(self.client.nthreads())
        if not addresses:
            raise RuntimeError("the Dask cluster has no workers")
        return [addresses[int(program_id(program)[:16], 16) % len(addresses)]]

    def submit_compile(
        self,
        program: LoweredProgram,
        *,
        name: str | None = None,
        timeout: float | None = None,
        compile_options: bytes | None = None,
    ) -> Future[CompileResult]:
        """Compiles a program on the node its hash picks; the future's result is a CompileResult.

        A program's own failure (compile error, PJRT worker crash, timeout)
        is the future's exception, as with Pool.submit_compile.
        """
        program = check_program(program, "ClusterPool.submit_compile")
        remote = self.client.submit(
            _compile_task,
            program,
            name or program.name,
            timeout,
            compile_options,
            workers=self._route(program),
            allow_other_workers=True,
            pure=False,
        )
        return adapt(remote, self._unwrap)

    def _unwrap(self, value: CompileResult | BaseException) -> CompileResult:
        """A node's CompileResult, counted; raises the program's failure the node returned."""
        if isinstance(value, BaseException):
            raise value
        # From another machine: its key goes into manifests and cache paths.
        check_key(value.spec.key, "the key in a cluster node's result")
        with self._lock:
            self._statistics = self._statistics.add(value.statistics)
        return value

    def compile_many(
        self,
        programs: Iterable[LoweredProgram | tuple[str, LoweredProgram]],
        *,
        timeout: float | None = None,
        progress: bool | Progress | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Compiles programs across the cluster, as Pool.compile_many does across workers."""
        return compile_many(
            self.submit_compile,
            programs,
            timeout=timeout,
            progress=progress,
            return_exceptions=return_exceptions,
        )

    @property
    def statistics(self) -> CompileStatistics:
        """Compile and load time and counts, summed over every program so far."""
        with self._lock:
            return self._statistics

    @property
    def cache_counters(self) -> CacheCounters:
        """Disk cache counters summed over every node's Pool."""
        total = CacheCounters()
        for counters in self.client.run(_node_counters).values():
            if counters:
                total = total.add(CacheCounters(**counters))
        return total

    def close(self, cancel_pending: bool = False) -> None:
        """Closes every node's Pool (the client and cluster stay as they are)."""
        self.client.unregister_worker_plugin(PLUGIN_NAME)

    def __enter__(self) -> ClusterPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
