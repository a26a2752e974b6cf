"""Connecting this process to a Ray cluster: by address, or to a local one started for it."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import ray

from pool.cluster.ray.local import LocalRayCluster

CONNECT_SECONDS = 10.0
"""How long connect_ray waits for a head to answer at its address before saying it does
not (ray.init itself retries for minutes)."""


def parse_local(address: str, option: str = "--ray") -> int | None:
    """N of "local:N" (default 2), or None for an address; ValueError for a bad N."""
    if not address.startswith("local"):
        return None
    word, _, count = address.partition(":")
    if word != "local":
        return None
    try:
        nodes = int(count or 2)
    except ValueError:
        raise ValueError(f"{option} local:N needs a number, not {count!r}") from None
    if nodes < 1:
        raise ValueError(f"{option} local:N needs at least one node, not {nodes}")
    return nodes


def check_reachable(address: str, timeout: float = CONNECT_SECONDS) -> None:
    """Raises ConnectionError, saying so, when nothing answers at a head's HOST:PORT within
    timeout (other forms, such as "auto" or "ray://...", are left to ray.init)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in host:
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as error:
        raise ConnectionError(
            f"no Ray head answers at {address} ({error}): start one there (ray start --head "
            f"--port={port}), or give the address `ray start --head` printed"
        ) from None


@contextlib.contextmanager
def connect_ray(address: str) -> Iterator[str]:
    """Connects this process to the Ray cluster at `address` (HOST:PORT of its head, or what
    ray.init takes) for the block, and yields the address; "local:N" starts a LocalRayCluster
    of N nodes for it, stopped after. A head that does not answer raises ConnectionError at
    once. A process already connected (ray.init) keeps its connection, and this leaves it."""
    nodes = parse_local(address)
    with contextlib.ExitStack() as stack:
        if nodes is not None:
            address = stack.enter_context(LocalRayCluster(nodes)).address
        if ray.is_initialized():
            yield address
            return
        check_reachable(address)
        options = {}
        host = address.rpartition(":")[0]
        if host.startswith("127."):  # a cluster on this machine's loopback (LocalRayCluster)
            # This process is on the cluster's machine: its node's address is the head's.
            # Ray would take this machine's outward address, which no node listens at.
            options["_node_ip_address"] = host
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, **options)
        stack.callback(ray.shutdown)
        yield address
