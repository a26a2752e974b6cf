"""The tiers compile_program walks for an executable: the disk cache, then a remote.

Each tier answers the same three questions (Tier)::

    lookup(key)    its executable, loaded through the target, or None (a miss of any kind)
    claim(key)     hold the key while this process compiles it, having waited for the
                   process that held it; its executable if that one published it, else None
    publish(entry) store what this process compiled, if the tier takes it

DiskTier is the disk cache (worker.cache.store): its claim is the key's lock,
under which the entry is judged again and a bad one removed. RemoteTier is
a remote (worker.cache.remote): a lookup fetches into the disk cache when
there is one, and its claim is the key's lease across hosts, or a wait for
the host that holds it. Each counts and logs its own hits; Tiers holds one
compile's tiers, nearest first. The remote's modules are imported in one
place, open_remote, when a remote is first asked for: by compile_program on
its first call, by loading by key only after a local miss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

from worker.cache import entry as entry_format
from worker.cache.signing import signer_from_environment
from worker.compile.entries import Miss, fetch_bound, load_entry, load_fetched, settle_miss
from worker.log import get_logger
from worker.phases import Phases

if TYPE_CHECKING:
    from worker.cache.remote import RemoteCache
    from worker.cache.signing import Signer
    from worker.cache.store import DiskCache
    from worker.compile.executable import Executable
    from worker.compile.target import Target
    from worker.records import ArrayType

logger = get_logger("pjrt_pool.cache")


def open_remote(remote: str | Literal[False] | None) -> RemoteCache | None:
    """This process's remote for a URL (None: PJRT_POOL_CACHE_REMOTE; False: none), or None.

    The one place compiling and loading by key open a remote
    (worker.cache.remote.open_remote): its modules are imported here, when
    one is first asked for, so that a process that only loads from its disk
    cache never imports them.
    """
    from worker.cache.remote import open_remote as open_location

    return open_location(remote)


class Loading(NamedTuple):
    """What one compile's tiers load executables for."""

    name: str
    """The program's name, for messages."""
    input_types: tuple[ArrayType, ...] | None
    """The argument types the program takes (None: unknown), which what is loaded takes."""
    target: Target
    """What the program is compiled for, through which entries are loaded."""
    phases: Phases
    """The compile's phases, which the tiers' lookups, waits and publishes add to."""


@dataclasses.dataclass(eq=False)
class NewEntry:
    """What this process compiled, as the tiers publish it.

    Its entry file (data) is made when a tier first asks for it: serializing
    costs, and where no tier takes the entry it is never made.
    """

    key: str
    parts: dict[str, Any]
    """The key's parts, which the entry records."""
    metadata: dict[str, Any]
    """What else the entry records (types, compile seconds, for people)."""
    executable: Executable
    signer: Callable[[], Signer | None]
    """Who signs the entry (asked only when it is made)."""
    phases: Phases
    """The compile's phases, to which making the entry adds "serialize"."""

    @functools.cached_property
    def data(self) -> bytes:
        """The entry file: the serialized executable under its key, parts and metadata."""
        with self.phases.time("serialize"):
            payload = self.executable.serialize()
        return entry_format.encode(self.key, self.parts, self.metadata, payload, self.signer())

    @property
    def made(self) -> bool:
        """Whether the entry file has been made (a tier took the entry)."""
        return "data" in self.__dict__


class Tier(Protocol):
    """A place executables are kept, nearest first (see the module)."""

    outcome: str
    """What a compile that found its executable here records ("loaded", "fetched")."""

    def lookup(self, key: str) -> Executable | None:
        """The key's executable, loaded through the target; None for a miss of any kind."""

    def claim(self, key: str) -> contextlib.AbstractContextManager[Executable | None]:
        """Holds the key while the caller goes on (to the next tier, then compiling), having
        waited for whoever held it; gives the key's executable if it is there now."""

    def publish(self, entry: NewEntry) -> None:
        """Stores what this process compiled, if this tier takes it."""


class DiskTier:
    """The disk cache as a tier: its claim is the key's lock (see worker.compile.compiler)."""

    outcome = "loaded"

    def __init__(
        self,
        cache: DiskCache,
        loading: Loading,
        lock_timeout: float | None,
        max_size: int | None,
    ) -> None:
        self.cache = cache
        self.loading = loading
        self.lock_timeout = lock_timeout
        self.max_size = max_size
        self.miss: Miss | None = None
        """What the last lookup found instead of an executable."""

    def lookup(self, key: str) -> Executable | None:
        """The key's executable from its entry (counted as a hit), or None (self.miss says why)."""
        with self.loading.phases.time("lookup"):
            loaded = load_entry(self.cache, key, self.loading.target, self.loading.input_types)
        if isinstance(loaded, Miss):
            self.miss = loaded
            return None
        self.cache.count("hits")
        logger.debug("cache hit for %s (%s)", self.loading.name, key)
        return loaded[0]

    @contextlib.contextmanager
    def claim(self, key: str) -> Iterator[Executable | None]:
        """Holds the key's lock (or goes on without it after the lock timeout), and judges the
        entry again under it: another process may have published it meanwhile, or healed a
        bad one. A miss is settled (counted, logged, a bad entry removed)."""
        waiting = time.perf_counter()
        with self.cache.lock(key, self.lock_timeout):
            self.loading.phases.add("lock_wait", time.perf_counter() - waiting)
            executable = self.lookup(key)
            if executable is None:
                assert self.miss is not None
                settle_miss(self.cache, key, self.miss, self.loading.name)
            yield executable

    @property
    def takes_entry(self) -> bool:
        """False when the last lookup found an entry it could not read (left alone)."""
        return self.miss is None or self.miss.publish

    def publish(self, entry: NewEntry) -> None:
        """Publishes the entry into the cache, when the cache is writable and takes it."""
        if not (self.cache.writable and self.takes_entry):
            return
        data = entry.data
        with self.loading.phases.time("publish"):
            self.cache.publish_file(entry.key, data, self.max_size)


class RemoteTier:
    """A remote as a tier: its claim is the key's lease across hosts (worker.cache.remote)."""

    outcome = "fetched"

    def __init__(self, remote: RemoteCache, cache: DiskCache | None, loading: Loading) -> None:
        self.remote = remote
        self.cache = cache
        """The disk cache a fetched entry is published into and loaded from (None: none)."""
        self.loading = loading
        self._missed = False

    def lookup(self, key: str) -> Executable | None:
        """The key's executable fetched (into the disk cache, if any) and loaded, or None."""
        with self.loading.phases.time("remote"):
            found = self.remote.lookup(key, fetch_bound(self.cache))
            self._missed = found.missed
            hit = found.data is not None and found.entry is not None
            return self._load(key, (found.data, found.entry) if hit else None)

    @contextlib.contextmanager
    def claim(self, key: str) -> Iterator[Executable | None]:
        """After a plain miss (not a refusal or a failure): takes the key's lease, or waits for
        the host that holds it and fetches what it published. A lease is ended by
        publishing, or here if the caller fails (the hosts waiting then compile)."""
        executable = None
        if self._missed:
            with self.loading.phases.time("remote"):
                executable = self._load(key, self.remote.lead(key, fetch_bound(self.cache)))
        try:
            yield executable
        except BaseException:
            self.remote.release(key)
            raise

    def _load(self, key: str, fetched: tuple[bytes, Any] | None) -> Executable | None:
        if fetched is None:
            return None
        loaded = load_fetched(
            self.cache, self.remote, key, fetched, self.loading.target, self.loading.input_types
        )
        if loaded is None:
            return None
        logger.debug("remote cache hit for %s (%s)", self.loading.name, key)
        return loaded[0]

    def publish(self, entry: NewEntry) -> None:
        """Publishes the entry to the remote (which ends this process's lease of the key);
        where the remote takes nothing and no other tier made the entry file, nothing."""
        if self.remote.state != "on" and not entry.made:
            return
        with self.loading.phases.time("remote"):
            self.remote.publish(entry.key, entry.parts, entry.data)


class Tiers(NamedTuple):
    """One compile's tiers (either may be absent)."""

    disk: DiskTier | None
    remote: RemoteTier | None

    @property
    def order(self) -> list[Tier]:
        """The tiers, nearest first: the disk cache, then the remote."""
        return [tier for tier in (self.disk, self.remote) if tier is not None]

    def missed(self) -> None:
        """Counts a miss in the disk cache (the remote counts its own as it looks)."""
        if self.disk is not None:
            self.disk.cache.count("misses")

    def signer(self) -> Signer | None:
        """Who signs this process's entry: the disk cache's signer where the cache takes it,
        else the one the environment configures."""
        if self.disk is not None and self.disk.takes_entry:
            return self.disk.cache.signer
        return signer_from_environment()


def open_tiers(
    cache: DiskCache | None,
    remote: RemoteCache | None,
    loading: Loading,
    lock_timeout: float | None,
    max_size: int | None,
) -> Tiers:
    """The tiers of one compile: the disk cache (None: none), then the remote (None: none)."""
    return Tiers(
        None if cache is None else DiskTier(cache, loading, lock_timeout, max_size),
        None if remote is None else RemoteTier(remote, cache, loading),
    )
