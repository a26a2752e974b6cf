"""The remote cache tier as an option of the parent's objects (Pool, ClusterPool, load_manifest).

Checked where it is given, before any worker or node starts, as the workers
will parse it (worker.cache.remote.location): imports nothing of the tier's
client.
"""

from __future__ import annotations

from typing import Any, Literal

from worker.cache.remote.location import parse_remote


def check_remote(value: Any) -> str | Literal[False] | None:
    """Returns the remote cache tier's URL, checked as the workers will parse it, its store's
    client installed (else MissingExtraError); None (PJRT_POOL_CACHE_REMOTE decides) and
    False (no remote, whatever it says) as they are."""
    if value is None or value is False:
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"remote must be a URL such as 's3://bucket/prefix' or 'file:///dir', None (the "
            f"environment's) or False (none), not {type(value).__name__} {value!r}"
        )
    # ValueError: the scheme, or the URL's form; MissingExtraError: no client for the store.
    parse_remote(value).require_client()
    return value.strip()


def open_for_workers(remote: str | Literal[False] | None) -> None:
    """Opens, in this process, the remote tier a Pool's workers will use (remote: a checked
    URL, None for PJRT_POOL_CACHE_REMOTE, False for none), so that what would go wrong in
    every worker is said here, once, where the caller sees it (a worker's output is kept
    for crash reports): a setting the tier cannot use (ValueError), its store's client not
    installed (MissingExtraError), and records the workers would publish unsigned (a
    warning: hosts that require signatures never load them)."""
    from worker.cache.remote import open_remote  # only here: the tier's modules

    tier = open_remote(remote)
    if tier is not None:
        tier.warn_if_unsigned()
