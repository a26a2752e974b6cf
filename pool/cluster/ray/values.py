"""What kept values travel as between a RayClusterPool and its nodes' actors.

A run given keep= leaves those outputs in its node's Pool, as DeviceValues
that the node's actor holds by an id of its own; the client gets a
KeptOnNode for each, and makes its own DeviceValue of it (owner: the
RayClusterPool; its record: the node's WorkerMemory mirror, whose loss says
the same as a Pool's worker's), which later calls name as Held(id). A
dropped handle's id goes to its node with the next call there.
"""

from __future__ import annotations

from typing import NamedTuple

from worker.records import ArrayType


class Held(NamedTuple):
    """A call's argument that is a value its node's actor holds."""

    id: int


class KeptOnNode(NamedTuple):
    """A run's output that stays in its node's actor (keep=): the id it holds it by."""

    id: int
    array_type: ArrayType
    nbytes: int
