"""Which node runs a program: the nodes that hold it loaded, unless their queues are long.

A program's first run goes to its home node, picked by the hash of its
identity (so that every client sends it to the same node, whose Pool then
holds it loaded and whose cache holds its entry). Later runs go to the
least busy of the nodes it was sent to. When even that node has
`spread_at` runs of this client in flight and another node has at most
half as many, the run goes to that other node, which from then on holds
the program too: a program run thousands of times spreads over the
cluster, and many programs each stay on few nodes.

The choice is a loose hint to Dask (workers=[node], allow_other_workers),
so a lost or gone node never stalls a run: Dask places it elsewhere.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

ADDRESS_REFRESH_SECONDS = 1.0
"""How long the list of nodes is reused before the scheduler is asked again."""


def home_of(identity: str, addresses: list[str]) -> str:
    """The node a program's hash picks among sorted addresses (stable while they are)."""
    return addresses[int(identity[:16], 16) % len(addresses)]


class Router:
    """Routes runs (see the module docstring) and counts each node's runs in flight.

    addresses() returns the current nodes' addresses, sorted (a scheduler
    round trip); it is asked at most every ADDRESS_REFRESH_SECONDS, so that
    a small run does not pay a round trip to be routed.
    """

    def __init__(self, addresses: Callable[[], list[str]], spread_at: int) -> None:
        if not isinstance(spread_at, int) or isinstance(spread_at, bool) or spread_at < 1:
            raise ValueError(f"spread_at must be a positive number of runs, not {spread_at!r}")
        self._ask = addresses
        self.spread_at = spread_at
        self._addresses: list[str] = []
        self._asked = -float("inf")
        self._holders: dict[str, list[str]] = {}
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def addresses(self) -> list[str]:
        """The nodes' sorted addresses, asked again when the last answer is old."""
        now = time.monotonic()
        if now - self._asked > ADDRESS_REFRESH_SECONDS or not self._addresses:
            addresses = sorted(self._ask())
            if not addresses:
                raise RuntimeError("the Dask cluster has no workers")
            with self._lock:
                self._addresses, self._asked = addresses, now
        return self._addresses

    def choose(self, identity: str) -> str:
        """The node for one run of a program; counts the run in flight there until done()."""
        addresses = self.addresses()
        live = set(addresses)
        with self._lock:
            holders = [a for a in self._holders.get(identity, ()) if a in live]
            if not holders:
                holders = [home_of(identity, addresses)]
            load = self._in_flight
            best = min(holders, key=load.__getitem__)
            if load[best] >= self.spread_at:
                other = min(addresses, key=load.__getitem__)
                if load[other] * 2 <= load[best]:
                    holders.append(other)
                    best = other
            self._holders[identity] = holders
            load[best] += 1
        return best

    def done(self, address: str) -> None:
        """A run routed to `address` has ended."""
        with self._lock:
            self._in_flight[address] -= 1
            if self._in_flight[address] <= 0:
                del self._in_flight[address]

    def holders(self, identity: str) -> list[str]:
        """The nodes a program's runs were sent to, in the order they were added."""
        with self._lock:
            return list(self._holders.get(identity, ()))

    def in_flight(self) -> dict[str, int]:
        """Each node's runs in flight from this client."""
        with self._lock:
            return dict(self._in_flight)
