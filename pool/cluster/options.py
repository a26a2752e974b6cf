"""A ClusterPool's options: every Pool option, applied on each node, and the cluster's own.

A ClusterPool (on Dask or on Ray) takes the options Pool takes, as their
declarations say (pool.executor.options.POOL_OPTIONS: name, type, default,
check), so that an option added to Pool is a ClusterPool's too, with the same
default and errors: its signature (cluster_signature) and the options
section of its docstring are made of the declarations, and node_options
checks what it was given with each option's own check. One name differs:
Pool's workers is workers_per_node, each node's Pool's workers.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from pool.executor.checks import check_flag, pickle_initializer
from pool.executor.options import POOL_OPTIONS, PoolOption, document

WORKERS_PER_NODE = "workers_per_node"
"""Pool's workers, as a ClusterPool calls it: the PJRT workers of each node's Pool."""


def _as_cluster_takes(option: PoolOption) -> PoolOption:
    """A Pool option as a ClusterPool takes it: workers renamed workers_per_node."""
    if option.name != "workers":
        return option
    doc = option.doc.replace("workers is", f"{WORKERS_PER_NODE} is each node's Pool's", 1)
    return dataclasses.replace(option, name=WORKERS_PER_NODE, doc=doc, positional=False)


NODE_OPTIONS: tuple[tuple[str, PoolOption], ...] = tuple(
    (option.name, _as_cluster_takes(option)) for option in POOL_OPTIONS
)
"""Each Pool option's name in Pool, and its declaration as a ClusterPool takes it."""


def node_options(given: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """The nodes' Pool options, by Pool's names: each checked here by its own check, in the
    declarations' order, errors naming it as `owner` takes it; those not given take their
    defaults. Raises TypeError for a keyword no option has.

    The nodes check them again as their Pools start, with what only a node
    can see (its cache directory, resolved there, and its trust; its plugin).
    """
    unknown = sorted(set(given) - {option.name for _, option in NODE_OPTIONS})
    if unknown:
        hint = f" (each node's worker count is {WORKERS_PER_NODE})" if "workers" in unknown else ""
        raise TypeError(f"{owner}() got unexpected keyword arguments {unknown}{hint}")
    options = {
        pool_name: option.checked(given.get(option.name, option.default))
        for pool_name, option in NODE_OPTIONS
    }
    if options["initializer"] is not None:
        pickle_initializer(options["initializer"], options["initargs"])  # it must reach the nodes
    return options


def check_cluster_options(retry_lost: Any, spread_at: Any) -> None:
    """Checks the cluster's own options (CLUSTER_OPTIONS)."""
    check_flag(retry_lost, "retry_lost")
    if spread_at is not None and (
        not isinstance(spread_at, int) or isinstance(spread_at, bool) or spread_at < 1
    ):
        raise ValueError(f"spread_at must be a positive number of runs, not {spread_at!r}")


CLUSTER_OPTIONS: tuple[inspect.Parameter, ...] = (
    inspect.Parameter(
        "retry_lost", inspect.Parameter.KEYWORD_ONLY, default=True, annotation="bool"
    ),
    inspect.Parameter(
        "spread_at", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="int | None"
    ),
)
"""A ClusterPool's options that are not a Pool's (see pool.cluster.core.ClusterPoolBase)."""


def cluster_signature(first: Sequence[inspect.Parameter]) -> inspect.Signature:
    """A ClusterPool constructor's signature: self, the engine's `first` parameters, each
    Pool option as a ClusterPool takes it (Pool's default and type), then CLUSTER_OPTIONS."""
    shared = [
        inspect.Parameter(
            option.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=option.default,
            annotation=option.annotation,
        )
        for _, option in NODE_OPTIONS
    ]
    self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.Signature([self, *first, *shared, *CLUSTER_OPTIONS])


def documented(summary: str, rest: str) -> str:
    """A ClusterPool's docstring: its summary, the Pool options' section (made of their
    declarations, as Pool's is: each applies on every node), then the rest."""
    options = document(tuple(option for _, option in NODE_OPTIONS))
    return "\n\n".join((summary, options, rest))
