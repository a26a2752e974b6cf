"""Loading an executable from the disk cache by its key, without the program.

A production job that runs what `pjrt-pool warm` put in the cache knows each
program by its ProgramSpec (from the manifest), not by its StableHLO: this
loads the executable the spec's key names, with the input types recorded in
the entry, and needs no JAX. It reads the entry as compiling does
(worker.compile.entries), asks a remote when the local cache has no usable
entry (worker.compile.tiers.open_remote), and never compiles.
"""

from __future__ import annotations

import os
from typing import Literal

from worker.cache.open_caches import open_cache
from worker.compile.entries import Miss, load_entry, load_remote_entry, settle_miss
from worker.compile.executable import Executable
from worker.compile.tiers import open_remote
from worker.errors import NotInCacheError
from worker.identity.keys import check_key
from worker.identity.target import runtime_key_parts
from worker.plugin.runtime import get_runtime

__all__ = ["NotInCacheError", "load_cached_executable"]


def load_cached_executable(
    key: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    remote: str | Literal[False] | None = None,
    platform: str | None = None,
) -> Executable:
    """Returns the executable stored under `key`; raises NotInCacheError if there is none.

    A missing, corrupt, rejected, wrongly signed or unreadable entry, or one
    whose load killed an earlier process, raises NotInCacheError saying which
    (a bad entry is removed first, an unreadable one left alone), since
    without the program there is nothing to compile again: warm the cache
    again (or compile the program) to fill it. A key that is not a cache key
    (64 hex digits) raises InvalidKeyError, a ValueError, before any file is
    touched. remote (default PJRT_POOL_CACHE_REMOTE; False: none) is asked
    when the local cache has no usable entry (see worker.compile.entries.load_fetched).
    The executable takes the argument types its entry records. platform is
    the program's (ProgramSpec.platform): its plugin loads, if no plugin is
    loaded yet. An entry built for another platform, plugin build, host or
    topology than this process's raises NotInCacheError naming what differs,
    and stays where it is.
    """
    check_key(key)
    cache = open_cache(cache_dir)
    here = runtime_key_parts(get_runtime(platform), cache if cache.usable else None)
    loaded = load_entry(cache, key, here=here)
    settled = False
    tier = open_remote(remote) if isinstance(loaded, Miss) else None
    if isinstance(loaded, Miss) and tier is not None:
        with cache.lock(key):
            settle_miss(cache, key, loaded)
            settled = True
            loaded = load_remote_entry(cache if cache.usable else None, tier, key) or loaded
    if isinstance(loaded, Miss):
        if loaded.counter is None:
            where = f"{cache.directory} or {tier.location.shown}" if tier else cache.directory
            found = (
                "" if loaded.reason == "no entry" else f" for this plugin and host: {loaded.reason}"
            )
            raise NotInCacheError(
                f"no executable with key {key} in {where}{found}: warm the cache "
                "(pjrt-pool warm) with this plugin and cache directory first"
            )
        if not settled:
            with cache.lock(key):
                settle_miss(cache, key, loaded)
        raise NotInCacheError(
            f"the cache entry {key} in {cache.directory} cannot be used ({loaded.reason}); "
            "warm the cache again"
        )
    cache.count("hits")
    return loaded[0]
