"""The disk cache across real processes: one compile per key, healing, killed writers,
lock timeouts, the size bound under concurrent writers, other plugin builds, and
read-only and full disks.

Children import only `worker` (never JAX): cache_helpers.CHILD.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cache_helpers import (
    CHILD,
    HOLD_LOCK,
    compile_in_child,
    corrupt,
    entries_size,
    finish,
    kill,
    lowered,
    save_program,
    start,
    totals,
    wait_for,
)
from conftest import DEFAULT_PLUGIN, SECOND_PLUGIN

import worker
from worker.cache import DiskCache, explain_key, key_of, open_cache
from worker.cache.atomic import TEMP_PREFIX
from worker.cache.locking import try_acquire

PLUGIN = os.path.realpath(os.environ.get("PJRT_POOL_PLUGIN_CPU") or DEFAULT_PLUGIN or "")
OTHER_PLUGIN = DEFAULT_PLUGIN if os.path.realpath(SECOND_PLUGIN or "") == PLUGIN else SECOND_PLUGIN
"""A CPU plugin build other than the one this process (and its children) load."""


def program_file(tmp_path: Path, variant: int = 0) -> str:
    return str(save_program(lowered(variant), tmp_path / f"program{variant}.json"))


def key_of_program(variant: int, cache_dir: Path) -> str:
    return worker.program_key(lowered(variant), worker.get_runtime("cpu"), open_cache(cache_dir))[0]


def start_together(specs: list[dict], tmp_path: Path, env: dict | None = None) -> list[dict]:
    """Starts children, waits until each is ready to compile, releases them at once."""
    barrier = tmp_path / "go"
    children = []
    for index, spec in enumerate(specs):
        ready = tmp_path / f"ready{index}"
        children.append((start({**spec, "ready": str(ready), "barrier": str(barrier)}, env), ready))
    for child, ready in children:
        wait_for(ready, child)
    barrier.touch()
    return [finish(child) for child, _ in children]


@pytest.mark.slow
def test_eight_processes_compile_once_and_seven_load(tmp_path, cache_dir):
    program = program_file(tmp_path)
    reports = start_together([{"programs": [program], "run": True}] * 8, tmp_path)

    summed = totals(reports)
    assert (summed["compiled"], summed["loaded"]) == (1, 7)
    assert (summed["misses"], summed["hits"], summed["corrupt"]) == (1, 7, 0)
    assert summed["lock_timeouts"] == 0
    assert not any(report["jax"] for report in reports)
    assert len(list((cache_dir / "entries").glob("*.pjx"))) == 1


def test_a_corrupt_entry_met_by_four_processes_is_healed_once(tmp_path, cache_dir):
    program = program_file(tmp_path)
    compile_in_child({"programs": [program]})
    (path,) = (cache_dir / "entries").glob("*.pjx")
    corrupt(path, "payload bit flip")

    reports = start_together([{"programs": [program]}] * 4, tmp_path)

    summed = totals(reports)
    assert (summed["compiled"], summed["loaded"]) == (1, 3)
    assert (summed["corrupt"], summed["misses"]) == (1, 1)
    assert DiskCache(cache_dir).read(path.stem) is not None


def test_a_writer_killed_mid_write_leaves_no_entry(tmp_path, cache_dir):
    program = program_file(tmp_path)
    signal_file = tmp_path / "writing"
    writer = start({"programs": [program], "hang_in_fsync": str(signal_file)})
    wait_for(signal_file, writer)
    key = key_of_program(0, cache_dir)
    kill(writer)  # while it holds the key's lock, its entry written but not renamed

    entries = cache_dir / "entries"
    temps = [p for p in entries.iterdir() if p.name.startswith(TEMP_PREFIX)]
    assert len(temps) == 1 and temps[0].stat().st_size > 0
    assert not list(entries.glob("*.pjx"))
    assert (cache_dir / "locks" / f"{key}.lock").exists()

    # The kernel released the dead writer's lock: the next process compiles at once.
    report = compile_in_child({"programs": [program], "lock_timeout": 60})
    assert report["stats"][0]["compiled"] == 1 and report["seconds"] < 30
    assert report["counters"]["lock_timeouts"] == 0
    assert DiskCache(cache_dir).read(key) is not None
    assert compile_in_child({"programs": [program]})["stats"][0]["loaded"] == 1

    # The dead writer's temporary file goes once it is older than the grace.
    cache = DiskCache(cache_dir)
    assert cache.trim().temp_removed == 0 and temps[0].exists()
    then = time.time() - 2 * 3600
    os.utime(temps[0], (then, then))
    assert cache.trim().temp_removed == 1 and not temps[0].exists()


def _lock_holder(tmp_path: Path, cache_dir: Path, key: str) -> tuple[subprocess.Popen, Path]:
    """A child that takes a key's lock and holds it, and the file it makes once it does."""
    ready = tmp_path / "holding"
    lock = cache_dir / "locks" / f"{key}.lock"
    return start({"lock": str(lock), "ready": str(ready)}, code=HOLD_LOCK), ready


def test_a_process_killed_while_holding_the_lock_frees_it(tmp_path, cache_dir):
    program = program_file(tmp_path)
    holder, ready = _lock_holder(tmp_path, cache_dir, key_of_program(0, cache_dir))
    wait_for(ready, holder)
    waiter = start({"programs": [program], "lock_timeout": 120})
    time.sleep(2.0)  # the waiter starts and waits on the lock
    assert waiter.poll() is None
    kill(holder)
    report = finish(waiter)
    assert report["stats"][0]["compiled"] == 1
    assert report["counters"]["lock_timeouts"] == 0


def test_a_waiter_whose_lock_wait_times_out_compiles_anyway(tmp_path, cache_dir):
    program = program_file(tmp_path)
    key = key_of_program(0, cache_dir)
    holder, ready = _lock_holder(tmp_path, cache_dir, key)
    try:
        wait_for(ready, holder)
        report = compile_in_child({"programs": [program], "lock_timeout": 1.0})
    finally:
        kill(holder)
    assert report["stats"][0]["compiled"] == 1
    assert report["counters"]["lock_timeouts"] == 1
    assert report["seconds"] >= 1.0
    assert DiskCache(cache_dir).read(key) is not None  # and it still published


@pytest.mark.slow
def test_four_writers_keep_the_directory_under_its_bound(tmp_path, cache_dir):
    compile_in_child({"programs": [program_file(tmp_path, 100)]})
    (first,) = (cache_dir / "entries").glob("*.pjx")
    entry_size = first.stat().st_size
    bound = 6 * entry_size + entry_size // 2
    per_child = 8
    specs = [
        {
            "programs": [program_file(tmp_path, 10 * c + i) for i in range(per_child)],
            "max_size": bound,
        }
        for c in range(4)
    ]
    samples: list[int] = []
    stop = threading.Event()
    space_lock = cache_dir / "locks" / "space.lock"

    def sample() -> None:
        # Under the space lock no reservation or eviction is under way, so the
        # listing is a consistent picture (a listing without it may see one file
        # under both its temporary and final names, or files that never coexisted).
        while not stop.is_set():
            lock = try_acquire(space_lock, 5)
            if lock is not None:  # a listing without the lock proves nothing
                try:
                    samples.append(entries_size(cache_dir / "entries"))
                finally:
                    lock.release()
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        reports = start_together(specs, tmp_path)
    finally:
        stop.set()
        sampler.join()

    summed = totals(reports)
    assert summed["compiled"] == 4 * per_child
    assert summed["evicted"] >= 4 * per_child - 6
    assert len(samples) > 20
    assert max(samples) <= bound, (max(samples), bound)
    assert entries_size(cache_dir / "entries") <= bound
    assert len(list((cache_dir / "entries").glob("*.pjx"))) <= 6


@pytest.mark.skipif(OTHER_PLUGIN is None, reason="needs a second CPU plugin build")
def test_an_entry_from_another_plugin_build_is_not_loaded(tmp_path, cache_dir):
    program = program_file(tmp_path)
    assert compile_in_child({"programs": [program]})["stats"][0]["compiled"] == 1
    (mine,) = (cache_dir / "entries").glob("*.pjx")

    other = compile_in_child({"programs": [program]}, env={"PJRT_POOL_PLUGIN_CPU": OTHER_PLUGIN})

    assert other["stats"][0]["compiled"] == 1 and other["stats"][0]["loaded"] == 0
    assert other["counters"]["hits"] == 0 and other["counters"]["corrupt"] == 0
    (theirs,) = [p for p in (cache_dir / "entries").glob("*.pjx") if p != mine]
    cache = DiskCache(cache_dir)
    mine_parts = cache.read(mine.stem, touch=False)[0].parts
    their_parts = cache.read(theirs.stem, touch=False)[0].parts
    differing = [
        line.split(" =")[0]
        for line in explain_key(their_parts, mine_parts).splitlines()
        if "differs" in line
    ]
    assert "plugin.sha256" in differing and "program_sha256" not in differing
    assert key_of(their_parts) == theirs.stem
    # (Executables are stored as the plugin gives them, without the stamp that older
    # versions appended, which libtpu refuses: an entry forged under the other build's
    # key, around this build's executable, is a forgery that only signed entries catch:
    # test_cache_signing.)


def _unshare_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False)
    return done.returncode == 0


def _in_mount_namespace(setup: str, directory: Path, spec: dict) -> dict:
    """Runs CHILD in a private mount namespace after a shell `setup` on "$0" (= directory)."""
    import json

    from cache_helpers import REPO

    from pool.spawn import child_environment

    command = [
        "unshare",
        "-m",
        "sh",
        "-c",
        f'{setup} && shift && exec "$@"',
        str(directory),
        "--",
        sys.executable,
        "-c",
        CHILD,
        json.dumps({"tests": str(REPO / "tests"), **spec}),
    ]
    done = subprocess.run(
        command, env=child_environment(), capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_read_only_cache_is_read_and_never_fails_a_compile(tmp_path, cache_dir):
    cached, uncached = program_file(tmp_path, 0), program_file(tmp_path, 1)
    compile_in_child({"programs": [cached]})
    spec = {"programs": [cached, uncached, uncached]}
    if os.geteuid() != 0:
        folders = [cache_dir, *(cache_dir / name for name in ("entries", "locks", "plugins"))]
        for folder in folders:
            folder.chmod(0o500)
        try:
            report = compile_in_child(spec)
        finally:
            for folder in folders:
                folder.chmod(0o700)
    elif _unshare_works():
        # chmod does not stop root: a read-only bind mount, private to the child, does.
        report = _in_mount_namespace(
            'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0"', cache_dir, spec
        )
    else:
        pytest.skip("root without a mount namespace: no way to make a directory read-only")

    assert [s["loaded"] for s in report["stats"]] == [1, 0, 0]
    assert [s["compiled"] for s in report["stats"]] == [0, 1, 1]
    assert len(report["warnings"]) == 1, report["warnings"]
    assert "disk cache disabled" in report["warnings"][0]
    assert len(list((cache_dir / "entries").glob("*.pjx"))) == 1


@pytest.mark.skipif(not _unshare_works(), reason="a real full disk needs root and unshare -m")
def test_a_full_disk_never_fails_a_compile(tmp_path, cache_dir):
    programs = [program_file(tmp_path, 0), program_file(tmp_path, 1)]
    report = _in_mount_namespace(
        'mount -t tmpfs -o size=8k,mode=0700 tmpfs "$0"', cache_dir, {"programs": programs}
    )
    assert [s["compiled"] for s in report["stats"]] == [1, 1]
    assert len(report["warnings"]) == 1, report["warnings"]
    assert report["counters"]["write_errors"] == 1
