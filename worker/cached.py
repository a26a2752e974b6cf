"""Loading an executable from the disk cache by its key, without the program.

A production job that runs what `pjrt-pool warm` put in the cache knows each
program by its ProgramSpec (from the manifest), not by its StableHLO: this
loads the executable the spec's key names, with the input types recorded in
the entry, and needs no JAX.
"""

from __future__ import annotations

import os

from worker.cache import CorruptEntryError, open_cache
from worker.executable import Executable
from worker.records import ArrayType


class NotInCacheError(LookupError):
    """The disk cache holds no usable executable for a key."""


def load_cached_executable(key: str, cache_dir: str | os.PathLike[str] | None = None) -> Executable:
    """Returns the executable stored under `key`; raises NotInCacheError if there is none.

    A missing, corrupt or rejected entry raises NotInCacheError saying which,
    since without the program there is nothing to compile again: warm the
    cache again (or compile the program) to fill it.
    """
    cache = open_cache(cache_dir)
    try:
        found = cache.read(key)
    except CorruptEntryError as error:
        raise NotInCacheError(
            f"the cache entry {key} in {cache.directory} is corrupt ({error}); warm the cache again"
        ) from None
    if found is None:
        raise NotInCacheError(
            f"no executable with key {key} in {cache.directory}: warm the cache "
            "(pjrt-pool warm) with this plugin and cache directory first"
        )
    entry, _ = found
    executable = Executable.deserialize(entry.payload)
    inputs = entry.metadata.get("input_types")
    executable.input_types = None if inputs is None else tuple(map(ArrayType.from_json, inputs))
    executable.key = key
    cache.count("hits")
    return executable
