"""The disk cache in this process: format, keys, healing, eviction, degradation, counters.

Real-process behaviour (concurrency, killed writers, other plugin builds,
read-only and full disks) is in test_cache_concurrency.py.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from cache_helpers import CORRUPTIONS, corrupt, entries_size, lowered
from conftest import SECOND_PLUGIN

import worker
from worker.cache import (
    CacheUnavailableWarning,
    CorruptEntryError,
    DiskCache,
    default_cache_dir,
    explain_key,
    format_size,
    key_of,
    open_cache,
    parse_size,
    process_counters,
    space,
    store,
)
from worker.cache import entry as entry_format
from worker.cache.atomic import TEMP_PREFIX, PendingFile
from worker.cache.locking import try_acquire
from worker.identity import build as plugin_build
from worker.identity import environment, keys

X = [0.5, 1.0, 1.5, 2.0]


def expected(variant: int = 0) -> np.ndarray:
    scale = variant + 2.0
    return np.sin(np.array(X, np.float32)) * scale + scale


def compile_and_check(variant: int = 0, **options) -> worker.CompileStatistics:
    """Compiles (or loads) a test program and checks that it computes the right thing."""
    executable, statistics = worker.compile_program(lowered(variant), **options)
    np.testing.assert_allclose(executable.run([X])[0], expected(variant), rtol=1e-6)
    return statistics


def only_entry(cache_dir: Path) -> Path:
    (path,) = (cache_dir / "entries").glob("*.pjx")
    return path


def warnings_of(seen: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in seen if issubclass(w.category, CacheUnavailableWarning)]


# -- location, format and keys ------------------------------------------------


def test_directory_is_created_0700(tmp_path):
    cache = DiskCache(tmp_path / "new" / "cache")
    for folder in (cache.directory, cache.entries_dir, cache.locks_dir, cache.plugins_dir):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_location_argument_then_environment_then_user_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PJRT_POOL_CACHE_DIR", str(tmp_path / "from-env"))
    assert DiskCache(tmp_path / "from-arg").directory == tmp_path / "from-arg"
    assert DiskCache().directory == tmp_path / "from-env"
    monkeypatch.delenv("PJRT_POOL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "pjrt-pool"


def test_sizes_parse_and_format(monkeypatch, tmp_path):
    assert parse_size("1048576") == 1 << 20
    assert parse_size("500M") == 500 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("2k") == 2048
    for bad in ("", "-1", "12X", "M"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert format_size(1536) == "1.5 KiB"
    assert format_size(12) == "12 B"
    monkeypatch.setenv("PJRT_POOL_CACHE_MAX_SIZE", "64M")
    assert DiskCache(tmp_path).max_size == 64 << 20
    assert DiskCache(tmp_path, max_size="1G").max_size == 1 << 30


def test_invalid_size_in_the_environment_warns_once_and_uses_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("PJRT_POOL_CACHE_MAX_SIZE", "lots")
    cache = DiskCache(tmp_path)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert cache.max_size == cache.max_size == 4 << 30
    assert len(warnings_of(seen)) == 1


def test_entry_round_trip():
    parts = {"format": 1, "program_sha256": "ab"}
    key = key_of(parts)
    data = entry_format.encode(key, parts, {"name": "f"}, b"payload")
    entry = entry_format.decode(data, expected_key=key)
    assert (entry.key, entry.parts, entry.metadata, entry.payload) == (
        key,
        parts,
        {"name": "f"},
        b"payload",
    )
    assert b"pickle" not in data and data.startswith(b"PJRTPOOL")


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d[:10],
        lambda d: d[:-1],
        lambda d: d + b"x",
        lambda d: b"",
        lambda d: d[:20] + bytes([d[20] ^ 1]) + d[21:],
        lambda d: d[:-3] + bytes([d[-3] ^ 1]) + d[-2:],
        lambda d: b"NOTPJRTP" + d[8:],
    ],
    ids=["short", "truncated", "extra byte", "empty", "header flip", "payload flip", "magic"],
)
def test_every_damaged_entry_fails_verification(damage):
    data = entry_format.encode("k", {}, {}, b"some payload bytes")
    with pytest.raises(CorruptEntryError):
        entry_format.decode(damage(data), expected_key="k")


def test_an_entry_for_another_key_fails_verification():
    data = entry_format.encode("k1", {}, {}, b"x")
    with pytest.raises(CorruptEntryError, match="not k2"):
        entry_format.decode(data, expected_key="k2")


def test_key_parts_and_explain_key(cache_dir):
    runtime = worker.get_runtime("cpu")
    cache = open_cache(cache_dir)
    key, parts = worker.program_key(lowered(0), runtime, cache)
    assert key == key_of(parts)
    assert parts["platform"] == "cpu"
    assert parts["plugin"]["sha256"] == plugin_build._file_digest(runtime.location.path)
    assert parts["plugin"]["api_version"] == runtime.api_version
    assert parts["host"]["cpu_features"] == environment.host_cpu_features()
    # The options compile_program uses: those lower() recorded (jax.jit's), not the default.
    assert parts["compile_options"] == lowered(0).compile_options.hex()
    assert worker.program_key(lowered(0), runtime, cache, worker.compile_options())[0] != key
    other_key, _ = worker.program_key(lowered(1), runtime, cache)
    assert other_key != key

    text = explain_key(parts)
    assert f"key = {key}" in text
    assert f"plugin.sha256 = '{parts['plugin']['sha256']}'" in text
    assert "host.cpu_features" in text and "differs" not in text
    other = {**parts, "plugin": {**parts["plugin"], "sha256": "0" * 64}}
    assert key_of(other) != key
    marked = [line for line in explain_key(parts, other).splitlines() if "differs" in line]
    assert len(marked) == 1 and marked[0].startswith("plugin.sha256")
    assert keys.foreign_parts(other, parts) == ["plugin"]


def test_plugin_digest_is_memoized_by_path_size_and_mtime(tmp_path, monkeypatch):
    library = tmp_path / "plugin.so"
    library.write_bytes(b"a plugin")
    cache = DiskCache(tmp_path / "cache")
    memo = cache.memos
    first = plugin_build.plugin_digest(str(library), memo)
    assert len(list(cache.plugins_dir.iterdir())) == 1
    plugin_build._file_memo.clear()  # as a new process would: only the file memo is left

    def no_hashing(path):
        raise AssertionError("hashed again")

    monkeypatch.setattr(plugin_build, "_file_digest", no_hashing)
    assert plugin_build.plugin_digest(str(library), memo) == first
    monkeypatch.undo()
    library.write_bytes(b"another build")  # new size and mtime: hashed again
    assert plugin_build.plugin_digest(str(library), memo) != first


# -- compile_program with the cache ---------------------------------------------


def test_miss_then_hit_with_counters_and_debug_log(cache_dir, caplog):
    caplog.set_level(logging.DEBUG, logger="pjrt_pool.cache")
    before = process_counters()
    first = compile_and_check()
    assert (first.compiled, first.loaded) == (1, 0)
    assert "no entry" in caplog.text
    second = compile_and_check()
    assert (second.compiled, second.loaded) == (0, 1)
    counters = open_cache(cache_dir).counters
    assert (counters.hits, counters.misses, counters.corrupt) == (1, 1, 0)
    total = process_counters()
    assert (total.hits - before.hits, total.misses - before.misses) == (1, 1)
    assert "cache hit" in caplog.text


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_a_bad_entry_is_removed_recompiled_and_republished(cache_dir, caplog, how):
    compile_and_check(1)
    other = only_entry(cache_dir)
    foreign = other.read_bytes()
    other.unlink()
    compile_and_check(0)
    path = only_entry(cache_dir)
    other.write_bytes(foreign)  # another key's entry, for "foreign entry"
    corrupt(path, how, other)
    caplog.set_level(logging.DEBUG, logger="pjrt_pool.cache")
    before = open_cache(cache_dir).counters

    healed = compile_and_check(0)

    assert (healed.compiled, healed.loaded) == (1, 0)
    counters = open_cache(cache_dir).counters
    assert (counters.corrupt, counters.misses - before.misses, counters.hits) == (1, 1, 0)
    rejected = how in ("rejected payload", "foreign stamp")
    reason = "the plugin rejected the entry" if rejected else "corrupt entry"
    assert f"cache miss for jit__lambda ({path.stem}): {reason}" in caplog.text
    assert "removed the bad entry" in caplog.text
    entry, _ = open_cache(cache_dir).read(path.stem)  # republished and valid
    assert entry.parts["platform"] == "cpu"
    again = compile_and_check(0)
    assert (again.compiled, again.loaded) == (0, 1)
    assert open_cache(cache_dir).counters.corrupt == 1


@pytest.mark.parametrize("kind", ["symlink to /dev/zero", "fifo"])
def test_something_other_than_a_file_in_place_of_an_entry_is_not_read(cache_dir, kind):
    compile_and_check(0)
    path = only_entry(cache_dir)
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")  # reading it would never end
    healed = compile_and_check(0)
    assert healed.compiled == 1 and open_cache(cache_dir).counters.corrupt == 1
    assert stat.S_ISREG(path.lstat().st_mode)


def test_lock_files_are_never_deleted(cache_dir):
    compile_and_check(0)
    locks = {p.name: p.stat().st_ino for p in (cache_dir / "locks").iterdir()}
    corrupt(only_entry(cache_dir), "garbage")
    compile_and_check(0)  # healed under the key's lock
    cache = open_cache(cache_dir)
    cache.trim(max_size=0)
    cache.clear()
    after = {p.name: p.stat().st_ino for p in (cache_dir / "locks").iterdir()}
    assert set(locks) <= set(after)
    assert all(after[name] == inode for name, inode in locks.items())


def test_compile_without_the_disk_cache_writes_nothing(cache_dir):
    assert compile_and_check(0, disk_cache=False).compiled == 1
    assert compile_and_check(0, disk_cache=False).compiled == 1
    assert not list(cache_dir.glob("entries/*"))


def test_an_entry_over_the_bound_is_not_stored(cache_dir, caplog):
    caplog.set_level(logging.DEBUG, logger="pjrt_pool.cache")
    compile_and_check(0, max_size=1000)
    assert not list((cache_dir / "entries").glob("*.pjx"))
    assert "exceeds the cache bound" in caplog.text


# -- eviction and temporary files (no plugin needed) -----------------------------


def publish(cache: DiskCache, name: str, size: int, **options) -> str:
    parts = {"name": name}
    key = key_of(parts)
    assert cache.publish(key, parts, {}, os.urandom(size), **options)
    return key


def age(cache: DiskCache, key: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(cache.path_of(key), (then, then))


def test_publishing_never_passes_the_bound_and_evicts_least_recently_used(tmp_path):
    bound = 20_000
    cache = DiskCache(tmp_path, max_size=bound)
    sizes = np.random.default_rng(0).integers(500, 3000, 40)
    keys = []
    for index, size in enumerate(sizes):
        keys.append(publish(cache, f"e{index}", int(size)))
        assert entries_size(cache.entries_dir) <= bound
        assert cache.ledger.read().bytes >= entries_size(cache.entries_dir)
    assert cache.counters.evicted > 0
    survivors = {e.key for e in cache.list_entries()}
    # The newest entries survive: eviction went oldest first.
    assert keys[-1] in survivors and keys[0] not in survivors


def test_recently_read_entries_survive_eviction(tmp_path):
    cache = DiskCache(tmp_path, max_size=10_000)
    keys = [publish(cache, name, 2000) for name in "abcd"]
    for index, key in enumerate(keys):
        age(cache, key, 1000 - index)  # a oldest, d newest
    cache.read(keys[0])  # a is used again: touched, since its access time is old
    publish(cache, "e", 3000)  # needs room: evicts b (now the least recently used) first
    survivors = {e.key for e in cache.list_entries()}
    assert keys[0] in survivors and keys[1] not in survivors
    assert entries_size(cache.entries_dir) <= 10_000


def test_access_time_is_refreshed_at_most_once_per_interval(tmp_path):
    cache = DiskCache(tmp_path)
    key = publish(cache, "a", 100)
    before = cache.path_of(key).stat().st_mtime_ns
    cache.read(key)
    assert cache.path_of(key).stat().st_mtime_ns == before  # fresh: no metadata write
    age(cache, key, store.TOUCH_INTERVAL + 5)
    cache.read(key, touch=False)
    assert time.time() - cache.path_of(key).stat().st_mtime > store.TOUCH_INTERVAL
    cache.read(key)
    assert time.time() - cache.path_of(key).stat().st_mtime < 5


def test_a_lost_or_garbled_ledger_is_rebuilt_by_a_scan(tmp_path):
    cache = DiskCache(tmp_path, max_size=100_000)
    for name in "abc":
        publish(cache, name, 1000)
    cache.ledger.path.write_text("{not json")
    publish(cache, "d", 1000)
    assert cache.ledger.read().bytes == entries_size(cache.entries_dir)
    cache.ledger.path.unlink()
    publish(cache, "e", 1000)
    assert cache.ledger.read().bytes == entries_size(cache.entries_dir)


def test_trim_to_a_size_and_files_vanishing_underneath(tmp_path):
    cache = DiskCache(tmp_path)
    keys = [publish(cache, name, 1000) for name in "abcdef"]
    listed = cache.list_entries()
    cache.path_of(keys[0]).unlink()  # another process removed it meanwhile
    entries = cache.folder("entries")
    total, removed = space.evict(entries, listed, sum(e.size for e in listed), 3000)
    assert total <= 3000 and keys[0] not in {e.key for e in removed}
    result = cache.trim(max_size=2500)
    assert result.ran and result.total_after <= 2500
    assert entries_size(cache.entries_dir) <= 2500


PUBLISHER = """
import os, sys
from worker.cache import DiskCache, key_of
cache = DiskCache(sys.argv[1])
for i in range(int(sys.argv[2])):
    parts = {"name": f"published{i}"}
    assert cache.publish(key_of(parts), parts, {}, os.urandom(100))
"""


def test_a_scan_under_the_space_lock_counts_what_writers_commit_meanwhile(tmp_path):
    # A size bound rests on scans: a writer that finds the ledger over the bound
    # scans, evicts, and sets the ledger to what it counted. Another process
    # commits entries meanwhile. A scan that missed one (its rename moved it from
    # a name the listing had not reached to one it had passed) let writers
    # overfill the directory. Under the space lock, a scan counts what the
    # ledger accounts, to the byte, however many writers commit.
    cache = DiskCache(tmp_path)
    for i in range(1000):  # enough names that a listing takes several reads
        publish(cache, f"settled{i}", 100)
    publisher = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, str(tmp_path), "1500"], stderr=subprocess.PIPE
    )
    seen = []
    deadline = time.monotonic() + 120
    while publisher.poll() is None and time.monotonic() < deadline:
        lock = try_acquire(cache.locks_dir / "space.lock", 30)
        try:
            seen.append((space.scan(cache.folder("entries")).total, cache.ledger.read().bytes))
        finally:
            lock.release()
        time.sleep(0.05)  # leaves the writer the lock most of the time
    assert publisher.wait(timeout=10) == 0, publisher.stderr.read()
    assert len(seen) >= 10
    missed = [(counted, ledger) for counted, ledger in seen if counted != ledger]
    assert not missed, f"{len(missed)} of {len(seen)} scans differ from the ledger: {missed[:3]}"
    assert len(cache.list_entries()) == 2500


def test_trim_removes_stale_temporary_files_and_keeps_fresh_ones(tmp_path):
    cache = DiskCache(tmp_path)
    dead, alive = "d" * 64, "a" * 64
    stale = PendingFile(cache.path_of(dead), 500)
    fresh = PendingFile(cache.path_of(alive), 500)
    then = time.time() - space.TEMP_GRACE - 60
    os.utime(stale.temp, (then, then))
    assert not cache.list_entries()  # temporary files are not entries
    result = cache.trim()
    assert result.temp_removed == 1
    assert not stale.temp.exists() and fresh.temp.exists()
    fresh.commit(b"x" * 500)
    assert [e.key for e in cache.list_entries()] == [alive]
    assert not [p for p in cache.entries_dir.iterdir() if p.name.startswith(TEMP_PREFIX)]


def test_trim_is_a_try_lock(tmp_path):
    cache = DiskCache(tmp_path)

    held = try_acquire(cache.locks_dir / "space.lock", 0)
    try:
        assert not cache.trim().ran
    finally:
        held.release()
    assert cache.trim().ran


# -- degradation ----------------------------------------------------------------


def test_a_cache_path_that_is_a_file_degrades_to_no_cache_with_one_warning(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = compile_and_check(0, cache_dir=blocker)
        second = compile_and_check(1, cache_dir=blocker)
    assert first.compiled == second.compiled == 1
    assert len(warnings_of(seen)) == 1 and "cannot create cache directory" in warnings_of(seen)[0]


def test_a_full_disk_degrades_to_no_cache_with_one_warning(cache_dir, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("worker.cache.atomic.os.posix_fallocate", full)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert compile_and_check(0).compiled == 1
        assert compile_and_check(1).compiled == 1
    assert len(warnings_of(seen)) == 1 and "No space left" in warnings_of(seen)[0]
    counters = open_cache(cache_dir).counters
    assert counters.write_errors == 1
    assert not list((cache_dir / "entries").iterdir())  # no entry, no temporary file


@pytest.mark.skipif(SECOND_PLUGIN is None, reason="needs both CPU plugins installed")
def test_an_entry_loaded_by_key_built_by_another_plugin_build_is_left_where_it_is(cache_dir):
    """A manifest run by key (no program to compile again) may name an entry this process's
    plugin cannot load: another build's, another host's, another platform's (a TPU
    manifest run on a CPU machine). It is refused naming the part that differs, and left
    in the cache, which other hosts or platforms may share: never judged damaged."""
    from conftest import run_python

    from worker.compile.by_key import load_cached_executable
    from worker.errors import NotInCacheError

    built = run_python(
        """
        import jax
        from pool import lower
        from worker import compile_program
        program = lower(lambda x: x * 2, [jax.ShapeDtypeStruct((8, 8), "float32")])
        print(compile_program(program)[0].key)
        """,
        env={"PJRT_POOL_PLUGIN_CPU": SECOND_PLUGIN, "PJRT_POOL_CACHE_DIR": str(cache_dir)},
    )
    key = built.stdout.split()[-1]
    entry = cache_dir / "entries" / f"{key}.pjx"
    assert entry.exists()
    with pytest.raises(NotInCacheError, match=r"it was built elsewhere: .*plugin\.sha256"):
        load_cached_executable(key, cache_dir)
    assert entry.exists()
    assert open_cache(cache_dir).counters.corrupt == 0
