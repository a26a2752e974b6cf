"""The shared disk cache of compiled executables (see store.py for the design)."""

from worker.cache.entry import CorruptEntryError
from worker.cache.key import explain_key, key_of, key_parts
from worker.cache.location import (
    CACHE_DIR_ENV,
    DEFAULT_MAX_SIZE,
    MAX_SIZE_ENV,
    default_cache_dir,
    format_size,
    parse_size,
)
from worker.cache.store import (
    CacheCounters,
    CacheUnavailableWarning,
    DiskCache,
    EntryFile,
    TrimResult,
    open_cache,
    process_counters,
)

__all__ = [
    "CACHE_DIR_ENV",
    "DEFAULT_MAX_SIZE",
    "MAX_SIZE_ENV",
    "CacheCounters",
    "CacheUnavailableWarning",
    "CorruptEntryError",
    "DiskCache",
    "EntryFile",
    "TrimResult",
    "default_cache_dir",
    "explain_key",
    "format_size",
    "key_of",
    "key_parts",
    "open_cache",
    "parse_size",
    "process_counters",
]
