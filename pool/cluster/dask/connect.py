"""Clients for ClusterPool: one on a local cluster for trying things out, or one by address."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import distributed


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
