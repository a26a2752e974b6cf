"""Compiling and running on a Dask cluster: one pjrt-pool Pool per Dask worker.

    client (this process)                     Dask worker (each node)
    ─────────────────────                     ───────────────────────
    ClusterPool.run / submit / map /          PoolPlugin (one per ClusterPool): a
      function / submit_spec / compile          Pool of PJRT worker processes,
                                                started on first use
    route each task by its program  ──task──▶ task: pool.run(program, inputs)
      (routing: nodes holding it loaded,        (or submit_spec, submit_compile)
       spread when their queues are long)     → compiled, or loaded from the
    ClusterFuture (+ its dask_future) ◀──── node's (or a shared) disk cache
                                              a plugin crash fails the task with
                                              the Pool's error, not the Dask worker

A plugin crash kills a PJRT worker process inside the Dask worker's Pool,
never the Dask worker itself: the task fails with the Pool's exception
(WorkerCrashedError, TaskTimeoutError, ProgramQuarantinedError), and the
node goes on serving. A lost Dask worker's task is run again elsewhere by
Dask (runs are pure), or fails with NodeLostError with retry_lost=False;
each future settles once. Compiling routes each program by its hash to one
node, so nodes with separate cache directories still compile it once each
across repeated runs; with one shared directory (a shared filesystem) any
node can load what another compiled.

The modules: pool.py (ClusterPool), node.py (the Dask worker's side),
routing.py, futures.py (ClusterFuture, NodeLostError), run_once.py (the
retry_lost=False scheduler plugin), connect.py (clients: local_client,
connect).

Needs Dask's ``distributed``, which the ``cluster`` extra installs: without
it, importing this package raises MissingExtraError, saying how to install
the extra from where pjrt-pool came from (worker.extras).
"""

from __future__ import annotations

from worker.extras import Feature, import_for

import_for(Feature.CLUSTER)  # before the modules that import it: one error, naming the extra

from pool.cluster.connect import connect, local_client  # noqa: E402
from pool.cluster.futures import ClusterFuture, NodeLostError  # noqa: E402
from pool.cluster.node import PLUGIN_PREFIX, PoolPlugin  # noqa: E402
from pool.cluster.pool import ClusterPool  # noqa: E402

__all__ = [
    "PLUGIN_PREFIX",
    "ClusterFuture",
    "ClusterPool",
    "NodeLostError",
    "PoolPlugin",
    "connect",
    "local_client",
]
