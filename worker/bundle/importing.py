"""Importing a bundle into a disk cache: every member checked first, then each entry published.

Nothing is written until the whole bundle has passed: its structure and
index (reader.py: regular files with the bundle's names only, the members
the index lists and no others, the index's signature when a secret is set),
then every entry as a cache read checks it (its SHA-256 against the index,
its header and payload digests, its signature, that its key parts hash to
its key), and the sizes (no entry larger than the cache's bound, nor all of
them together). A damaged, truncated, oversized or hostile bundle thus
changes nothing. Then each entry is published as compiling publishes one
(a temporary file, fsync, an atomic rename), byte for byte, under the name
its checked key gives: never a path the bundle chose.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from worker.bundle.reader import Bundle
from worker.cache.entry import CorruptEntryError, UnreadableEntryError
from worker.cache.location import format_size
from worker.cache.store import DiskCache
from worker.errors import BundleError


@dataclass(frozen=True)
class ImportResult:
    """What importing did."""

    imported: int
    """Entries published."""
    present: int
    """Entries the cache held already (intact), left as they were."""
    not_stored: int
    """Entries the cache could not take (full, or it became unwritable)."""
    bytes: int
    """Bytes published."""


def import_bundle(path: str | os.PathLike[str], cache: DiskCache) -> ImportResult:
    """Checks a whole bundle, then publishes its entries into a cache; returns what it did.

    Raises BundleError (nothing written) for a bundle that fails any check,
    or that does not fit the cache's size bound; signing follows the cache's
    (PJRT_POOL_CACHE_SECRET or PJRT_POOL_CACHE_KEY_FILE).
    """
    if not cache.writable:
        raise BundleError(
            f"cannot import {os.fspath(path)}: the cache {cache.directory} cannot be written"
        )
    with Bundle(path, cache.signer) as bundle:
        keys = check_for_import(bundle, cache.max_size)
        imported = present = not_stored = written = 0
        for key in keys:
            if _intact(cache, key):
                present += 1
                continue
            # Read and checked again: the file may have changed since it was verified.
            data = bundle.entry_bytes(key, cache.max_size)
            if cache.publish_file(key, data):
                imported += 1
                written += len(data)
            else:
                not_stored += 1
    return ImportResult(imported, present, not_stored, written)


def check_for_import(bundle: Bundle, max_size: int) -> list[str]:
    """Checks every entry of an opened bundle as importing does; returns the keys, sorted.

    Raises BundleError for an entry that fails any check a cache read makes,
    or that does not fit a cache of max_size bytes (alone or with the rest).
    Reads the bundle only: a caller may check before a cache directory exists.
    """
    keys = sorted(bundle.index.entries)
    total = 0
    for key in keys:
        size = bundle.index.entries[key].size  # the member's, checked as the bundle opened
        if size > max_size:
            raise BundleError(
                f"{bundle.path}: entry {key} is {format_size(size)}, more than the cache's "
                f"size bound ({format_size(max_size)}); raise PJRT_POOL_CACHE_MAX_SIZE"
            )
        bundle.index.parts_of(key)  # the index's parts hash to the key
        bundle.entry(key, max_size)  # and it passes every check a cache read makes
        total += size
    if total > max_size:
        raise BundleError(
            f"{bundle.path}: its entries take {format_size(total)}, more than the cache's size "
            f"bound ({format_size(max_size)}); raise PJRT_POOL_CACHE_MAX_SIZE"
        )
    return keys


def _intact(cache: DiskCache, key: str) -> bool:
    try:
        return cache.read(key, touch=False) is not None
    except (CorruptEntryError, UnreadableEntryError):
        return False
