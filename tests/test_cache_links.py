"""Hard links planted at a lock file's or the ledger's name are never written through.

Whoever can write a cache directory can hard-link a lock file's or the
usage ledger's name to another file of the cache's user; a lock file is
fchmodded for a shared cache and the ledger is overwritten, so either would
change that other file (issue 29, 11). Real files, real hard links.
"""

from __future__ import annotations

import os
import stat

from worker.cache import DiskCache
from worker.identity.keys import key_of


def test_a_hard_linked_lock_file_is_not_used_nor_chmodded(tmp_path):
    cache = DiskCache(tmp_path / "cache", shared=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("private")
    victim.chmod(0o600)
    key = "ab" * 32
    os.link(victim, cache.locks_dir / f"{key}.lock")
    with cache.lock(key, timeout=0) as held:
        assert held is False  # compiling goes on unlocked, as for any lock it cannot have
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert victim.read_text() == "private"


def test_a_hard_linked_ledger_is_replaced_not_overwritten(tmp_path):
    cache = DiskCache(tmp_path / "cache")
    victim = tmp_path / "victim.txt"
    victim.write_text("years of work")
    os.link(victim, cache.directory / "usage.json")
    parts = {"program": "links"}
    assert cache.publish(key_of(parts), parts, {}, b"a payload")
    assert victim.read_text() == "years of work"
    ledger = cache.directory / "usage.json"
    assert os.stat(ledger).st_nlink == 1 and b'"bytes"' in ledger.read_bytes()
