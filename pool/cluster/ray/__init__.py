"""The Ray engine of a ClusterPool: a NodeActor on every node, owning its NodePool.

pool.py (RayClusterPool), nodes.py (the cluster's nodes: which run, which
compile, which hold TPU chips; their actors), actor.py (NodeActor: the
node's side), futures.py (RayFuture: a task followed, sent again when its
node is lost), values.py (what kept values travel as), connect.py
(connect_ray), local.py (LocalRayCluster: `ray start` nodes on this machine).

Needs ``ray``, which the ``ray`` extra installs: without it, importing this
package raises MissingExtraError naming the extra.
"""

from __future__ import annotations

from worker.extras import Feature, import_for

import_for(Feature.RAY)  # before the modules that import it: one error, naming the extra
