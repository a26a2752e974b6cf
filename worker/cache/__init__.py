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
(a warning once per topic, and CacheUnavailableWarning), rejections.py (records of entries a plugin
refused), store.py (DiskCache, tying them together), open_caches.py (this
process's DiskCache per directory: open_cache), blobs.py (values kept for
another program's cache, never loaded here: JAX's own), jax_values.py (the
format of JAX's cache values), report.py (inspection for
``pjrt-pool cache``; loading entries with the plugin is
worker.serve.entry_check's, in a child process). remote/ is the
remote tier behind this cache (an object store shared by a fleet); it uses
the modules here, and none of them uses it. What identifies an executable,
and the form of a key, is worker.identity's (the names below include the key's).

The names below are imported on first use (worker.lazy_names, which reads
them from the TYPE_CHECKING block): a process that only reads a bundle
needs entry and signing, not the store's locking, eviction and trust checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.lazy_names import on_first_use

if TYPE_CHECKING:
    from worker.cache.counters import CacheCounters as CacheCounters
    from worker.cache.entry import CorruptEntryError as CorruptEntryError
    from worker.cache.entry import SignatureError as SignatureError
    from worker.cache.entry import UnreadableEntryError as UnreadableEntryError
    from worker.cache.location import CACHE_DIR_ENV as CACHE_DIR_ENV
    from worker.cache.location import DEFAULT_MAX_SIZE as DEFAULT_MAX_SIZE
    from worker.cache.location import MAX_SIZE_ENV as MAX_SIZE_ENV
    from worker.cache.location import default_cache_dir as default_cache_dir
    from worker.cache.location import format_size as format_size
    from worker.cache.location import parse_size as parse_size
    from worker.cache.open_caches import open_cache as open_cache
    from worker.cache.open_caches import process_counters as process_counters
    from worker.cache.signing import KEY_FILE_ENV as KEY_FILE_ENV
    from worker.cache.signing import SECRET_ENV as SECRET_ENV
    from worker.cache.signing import Signer as Signer
    from worker.cache.signing import signer_from_environment as signer_from_environment
    from worker.cache.space import EntryFile as EntryFile
    from worker.cache.space import TrimResult as TrimResult
    from worker.cache.store import DiskCache as DiskCache
    from worker.cache.trust import SHARED_ENV as SHARED_ENV
    from worker.cache.trust import UntrustedCacheError as UntrustedCacheError
    from worker.cache.trust import check_cache_dir as check_cache_dir
    from worker.cache.warn_once import CacheUnavailableWarning as CacheUnavailableWarning
    from worker.identity.keys import InvalidKeyError as InvalidKeyError
    from worker.identity.keys import check_key as check_key
    from worker.identity.keys import explain_key as explain_key
    from worker.identity.keys import is_key as is_key
    from worker.identity.keys import key_of as key_of
    from worker.identity.keys import key_parts as key_parts

__getattr__, __dir__ = on_first_use(__name__)
