"""Who may write the cache directory, and never following symlinks inside it.

Real directories with real modes and owners, a real planted entry (another
program's machine code under a program's key), real symlinks, and a real Pool.
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

import numpy as np
import pytest
from cache_helpers import lowered, plant

import worker
from pool import Pool
from pool.cli.main import main as cli_main
from worker.cache import (
    CacheUnavailableWarning,
    DiskCache,
    UntrustedCacheError,
    check_cache_dir,
    open_cache,
)
from worker.identity.build import memoized_by_file

X = [0.5, 1.0, 1.5, 2.0]
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="changing a directory's owner needs root")


def expected(variant: int) -> np.ndarray:
    scale = variant + 2.0
    return np.sin(np.array(X, np.float32)) * scale + scale


def planted_cache(directory: Path) -> Path:
    """A cache directory holding, under program 0's key, program 1's executable."""
    other, _ = worker.compile_program(lowered(1), disk_cache=False)
    _, parts = worker.program_key(lowered(0), worker.get_runtime("cpu"), None)
    DiskCache(directory)  # the layout, made by this user
    plant(directory, parts, other.serialize(), {"input_types": None})
    return directory


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# -- the directory policy -----------------------------------------------------------


def test_a_world_writable_directory_with_a_planted_entry_is_refused(tmp_path):
    directory = planted_cache(tmp_path / "cache")
    directory.chmod(0o777)  # as if someone else had made it, or could write it

    with pytest.raises(UntrustedCacheError) as caught:
        worker.compile_program(lowered(0), cache_dir=directory)

    message = str(caught.value)
    assert str(directory) in message and "mode 0777" in message
    assert f"chmod o-w {directory}" in message
    # Once fixed, the planted entry is still a valid envelope: it is what the
    # directory policy keeps out. (A private directory trusts its owner.)
    directory.chmod(0o700)
    executable, _ = worker.compile_program(lowered(0), cache_dir=directory)
    assert not np.allclose(executable.run([X])[0], expected(0))


def test_a_symlink_to_an_untrusted_directory_is_refused_at_the_real_directory(tmp_path):
    directory = planted_cache(tmp_path / "cache")
    directory.chmod(0o777)
    link = tmp_path / "link"
    link.symlink_to(directory)

    with pytest.raises(UntrustedCacheError, match=str(directory)):
        worker.compile_program(lowered(0), cache_dir=link)
    with pytest.raises(UntrustedCacheError):
        check_cache_dir(link)


def test_a_symlink_to_a_trusted_directory_is_used_at_its_real_path(tmp_path):
    directory = tmp_path / "real"
    link = tmp_path / "link"
    DiskCache(directory)
    link.symlink_to(directory)
    executable, statistics = worker.compile_program(lowered(0), cache_dir=link)
    assert statistics.compiled == 1
    np.testing.assert_allclose(executable.run([X])[0], expected(0), rtol=1e-6)
    assert open_cache(link).directory == directory
    assert len(list((directory / "entries").glob("*.pjx"))) == 1


def test_a_pool_refuses_a_world_writable_cache_directory(tmp_path):
    directory = planted_cache(tmp_path / "cache")
    directory.chmod(0o777)
    # Refused as the pool starts (or, without that check, by its first compile).
    refused = pytest.raises(UntrustedCacheError, match="mode 0777")
    with refused, Pool(workers=1, cache_dir=directory) as pool:
        pool.run(lowered(0), [X])


def test_a_group_writable_directory_is_refused_unless_shared(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    DiskCache(directory)
    directory.chmod(0o770)
    with pytest.raises(UntrustedCacheError) as caught:
        DiskCache(directory)
    assert f"chmod 700 {directory}" in str(caught.value)
    assert "PJRT_POOL_CACHE_SHARED=1" in str(caught.value)

    monkeypatch.setenv("PJRT_POOL_CACHE_SHARED", "1")  # the group is root's own here
    assert DiskCache(directory).usable


def test_a_directory_under_the_cache_is_checked_too(tmp_path):
    directory = tmp_path / "cache"
    DiskCache(directory)
    (directory / "entries").chmod(0o777)
    with pytest.raises(UntrustedCacheError, match="entries"):
        DiskCache(directory)
    with pytest.raises(UntrustedCacheError, match="entries"):
        check_cache_dir(directory)


def test_an_ancestor_that_anyone_can_write_is_refused_unless_sticky(tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    with pytest.raises(UntrustedCacheError, match="replace the cache directory"):
        DiskCache(parent / "cache")
    parent.chmod(0o1777)  # like /tmp: others cannot rename what they do not own
    assert DiskCache(parent / "cache").usable


@as_root
def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    directory = tmp_path / "cache"
    DiskCache(directory)
    os.chown(directory, NOBODY, -1)
    with pytest.raises(UntrustedCacheError) as caught:
        worker.compile_program(lowered(0), cache_dir=directory)
    assert f"uid {NOBODY}" in str(caught.value) and "not by root" in str(caught.value)


@as_root
def test_a_shared_cache_trusts_only_its_own_group_and_never_everyone(tmp_path, monkeypatch):
    monkeypatch.setenv("PJRT_POOL_CACHE_SHARED", "1")
    directory = tmp_path / "cache"
    DiskCache(directory)
    os.chown(directory, NOBODY, os.getegid())  # another member of this process's group
    assert DiskCache(directory).usable

    os.chown(directory, os.geteuid(), NOBODY)  # a group this process is not in
    with pytest.raises(UntrustedCacheError, match="not in"):
        DiskCache(directory)

    os.chown(directory, os.geteuid(), os.getegid())
    directory.chmod(0o2777)
    with pytest.raises(UntrustedCacheError, match="never everyone"):
        DiskCache(directory)


def test_a_shared_cache_is_created_group_shared_whatever_the_umask(tmp_path, monkeypatch):
    monkeypatch.setenv("PJRT_POOL_CACHE_SHARED", "1")
    directory = tmp_path / "shared"
    previous = os.umask(0o077)
    try:
        worker.compile_program(lowered(0), cache_dir=directory)
    finally:
        os.umask(previous)
    for folder in (directory, directory / "entries", directory / "locks", directory / "loads"):
        assert mode_of(folder) == 0o2770, folder
    (entry,) = (directory / "entries").glob("*.pjx")
    assert mode_of(entry) == 0o660
    assert all(mode_of(lock) == 0o660 for lock in (directory / "locks").iterdir())


def test_the_shared_setting_must_be_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("PJRT_POOL_CACHE_SHARED", "maybe")
    with pytest.raises(ValueError, match="PJRT_POOL_CACHE_SHARED"):
        DiskCache(tmp_path / "cache")


def test_a_missing_directory_passes_the_pool_check(tmp_path):
    check_cache_dir(tmp_path / "not yet")
    assert not (tmp_path / "not yet").exists()


def test_the_cache_commands_refuse_an_untrusted_directory(tmp_path, capsys):
    directory = tmp_path / "cache"
    DiskCache(directory)
    directory.chmod(0o777)
    for command in ("info", "list", "verify", "clear"):
        extra = ["--yes"] if command == "clear" else []
        # An environment error, as for every command (issue 42): 2, in one line.
        assert cli_main(["cache", command, "--cache-dir", str(directory), *extra]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "mode 0777" in line and "chmod o-w" in line


# -- never through a symlink ---------------------------------------------------------


def test_a_symlinked_usage_ledger_is_never_written_through(tmp_path):
    cache = DiskCache(tmp_path / "cache")
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    (cache.directory / "usage.json").symlink_to(victim)

    cache.trim(max_size="1M")
    assert cache.publish("a" * 64, {}, {}, b"payload")  # reserving space writes the ledger too

    assert victim.read_text() == "keep me"
    ledger = cache.directory / "usage.json"  # replaced by a real ledger, the link removed
    assert not ledger.is_symlink() and b'"bytes"' in ledger.read_bytes()


def test_a_symlinked_memo_file_is_not_read(tmp_path):
    cache = DiskCache(tmp_path / "cache")
    memo_dir = cache.plugins_dir
    target = tmp_path / "target.bin"
    target.write_bytes(b"x")
    calls = []
    memoized_by_file(str(target), cache.memos, "kind", lambda: calls.append(1) or "real")
    (memo,) = memo_dir.iterdir()
    lie = tmp_path / "lie.json"
    lie.write_text(memo.read_text().replace('"real"', '"planted"'))
    memo.unlink()
    memo.symlink_to(lie)
    from worker.identity import build as cache_key

    cache_key._file_memo.clear()  # as in a new process
    assert memoized_by_file(str(target), cache.memos, "kind", lambda: "computed") == "computed"


def test_a_symlink_in_place_of_a_cache_folder_is_not_followed(tmp_path):
    directory = tmp_path / "cache"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    directory.mkdir(mode=0o700)
    (directory / "entries").symlink_to(elsewhere)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        executable, statistics = worker.compile_program(lowered(0), cache_dir=directory)
    assert statistics.compiled == 1
    np.testing.assert_allclose(executable.run([X])[0], expected(0), rtol=1e-6)
    assert list(elsewhere.iterdir()) == []
    assert any(issubclass(w.category, CacheUnavailableWarning) for w in seen)
