"""``pjrt-pool cache info | list | verify [--load] | prune | clear``, and the CLI's frame."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cache_helpers import corrupt, entries_size, lowered

import pool.cli.cache
import worker
from pool.cli.main import main
from pool.spawn import child_environment
from worker.cache import DiskCache, entry, key_of


@pytest.fixture
def populated(cache_dir):
    """A cache with three entries, compiled in this process."""
    for variant in range(3):
        executable, _ = worker.compile_program(lowered(variant))
        assert np.isfinite(executable.run([np.ones(4, np.float32)])[0]).all()
    return cache_dir


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, _ = cli(capsys, *argv, "--json")
    return code, json.loads(out)


def keys(cache_dir) -> list[str]:
    return sorted(p.stem for p in (cache_dir / "entries").glob("*.pjx"))


def forge(cache_dir, source_key: str, **changes) -> str:
    """Copies an entry under the key of changed parts (a valid envelope); returns that key."""
    found = DiskCache(cache_dir).read(source_key, touch=False)[0]
    parts = json.loads(json.dumps(found.parts))
    for path, value in changes.items():
        *outer, last = path.split("__")
        target = parts
        for name in outer:
            target = target[name]
        target[last] = value
    key = key_of(parts)
    data = entry.encode(key, parts, found.metadata, found.payload)
    (cache_dir / "entries" / f"{key}.pjx").write_bytes(data)
    return key


def test_usage_errors_exit_2(capsys, populated):
    assert cli(capsys)[0] == 2
    assert cli(capsys, "cache")[0] == 2
    assert cli(capsys, "cache", "frobnicate")[0] == 2
    code, _, err = cli(capsys, "cache", "prune", "--max-size", "lots")
    assert code == 2 and "not a size" in err
    assert cli(capsys, "cache", "prune")[0] == 2  # --max-size is required
    assert cli(capsys, "--help")[0] == 0


def test_info(capsys, populated, monkeypatch):
    monkeypatch.setenv("PJRT_POOL_CACHE_MAX_SIZE", "64M")
    code, document = cli_json(capsys, "cache", "info")
    assert code == 0
    assert document["directory"] == str(populated) and document["exists"]
    assert document["entries"] == 3
    assert document["entry_bytes"] == entries_size(populated / "entries")
    assert document["max_size"] == 64 << 20
    assert document["max_size_from"] == "PJRT_POOL_CACHE_MAX_SIZE"
    assert document["lock_files"] >= 3
    code, out, _ = cli(capsys, "cache", "info")
    assert code == 0 and str(populated) in out and "64.0 MiB" in out


def test_a_missing_directory_is_reported_and_not_created(capsys, tmp_path):
    missing = tmp_path / "nothing-here"
    code, document = cli_json(capsys, "cache", "info", "--cache-dir", str(missing))
    assert code == 0 and not document["exists"] and document["entries"] == 0
    assert cli(capsys, "cache", "list", "--cache-dir", str(missing))[0] == 0
    assert cli(capsys, "cache", "verify", "--cache-dir", str(missing))[0] == 0
    assert not missing.exists()


def test_list(capsys, populated):
    code, document = cli_json(capsys, "cache", "list", "--cache-dir", str(populated))
    assert code == 0
    assert sorted(record["key"] for record in document["entries"]) == keys(populated)
    record = document["entries"][0]
    assert record["name"] == "jit__lambda" and record["platform"] == "cpu"
    assert record["api_version"] == worker.get_runtime().api_version
    code, out, _ = cli(capsys, "cache", "list")
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["KEY", "SIZE", "LAST"]
    assert all(any(line.startswith(key[:16]) for line in lines) for key in keys(populated))
    assert lines[-1].startswith("3 entries")


def test_verify_reports_bad_entries_and_exits_1(capsys, populated):
    assert cli(capsys, "cache", "verify")[0] == 0
    bad, good = keys(populated)[0], keys(populated)[1:]
    corrupt(populated / "entries" / f"{bad}.pjx", "payload bit flip")

    code, document = cli_json(capsys, "cache", "verify")

    assert code == 1
    assert (document["ok"], document["bad"], document["other"]) == (2, 1, 0)
    statuses = {record["key"]: record["status"] for record in document["entries"]}
    assert statuses[bad] == "bad" and all(statuses[key] == "ok" for key in good)
    code, out, _ = cli(capsys, "cache", "verify")
    assert code == 1 and "payload digest mismatch" in out and "1 bad" in out
    assert (populated / "entries" / f"{bad}.pjx").exists()  # verify only reports


def test_verify_load_finds_what_only_the_plugin_rejects(capsys, populated):
    rejected, first, second = keys(populated)
    corrupt(populated / "entries" / f"{rejected}.pjx", "rejected payload")
    other_build = forge(populated, first, plugin__sha256="0" * 64)
    other_platform = forge(populated, second, platform="nosuchplatform")
    assert cli(capsys, "cache", "verify")[0] == 0  # the digests are fine

    code, document = cli_json(capsys, "cache", "verify", "--load")

    assert code == 1
    by_key = {record["key"]: record for record in document["entries"]}
    assert by_key[rejected]["status"] == "bad"
    assert "rejected by the plugin" in by_key[rejected]["detail"]
    assert by_key[other_build]["status"] == "other plugin/host"
    assert by_key[other_platform]["status"] == "other plugin/host"
    assert "nosuchplatform" in by_key[other_platform]["detail"]
    assert (document["ok"], document["bad"], document["other"]) == (2, 1, 2)


FAKE_VERIFIER = r"""
import json, os, signal, sys
keys = sys.stdin.read().split()
print(json.dumps({"runtime": {}}), flush=True)
for key in keys:
    print(json.dumps({"checking": key}), flush=True)
    if key == os.environ["POISON"]:
        os.kill(os.getpid(), signal.SIGSEGV)
    print(json.dumps({"key": key, "status": "ok", "detail": ""}), flush=True)
"""


def test_verify_load_survives_an_entry_that_crashes_the_plugin(capsys, populated, monkeypatch):
    poison = keys(populated)[1]
    monkeypatch.setenv("POISON", poison)
    monkeypatch.setattr(
        pool.cli.cache, "python_command", lambda module, *a: [sys.executable, "-c", FAKE_VERIFIER]
    )
    code, document = cli_json(capsys, "cache", "verify", "--load")
    assert code == 1
    by_key = {record["key"]: record for record in document["entries"]}
    assert by_key[poison]["status"] == "bad" and "SIGSEGV" in by_key[poison]["detail"]
    assert [by_key[k]["status"] for k in keys(populated) if k != poison] == ["ok", "ok"]


def test_prune(capsys, populated):
    entries = sorted((populated / "entries").glob("*.pjx"), key=lambda p: p.stat().st_mtime)
    bound = max(p.stat().st_size for p in entries)  # room for one entry, not two
    code, document = cli_json(capsys, "cache", "prune", "--max-size", str(bound))
    assert code == 0
    assert document["evicted"] == 2 and document["total_after"] <= bound
    assert keys(populated) == [entries[-1].stem]  # the most recently used stays
    code, out, _ = cli(capsys, "cache", "prune", "--max-size", "1M")
    assert code == 0 and "evicted 0 entries" in out


def test_clear(capsys, populated):
    locks = sorted(p.name for p in (populated / "locks").iterdir())
    code, _, err = cli(capsys, "cache", "clear")  # stdin is not a terminal under pytest
    assert code == 2 and "--yes" in err and len(keys(populated)) == 3
    code, document = cli_json(capsys, "cache", "clear", "--yes")
    assert code == 0 and document["removed"] == 3
    assert keys(populated) == []
    assert sorted(p.name for p in (populated / "locks").iterdir()) == locks


@contextlib.contextmanager
def unwritable(folder: Path) -> Iterator[None]:
    """Makes a folder one this process cannot write in, as long as the block runs.

    For root, whom permissions do not stop, the folder is made immutable
    (chattr +i: an unlink in it fails with EPERM); for anyone else, read-only.
    """
    if os.geteuid() != 0:
        folder.chmod(0o500)
        try:
            yield
        finally:
            folder.chmod(0o700)
        return
    made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False)
    if made.returncode != 0:  # no chattr, or no CAP_LINUX_IMMUTABLE (a container's root)
        pytest.skip(f"root cannot make {folder} unwritable here: {made.stderr!r}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_clear_that_cannot_remove_the_entries_says_so_and_exits_1(capsys, populated):
    """It said "removed 0 entries", a warning per entry, and exited 0 (issue 42)."""
    with unwritable(populated / "entries"):
        code, out, err = cli(capsys, "cache", "clear", "--yes")
        assert code == 1 and len(keys(populated)) == 3
        assert f"removed 0 entries from {populated}" in out
        (line,) = err.strip().splitlines()
        assert line.startswith("pjrt-pool cache clear: could not remove 3 of 3 entries ("), line
        assert f"make {populated / 'entries'} writable" in line
        code, document = cli_json(capsys, "cache", "clear", "--yes")
        assert code == 1 and document["removed"] == 0 and len(document["failed"]) == 3
    code, document = cli_json(capsys, "cache", "clear", "--yes")  # writable again: it clears
    assert code == 0 and document["removed"] == 3 and document["failed"] == []


def test_the_command_runs_as_a_program(populated):
    done = subprocess.run(
        [sys.executable, "-m", "pool.cli.main", "cache", "list", "--json"],
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["entries"]) == 3


def test_the_cache_commands_do_not_import_jax(populated):
    code = (
        "import sys; from pool.cli.main import main; code = main(['cache', 'info']); "
        "assert 'jax' not in sys.modules, 'jax was imported'; sys.exit(code)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_verify_load_when_the_plugin_itself_crashes_on_load(capsys, populated, monkeypatch):
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGABRT)"
    monkeypatch.setattr(
        pool.cli.cache, "python_command", lambda module, *a: [sys.executable, "-c", crash]
    )
    code, document = cli_json(capsys, "cache", "verify", "--load")
    assert code == 0  # no entry is shown to be at fault
    assert {record["status"] for record in document["entries"]} == {"other plugin/host"}
    assert "SIGABRT" in document["entries"][0]["detail"]
