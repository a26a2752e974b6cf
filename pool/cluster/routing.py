"""Which node runs a program: the nodes that hold it loaded, unless their queues are long.

A program's first run goes to its home node, picked by the hash of its
identity (so that every client sends it to the same node, whose Pool then
holds it loaded and whose cache holds its entry). Later runs go to the
least busy of the nodes it was sent to. When even that node has
`spread_at` runs of this client in flight and another node has at most
half as many, the run goes to that other node, which from then on holds
the program too: a program run thousands of times spreads over the
cluster, and many programs each stay on few nodes.

On Dask the choice is a loose hint (workers=[node], allow_other_workers),
so a lost or gone node never stalls a run: Dask places it elsewhere. On Ray
it is the node's actor; a run whose node is lost is routed again, the node
forgotten.

A never-compile ClusterPool admits a node for a program before its first
run there (choose's admit: the node's Pool checks its cache). A program
its home refuses is refused (no other node starts a Pool just to refuse
it too); a node the spread rule picks that refuses it is never chosen for
it again, and its runs stay on the nodes that hold it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence

ADDRESS_REFRESH_SECONDS = 1.0
"""How long the list of nodes is reused before the scheduler is asked again."""


def home_of(identity: str, addresses: list[str]) -> str:
    """The node a program's hash picks among sorted addresses (stable while they are)."""
    return addresses[int(identity[:16], 16) % len(addresses)]


class Router:
    """Routes runs (see the module docstring) and counts each node's runs in flight.

    addresses() returns the current nodes' addresses, sorted (a round trip to
    the cluster); it is asked at most every ADDRESS_REFRESH_SECONDS, so that
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
        self._refused: dict[str, dict[str, BaseException]] = {}  # identity: node: why
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def addresses(self) -> list[str]:
        """The nodes' sorted addresses, asked again when the last answer is old."""
        now = time.monotonic()
        if now - self._asked > ADDRESS_REFRESH_SECONDS or not self._addresses:
            addresses = sorted(self._ask())
            if not addresses:
                raise RuntimeError("the cluster has no nodes that run programs")
            with self._lock:
                self._addresses, self._asked = addresses, now
        return self._addresses

    def choose(
        self, identity: str, admit: Callable[[str], BaseException | None] | None = None
    ) -> str:
        """The node for one run of a program; counts the run in flight there until done().

        With admit, a node new to the program is asked first (admit(node):
        None, or the exception that refuses the program there): a refusal
        raises when no node holds the program, and otherwise keeps its runs
        off that node (see the module docstring).
        """
        addresses = self.addresses()
        while True:
            with self._lock:
                best, holders = self._pick(identity, addresses)
                if admit is None or best in holders:
                    return self._take(identity, holders, best)
            refusal = admit(best)  # outside the lock: a round trip to the node
            with self._lock:
                holders = self._live_holders(identity, addresses)
                if refusal is None:
                    return self._take(identity, holders, best)
                if not holders:
                    raise refusal  # its home lacks it: no node is started just to refuse it
                self._refused.setdefault(identity, {})[best] = refusal

    def _pick(self, identity: str, addresses: Sequence[str]) -> tuple[str, list[str]]:
        """The node a run of the program goes to (see the module docstring), and the live
        nodes holding it; under the lock."""
        refused = self._refused.get(identity, {})
        candidates = [a for a in addresses if a not in refused]
        holders = self._live_holders(identity, addresses)
        if not holders:
            return home_of(identity, candidates or list(addresses)), holders
        load = self._in_flight
        best = min(holders, key=load.__getitem__)
        if load[best] >= self.spread_at and candidates:
            other = min(candidates, key=load.__getitem__)
            if load[other] * 2 <= load[best]:
                best = other
        return best, holders

    def _live_holders(self, identity: str, addresses: Sequence[str]) -> list[str]:
        live = set(addresses)
        return [a for a in self._holders.get(identity, ()) if a in live]

    def _take(self, identity: str, holders: list[str], best: str) -> str:
        """Counts a run in flight on `best`, which holds the program from now on; under the
        lock."""
        if best not in holders:
            holders = [*holders, best]
        self._holders[identity] = holders
        self._in_flight[best] += 1
        return best

    def pin(self, identity: str, address: str) -> str:
        """Counts a run in flight on `address`, where it must run (the node holding its
        kept values), which holds the program from now on; returns the address."""
        with self._lock:
            return self._take(identity, self._live_holders(identity, self._addresses), address)

    def forget(self, address: str) -> None:
        """A node was lost: the next choice asks for the nodes again, and no program is held
        there any longer (a node that comes back starts empty)."""
        with self._lock:
            self._asked = -float("inf")
            for holders in self._holders.values():
                if address in holders:
                    holders.remove(address)

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
