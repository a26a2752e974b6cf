"""Entries whose payload pjrt-pool keeps but never loads: the values of JAX's own cache.

JAX's persistent cache (pool.jax_cache) files values under keys of its own.
Backed by pjrt-pool, each value is an entry of the disk cache and of the remote
tier like an executable's: one self-describing file, verified (and signed)
before it is read, published atomically, create-only on the remote; its key is
the key of parts that name the value's own key. What differs is that nothing
here loads the payload: it goes back to its owner as it was put.

On a miss, ``get`` claims the key while its caller makes the value (JAX
compiles it), then ``put`` publishes it and ends the claim (``release`` ends it
without a value): the key's lock in the disk cache, so that processes of one
host make it once, and its lease on the remote, so that hosts of a fleet make
it once; a process that finds the claim held waits for the holder's value (the
remote's lease length at most, then it makes its own). Runs in any process:
it imports neither JAX nor a plugin.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

from worker.cache import entry as entry_format
from worker.cache.location import DEFAULT_MAX_SIZE
from worker.identity.keys import key_of
from worker.log import get_logger

if TYPE_CHECKING:
    from worker.cache.remote import RemoteCache
    from worker.cache.store import DiskCache

logger = get_logger("pjrt_pool.cache")


class BlobStore:
    """The disk cache and remote tier (either may be absent) as a store of values."""

    def __init__(
        self,
        cache: DiskCache | None,
        remote: RemoteCache | None,
        lock_timeout: float | None = None,
    ) -> None:
        self.cache = cache if cache is not None and cache.usable else None
        self.remote = remote
        self.lock_timeout = lock_timeout
        self._claims: dict[str, contextlib.ExitStack] = {}
        self._claims_lock = threading.Lock()

    def _bound(self) -> int:
        return self.cache.max_size if self.cache is not None else DEFAULT_MAX_SIZE

    def _read(self, key: str) -> entry_format.Entry | None:
        if self.cache is None:
            return None
        try:
            found = self.cache.read(key)
        except entry_format.CorruptEntryError as error:
            logger.warning("removing a damaged entry %s: %s", key, error)
            self.cache.remove_if_unchanged(key, error.stat)
            return None
        except entry_format.UnreadableEntryError as error:
            logger.warning("%s", error)
            return None
        return None if found is None else found[0]

    def _fetched(self, key: str, fetched: tuple[bytes, entry_format.Entry] | None) -> bytes | None:
        if fetched is None:
            return None
        data, entry = fetched
        if self.cache is not None and self.cache.writable:
            self.cache.publish_file(key, data)
        return entry.payload

    def get(self, parts: dict[str, Any], claim: bool = True) -> bytes | None:
        """The value filed under these key parts: from the disk cache, else fetched from the
        remote (and kept in the disk cache); None on a miss. With claim, a miss holds the
        key (see the module) until put or release in this process."""
        key = key_of(parts)
        entry = self._read(key)
        if entry is not None:
            self.cache.count("hits")  # type: ignore[union-attr]
            return entry.payload
        if not claim:
            fetched = None if self.remote is None else self.remote.fetch(key, self._bound())
            return self._fetched(key, fetched)
        stack = contextlib.ExitStack()
        try:
            if self.cache is not None:
                stack.enter_context(self.cache.lock(key, self.lock_timeout))
                entry = self._read(key)  # made meanwhile by the process that held the lock
                if entry is not None:
                    stack.close()
                    self.cache.count("hits")
                    return entry.payload
                self.cache.count("misses")
            if self.remote is not None:
                value = self._fetched(key, self.remote.fetch_or_lead(key, self._bound()))
                if value is not None:
                    stack.close()
                    return value
                stack.callback(self.remote.release, key)
        except BaseException:
            stack.close()
            raise
        with self._claims_lock:
            previous = self._claims.pop(key, None)
            self._claims[key] = stack
        if previous is not None:
            previous.close()
        return None

    def put(self, parts: dict[str, Any], metadata: dict[str, Any], payload: bytes) -> None:
        """Files a value under these key parts in the disk cache and on the remote (create-only:
        one there already stays), and ends this process's claim of the key."""
        key = key_of(parts)
        try:
            signer = self.cache.signer if self.cache is not None else None
            data = entry_format.encode(key, parts, metadata, payload, signer)
            if self.cache is not None and self.cache.writable:
                self.cache.publish_file(key, data)
            if self.remote is not None:
                self.remote.publish(key, parts, data)
        finally:
            self._end_claim(key)

    def release(self, parts: dict[str, Any]) -> None:
        """Ends this process's claim of the key without a value (whoever waits makes it)."""
        self._end_claim(key_of(parts))

    def _end_claim(self, key: str) -> None:
        with self._claims_lock:
            stack = self._claims.pop(key, None)
        if stack is not None:
            stack.close()  # the remote's release after its publish changes nothing

    def close(self) -> None:
        """Ends every claim this process holds (at interpreter exit, or when uninstalled)."""
        with self._claims_lock:
            stacks, self._claims = list(self._claims.values()), {}
        for stack in stacks:
            stack.close()
