"""Loading an executable from the disk cache by its key, without the program.

A production job that runs what `pjrt-pool warm` put in the cache knows each
program by its ProgramSpec (from the manifest), not by its StableHLO: this
loads the executable the spec's key names, with the input types recorded in
the entry, and needs no JAX.
"""

from __future__ import annotations

import os

from worker.cache import open_cache
from worker.compiler import Miss, load_entry, settle_miss
from worker.errors import NotInCacheError
from worker.executable import Executable
from worker.records import ArrayType

__all__ = ["NotInCacheError", "load_cached_executable"]


def load_cached_executable(key: str, cache_dir: str | os.PathLike[str] | None = None) -> Executable:
    """Returns the executable stored under `key`; raises NotInCacheError if there is none.

    A missing, corrupt, rejected, wrongly signed or unreadable entry, or one
    whose load killed an earlier process, raises NotInCacheError saying which
    (a bad entry is removed first, an unreadable one left alone), since
    without the program there is nothing to compile again: warm the cache
    again (or compile the program) to fill it.
    """
    cache = open_cache(cache_dir)
    loaded = load_entry(cache, key)
    if isinstance(loaded, Miss):
        if loaded.counter is None:
            raise NotInCacheError(
                f"no executable with key {key} in {cache.directory}: warm the cache "
                "(pjrt-pool warm) with this plugin and cache directory first"
            )
        with cache.lock(key):
            settle_miss(cache, key, loaded)
        raise NotInCacheError(
            f"the cache entry {key} in {cache.directory} cannot be used ({loaded.reason}); "
            "warm the cache again"
        )
    executable, entry = loaded
    inputs = entry.metadata.get("input_types")
    executable.input_types = None if inputs is None else tuple(map(ArrayType.from_json, inputs))
    cache.count("hits")
    return executable
