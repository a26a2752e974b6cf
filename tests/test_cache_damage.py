"""Entries that cannot be read, that are not files, and that crash the process loading them.

- An I/O error on read (a real EMFILE) is not corruption: the entry is left
  alone, counted and reported, and the program compiles.
- A directory named like an entry is a damaged entry: healed, and cleared.
- An entry whose deserialize aborts the runtime (a real one: a serialized
  executable without its compile options makes both CPU plugins and jaxlib's
  client fail "Check failed: replica_count > 0") kills one process; the next one
  quarantines it and compiles afresh, through compile_program in child
  processes, through load_cached_executable, and through a real Pool.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from cache_helpers import (
    compile_in_child,
    cpu_plugin_params,
    lowered,
    plant,
    save_program,
    start,
    without_compile_options,
)
from conftest import run_python

import worker
from pool import Pool, WorkerCrashedError
from pool.cli.main import main as cli_main
from worker.cache import DiskCache, entry, open_cache

X = [0.5, 1.0, 1.5, 2.0]
PLUGINS = cpu_plugin_params()


def expected(variant: int = 0) -> list[float]:
    scale = variant + 2.0
    return (np.sin(np.array(X, np.float32)) * scale + scale).tolist()


def poison(path: Path) -> None:
    """Rewrites a valid entry around a payload that aborts the plugin's deserialize."""
    found = entry.decode(path.read_bytes())
    plant(path.parent.parent, found.parts, without_compile_options(found.payload), found.metadata)


# -- I/O errors and directories -------------------------------------------------------

EMFILE_CHILD = r"""
import json, os, resource, sys, warnings
sys.path.insert(0, sys.argv[2])
warnings.simplefilter("ignore")
from cache_helpers import load_program
import worker
from worker.cache import open_cache

program = load_program(sys.argv[1])
worker.get_runtime("cpu")
worker.compile_program(program)  # the entry is there now
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))  # every descriptor taken: EMFILE
except OSError:
    pass
executable, statistics = worker.compile_program(program)
for fd in held:
    os.close(fd)
print(json.dumps({
    "statistics": statistics._asdict(),
    "counters": open_cache().counters._asdict(),
    "outputs": executable.run([[0.5, 1.0, 1.5, 2.0]])[0].tolist(),
}))
"""


def test_an_entry_that_cannot_be_read_is_left_alone_and_compiled_around(tmp_path, cache_dir):
    program = save_program(lowered(0), tmp_path / "p.json")
    done = run_python(
        f"import sys; sys.argv[1:] = [{str(program)!r}, {str(Path(__file__).parent)!r}]\n"
        + EMFILE_CHILD
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["statistics"]["compiled"] == 1 and report["outputs"] == expected(0)
    assert report["counters"]["read_errors"] == 1 and report["counters"]["corrupt"] == 0
    assert "Too many open files" in done.stderr  # reported as a warning
    (path,) = (cache_dir / "entries").glob("*.pjx")
    # Still the entry the first compile wrote, and still good.
    again = compile_in_child({"programs": [str(program)], "inputs": [X]})
    assert again["stats"][0]["loaded"] == 1 and again["outputs"] == [[expected(0)]]
    assert path.exists()


def test_removal_needs_the_stat_of_the_file_judged_bad(cache_dir):
    executable, _ = worker.compile_program(lowered(0))
    cache = open_cache()
    assert not cache.remove_if_unchanged(executable.key, None)
    assert cache.path_of(executable.key).exists()


def test_a_directory_named_like_an_entry_is_a_damaged_entry(cache_dir, capsys):
    key = worker.program_key(lowered(0), worker.get_runtime("cpu"), None)[0]
    blocker = cache_dir / "entries" / f"{key}.pjx"
    DiskCache(cache_dir)
    blocker.mkdir()
    (blocker / "inside").write_text("x")

    assert cli_main(["cache", "verify"]) == 1
    assert "a directory" in capsys.readouterr().out
    executable, statistics = worker.compile_program(lowered(0))
    assert statistics.compiled == 1 and open_cache().counters.corrupt == 1
    np.testing.assert_allclose(executable.run([X])[0], expected(0), rtol=1e-6)
    assert blocker.is_file()  # healed: the directory is gone, the entry published

    other = cache_dir / "entries" / f"{'0' * 64}.pjx"
    other.mkdir()
    (other / "inside").write_text("x")
    assert cli_main(["cache", "clear", "--yes"]) == 1  # clear removes regular files only
    out = capsys.readouterr().out
    assert "removed 1 entry" in out and "left 1 that is named like an entry" in out
    assert list((cache_dir / "entries").iterdir()) == [other]
    assert (other / "inside").read_text() == "x"


# -- entries that crash the loader ------------------------------------------------------


@pytest.mark.parametrize("plugin", PLUGINS)
def test_an_entry_that_crashes_its_loader_kills_one_process_only(tmp_path, cache_dir, plugin):
    env = {"PJRT_POOL_PLUGIN_CPU": plugin} if plugin else {}
    program = str(save_program(lowered(0), tmp_path / "p.json"))
    (key,) = compile_in_child({"programs": [program]}, env)["keys"]
    path = cache_dir / "entries" / f"{key}.pjx"
    poison(path)

    victim = start({"programs": [program], "inputs": [X]}, env)
    _, stderr = victim.communicate(timeout=120)
    assert victim.returncode == -signal.SIGABRT, stderr[-2000:]
    assert "replica_count" in stderr
    assert len(list((cache_dir / "loads").iterdir())) == 1  # the dead loader's marker

    survivor = compile_in_child({"programs": [program], "inputs": [X]}, env)
    assert survivor["stats"][0]["compiled"] == 1 and survivor["outputs"] == [[expected(0)]]
    assert survivor["counters"]["crashed_loads"] == 1
    assert list((cache_dir / "loads").iterdir()) == []

    after = compile_in_child({"programs": [program], "inputs": [X]}, env)
    assert after["stats"][0]["loaded"] == 1 and after["outputs"] == [[expected(0)]]


LOAD_BY_KEY = r"""
import sys
from worker.compile.by_key import NotInCacheError, load_cached_executable
try:
    load_cached_executable(sys.argv[1])
except NotInCacheError as error:
    print("NotInCacheError:", error)
"""


def test_loading_by_key_quarantines_an_entry_that_crashed_a_loader(cache_dir):
    executable, _ = worker.compile_program(lowered(0))
    path = cache_dir / "entries" / f"{executable.key}.pjx"
    poison(path)
    code = f"import sys; sys.argv[1:] = [{executable.key!r}]\n" + LOAD_BY_KEY
    crashed = run_python(code, check=False)
    assert crashed.returncode == -signal.SIGABRT
    refused = run_python(code)
    assert "NotInCacheError" in refused.stdout and "died while loading it" in refused.stdout
    assert not path.exists()


def test_a_pool_recovers_from_an_entry_that_crashes_its_worker(cache_dir):
    program = lowered(0)
    executable, _ = worker.compile_program(program)
    poison(cache_dir / "entries" / f"{executable.key}.pjx")

    with Pool(workers=1) as pool:
        with pytest.raises(WorkerCrashedError, match="SIGABRT"):
            pool.run(program, [X])
        (out,) = pool.run(program, [X])
        np.testing.assert_allclose(out, expected(0), rtol=1e-6)
        assert pool.cache_counters.crashed_loads == 1
    assert os.listdir(cache_dir / "loads") == []
