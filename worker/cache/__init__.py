"""The shared disk cache of compiled executables (see store.py for the design).

Runs in every process that compiles or loads (the workers, a user's process
in in-process use) and in ``pjrt-pool cache``; never imports JAX.
Modules, one job each: location.py (where, how large), trust.py (who may
write the directory), folders.py (the directories, held open and used
through their descriptors), entry.py (the file format), signing.py (signed
entries, and reading key files), memos.py (records about plugin builds in
``plugins/``, signed too), atomic.py (publishing files), locking.py (the
file locks), loads.py (markers that catch entries whose load kills a
process), space.py (the size bound and eviction), counters.py, warn_once.py
(a warning once per topic), store.py (DiskCache, tying them together),
report.py (inspection for ``pjrt-pool cache``; loading entries with the
plugin is worker.serve.entry_check's, in a child process). remote/ is the
remote tier behind this cache (an object store shared by a fleet); it uses
the modules here, and none of them uses it. What identifies an executable,
and the form of a key, is worker.identity's (key.py keeps the old import
path of explain_key and InvalidKeyError; the names below include the key's).

The names below are imported on first use (worker.lazy_names): a process
that only reads a bundle needs entry and signing, not the store's
locking, eviction and trust checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.lazy_names import on_first_use

if TYPE_CHECKING:
    from worker.cache.counters import CacheCounters
    from worker.cache.entry import CorruptEntryError, SignatureError, UnreadableEntryError
    from worker.cache.location import (
        CACHE_DIR_ENV,
        DEFAULT_MAX_SIZE,
        MAX_SIZE_ENV,
        default_cache_dir,
        format_size,
        parse_size,
    )
    from worker.cache.signing import KEY_FILE_ENV, SECRET_ENV, Signer, signer_from_environment
    from worker.cache.space import EntryFile
    from worker.cache.store import (
        CacheUnavailableWarning,
        DiskCache,
        TrimResult,
        open_cache,
        process_counters,
    )
    from worker.cache.trust import SHARED_ENV, UntrustedCacheError, check_cache_dir
    from worker.identity.keys import (
        InvalidKeyError,
        check_key,
        explain_key,
        is_key,
        key_of,
        key_parts,
    )

_MODULES = {
    "CacheCounters": "worker.cache.counters",
    "CorruptEntryError": "worker.cache.entry",
    "SignatureError": "worker.cache.entry",
    "UnreadableEntryError": "worker.cache.entry",
    "InvalidKeyError": "worker.identity.keys",
    "check_key": "worker.identity.keys",
    "explain_key": "worker.identity.keys",
    "is_key": "worker.identity.keys",
    "key_of": "worker.identity.keys",
    "key_parts": "worker.identity.keys",
    "CACHE_DIR_ENV": "worker.cache.location",
    "DEFAULT_MAX_SIZE": "worker.cache.location",
    "MAX_SIZE_ENV": "worker.cache.location",
    "default_cache_dir": "worker.cache.location",
    "format_size": "worker.cache.location",
    "parse_size": "worker.cache.location",
    "KEY_FILE_ENV": "worker.cache.signing",
    "SECRET_ENV": "worker.cache.signing",
    "Signer": "worker.cache.signing",
    "signer_from_environment": "worker.cache.signing",
    "EntryFile": "worker.cache.space",
    "CacheUnavailableWarning": "worker.cache.store",
    "DiskCache": "worker.cache.store",
    "TrimResult": "worker.cache.store",
    "open_cache": "worker.cache.store",
    "process_counters": "worker.cache.store",
    "SHARED_ENV": "worker.cache.trust",
    "UntrustedCacheError": "worker.cache.trust",
    "check_cache_dir": "worker.cache.trust",
}

__getattr__, __dir__ = on_first_use(__name__, _MODULES)

__all__ = [
    "CACHE_DIR_ENV",
    "DEFAULT_MAX_SIZE",
    "KEY_FILE_ENV",
    "MAX_SIZE_ENV",
    "SECRET_ENV",
    "SHARED_ENV",
    "CacheCounters",
    "CacheUnavailableWarning",
    "CorruptEntryError",
    "DiskCache",
    "EntryFile",
    "InvalidKeyError",
    "SignatureError",
    "Signer",
    "TrimResult",
    "UnreadableEntryError",
    "UntrustedCacheError",
    "check_cache_dir",
    "check_key",
    "default_cache_dir",
    "explain_key",
    "format_size",
    "is_key",
    "key_of",
    "key_parts",
    "open_cache",
    "parse_size",
    "process_counters",
    "signer_from_environment",
]
