"""The remote tier of the cache: entries shared by a fleet through an object store.

Behind the local disk cache (worker.cache): a local miss asks the remote, a
remote hit is verified and published into the local cache before it is
loaded, and a compile publishes to both. Modules, one job each: location.py
(the URL, read-only mode, time limits), client.py (ObjectClient: sized gets,
conditional puts, each under a deadline) with one backend per kind of store
behind it, object_store.py (obstore's: S3, GCS, Azure, http) and files.py (a
file:// remote, its conditional writes its own), and the records they share
in objects.py, layout.py (object names and records), signing_keys.py (Ed25519
signatures of records), verify.py (what a reader checks), lease.py (one
compile per key across hosts), tier.py (RemoteCache: lookups, publishes,
counters, switching off) and outcomes.py (what it reports: RemoteCounters,
Fetched, Published), transfer.py (prefetch and push of many entries at
once), eviction.py (collect: old records, then unreferenced blobs, then dead
leases). To compiling and loading by key a remote is one of the tiers
(worker.compile.tiers.RemoteTier: lookup, claim a lease, publish), and
worker.compile.entries loads what it fetches. Importing this package imports
no client library.
"""

from worker.cache.remote.eviction import CollectReport, collect
from worker.cache.remote.location import (
    DEADLINE_ENV,
    READ_ONLY_ENV,
    REMOTE_ENV,
    TIMEOUT_ENV,
    Limits,
    RemoteLocation,
    parse_remote,
)
from worker.cache.remote.outcomes import Fetched, Lookup, Published, RemoteCounters
from worker.cache.remote.signing_keys import (
    PRIVATE_KEY_FILE_ENV,
    PUBLIC_KEY_ENV,
    generate_private_key,
)
from worker.cache.remote.tier import (
    RemoteCache,
    RemoteCacheWarning,
    open_remote,
    remote_counters,
)
from worker.cache.remote.transfer import (
    CONCURRENCY_ENV,
    Moved,
    Prefetcher,
    TransferReport,
    prefetch,
    push,
    remote_keys,
)

__all__ = [
    "CONCURRENCY_ENV",
    "DEADLINE_ENV",
    "PRIVATE_KEY_FILE_ENV",
    "PUBLIC_KEY_ENV",
    "READ_ONLY_ENV",
    "REMOTE_ENV",
    "TIMEOUT_ENV",
    "CollectReport",
    "Fetched",
    "Limits",
    "Lookup",
    "Moved",
    "Prefetcher",
    "Published",
    "RemoteCache",
    "RemoteCacheWarning",
    "RemoteCounters",
    "RemoteLocation",
    "TransferReport",
    "collect",
    "generate_private_key",
    "open_remote",
    "parse_remote",
    "prefetch",
    "push",
    "remote_counters",
    "remote_keys",
]
