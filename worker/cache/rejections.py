"""Records of the entries a plugin refused to load, one per cause, for ``pjrt-pool cache info``.

Each is ``plugins/rejected-<digest>.json`` (the cause, the plugin, how many
times, first and last), kept with the cache's other records (memos.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from typing import Any

from worker.cache.memos import MemoStore

REJECTION_PREFIX = "rejected-"
"""How the records of entries a plugin refused are named in plugins/ (record_rejection)."""


def record_rejection(memos: MemoStore, cause: str, plugin: str | None = None) -> None:
    """Records that a plugin refused to load an entry, by cause (worker.compile.by_key).

    One record per cause in plugins/ (rejected-<digest>.json: the cause,
    the plugin, how many times, first and last), which ``pjrt-pool cache
    info`` lists. Two processes recording at once may lose one of their
    counts: the record says a refusal happens, and roughly how often. A
    cache it cannot write keeps no record.
    """
    name = f"{REJECTION_PREFIX}{hashlib.sha256(cause.encode()).hexdigest()[:24]}.json"
    now = time.time()
    found = memos.read(name) or {}
    count = found.get("count")
    record = {
        "cause": cause,
        "plugin": plugin,
        "count": (count if isinstance(count, int) and count >= 0 else 0) + 1,
        "first": found.get("first", now),
        "last": now,
    }
    with contextlib.suppress(OSError, ValueError):
        memos.write(name, record)


def recorded_rejections(memos: MemoStore) -> list[dict[str, Any]]:
    """The refusals record_rejection recorded, most recent first."""
    found = []
    for name in memos.names():
        if name.startswith(REJECTION_PREFIX):
            record = memos.read(name)
            if record is not None and isinstance(record.get("cause"), str):
                found.append(record)
    return sorted(found, key=lambda r: -r["last"] if _is_number(r.get("last")) else 0)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
