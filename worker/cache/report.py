"""What a cache directory holds, as plain data (for ``pjrt-pool cache``).

Nothing here loads a plugin or changes the cache: listing reads each
entry's header, checking reads and verifies whole entries (without touching
their access times). Loading entries with the plugin is the job of a child
process (worker.serve.entry_check), which reports with the statuses here.
"""

from __future__ import annotations

import os
from typing import Any

from worker.cache import space
from worker.cache.entry import CorruptEntryError, UnreadableEntryError
from worker.cache.folders import Folder
from worker.cache.store import DiskCache

UNREADABLE = "unreadable"
"""The status of an entry that exists but could not be read (not judged bad)."""
OTHER = "other plugin/host"
"""The status of an entry made by another plugin build or on another host: not loaded here
(it could not be used here), and not judged bad."""


def _count_files(folder: Folder | None, suffix: str) -> int:
    if folder is None:
        return 0
    try:
        with folder.listing() as listing:
            return sum(1 for item in listing if item.name.endswith(suffix))
    except OSError:
        return 0


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def info(cache: DiskCache) -> dict[str, Any]:
    """Returns a summary: where the cache is, how full, and what else lies there."""
    found = space.scan(cache.folder("entries"))
    entry_bytes = sum(e.size for e in found.entries)
    usage = cache.ledger.read()
    return {
        "directory": str(cache.directory),
        "exists": cache.directory.is_dir(),
        "writable": os.access(cache.directory, os.W_OK),
        "entries": len(found.entries),
        "entry_bytes": entry_bytes,
        "temp_files": found.temp_files,
        "temp_bytes": found.temp_bytes,
        "max_size": cache.max_size,
        "max_size_from": cache.max_size_source,
        "ledger_bytes": None if usage is None else usage.bytes,
        "lock_files": _count_files(cache.folder("locks"), ".lock"),
        "shared": cache.shared,
        "signing_key_id": None if cache.signer is None else cache.signer.key_id,
        "plugin_records": len(cache.memos.names()),
        "problem": cache.problem,
        "oldest_use": found.entries[0].mtime if found.entries else None,
        "newest_use": found.entries[-1].mtime if found.entries else None,
    }


def list_entries(cache: DiskCache) -> list[dict[str, Any]]:
    """Returns one record per entry, most recently used first, from its header.

    A header that fails verification gives a record with an "error" and no
    metadata (the payload is not read: use check_entries for that).
    """
    records = []
    for item in reversed(cache.list_entries()):
        record: dict[str, Any] = {"key": item.key, "size": item.size, "last_used": item.mtime}
        try:
            verified = cache.read_header(item.key)
        except FileNotFoundError:
            continue  # evicted or healed meanwhile
        except (OSError, CorruptEntryError) as error:
            record["error"] = str(error)
            records.append(record)
            continue
        # A header's digest matched, but anyone who can write the cache can make one:
        # take only fields of the types pjrt-pool writes.
        header = verified.fields
        metadata = _mapping(header.get("metadata"))
        parts = _mapping(header.get("parts"))
        plugin = _mapping(parts.get("plugin"))
        seconds = metadata.get("compile_seconds")
        created = metadata.get("created")
        record.update(
            name=_text(metadata.get("name")),
            platform=_text(parts.get("platform")),
            api_version=_text(plugin.get("api_version")),
            plugin_sha256=_text(plugin.get("sha256")),
            compile_seconds=seconds if _is_number(seconds) else None,
            created=created if _is_number(created) else None,
            signed=verified.mac is not None,
        )
        records.append(record)
    return records


def check_entries(cache: DiskCache) -> list[dict[str, Any]]:
    """Verifies every entry's header and payload digests and key.

    Returns records {"key", "size", "status": "ok", "bad" or "unreadable",
    "detail", "platform"}, least recently used first; entries that vanish
    meanwhile are left out. With signing on (a secret configured), an entry
    without the right signature is bad.
    """
    results = []
    for item in cache.list_entries():
        record: dict[str, Any] = {"key": item.key, "size": item.size, "platform": None}
        try:
            found = cache.read(item.key, touch=False)
        except CorruptEntryError as error:
            results.append({**record, "status": "bad", "detail": str(error)})
            continue
        except UnreadableEntryError as error:
            results.append({**record, "status": UNREADABLE, "detail": str(error)})
            continue
        if found is None:
            continue
        record["platform"] = _text(found[0].parts.get("platform"))
        results.append({**record, "status": "ok", "detail": ""})
    return results
