"""Compiling and running on a cluster: a pjrt-pool Pool on every node, on Dask or on Ray.

    client (this process)                     each node
    ─────────────────────                     ─────────
    ClusterPool (Dask) / RayClusterPool       NodePool (node_pool.py): a Pool of
      (ClusterPoolBase, core.py: the face       PJRT worker processes, started on
      of a Pool; checks, routing, figures,      first use, held by the engine: a
      closing, written once)                    Dask worker's PoolPlugin, a Ray
    route each task by its program  ──task──▶   node's actor (one per node)
      (routing.py: nodes holding it loaded,   task: pool.run / submit_spec /
       spread when their queues are long)       submit_compile → compiled, or loaded
    a future per task, settled once  ◀──────    from the node's (or a shared) cache;
      (a node's error: carried.py)              a plugin crash fails the task with
                                                the Pool's error, never the engine's
                                                process

A plugin crash kills a PJRT worker process inside the node's Pool, never
the Dask worker or the Ray actor: the task fails with the Pool's exception
(WorkerCrashedError, TaskTimeoutError, ProgramQuarantinedError), and the
node goes on serving. A lost node's tasks are run again elsewhere (runs are
pure), or fail with NodeLostError with retry_lost=False; each future settles
once. Compiling routes each program by its hash to one node, so nodes with
separate cache directories still compile it once each across repeated runs;
with one shared directory (a shared filesystem) any node can load what
another compiled.

The modules: core.py (ClusterPoolBase), options.py (every Pool option,
by its declaration), routing.py, carried.py (CarriedError, NodeLostError),
node_pool.py (the node's side); the engines: dask/ (ClusterPool, its
plugin and futures, local_client) and ray/ (RayClusterPool, its actors and
futures, LocalRayCluster).

Each engine is an extra: dask/ needs Dask's ``distributed`` (the
``cluster`` extra), ray/ needs ``ray`` (the ``ray`` extra). Without it, the
first use of one of its names raises MissingExtraError, saying how to
install the extra from where pjrt-pool came from (worker.extras).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.lazy_names import on_first_use

# Lazy: each engine's names import that engine (an extra), on first use.
if TYPE_CHECKING:
    from pool.cluster.carried import NodeLostError as NodeLostError
    from pool.cluster.dask.connect import connect as connect
    from pool.cluster.dask.connect import local_client as local_client
    from pool.cluster.dask.futures import ClusterFuture as ClusterFuture
    from pool.cluster.dask.node import PLUGIN_PREFIX as PLUGIN_PREFIX
    from pool.cluster.dask.node import PoolPlugin as PoolPlugin
    from pool.cluster.dask.pool import ClusterPool as ClusterPool
    from pool.cluster.ray.connect import connect_ray as connect_ray
    from pool.cluster.ray.local import LocalRayCluster as LocalRayCluster
    from pool.cluster.ray.pool import RayClusterPool as RayClusterPool

__getattr__, __dir__ = on_first_use(__name__)
