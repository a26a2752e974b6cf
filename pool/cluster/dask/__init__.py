"""The Dask engine of a ClusterPool: a NodePool in each Dask worker (a WorkerPlugin).

pool.py (ClusterPool), node.py (the Dask worker's side), futures.py
(ClusterFuture, following a Dask future), run_once.py (the retry_lost=False
scheduler plugin), connect.py (clients: local_client, connect).

Needs Dask's ``distributed``, which the ``cluster`` extra installs: without
it, importing this package raises MissingExtraError naming the extra.
"""

from __future__ import annotations

from worker.extras import Feature, import_for

import_for(Feature.CLUSTER)  # before the modules that import it: one error, naming the extra
