"""A user's mistake on the command line: one line on stderr saying what to do, and exit 2.

Every case runs the real `pjrt-pool` command in a child process. Internal
errors are not caught (they keep their traceback); these are not internal.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import pjrt_pool

from pool.manifest import ManifestError, load_manifest

TINY_SPEC = """
import jax, jax.numpy as jnp

def programs():
    return [("add", lambda a, b: a + b, [jax.ShapeDtypeStruct((4,), jnp.float32)] * 2)]
"""


def assert_usage_error(done: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Exit 2, one line on stderr holding every fragment, no traceback; returns the line."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A spec of one program, warmed into a cache, with its manifest."""
    directory = tmp_path_factory.mktemp("tiny")
    spec, cache, manifest = directory / "tiny.py", directory / "cache", directory / "m.json"
    spec.write_text(TINY_SPEC)
    done = pjrt_pool("warm", str(spec), "--cache-dir", str(cache), "--manifest", str(manifest))
    assert done.returncode == 0, done.stderr
    return {"spec": spec, "cache": cache, "manifest": manifest, "directory": directory}


# -- warm -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "fragments"),
    [
        (["--timeout", "0"], ["--timeout must be a positive number of seconds, not 0"]),
        (["--timeout", "-5"], ["--timeout must be a positive number of seconds, not -5"]),
        (["--timeout", "nan"], ["--timeout must be a positive number"]),
        (["--lower-workers", "-1"], ["--lower-workers must be 0", "not -1"]),
        (["--workers", "0"], ["--workers must be at least 1"]),
        (["--platform", "nosuch"], ["--platform nosuch", "PJRT_POOL_PLUGIN_NOSUCH"]),
    ],
    ids=["timeout-0", "timeout-negative", "timeout-nan", "lower-workers", "workers", "platform"],
)
def test_warm_refuses_bad_options(tiny: dict, tmp_path: Path, arguments, fragments) -> None:
    done = pjrt_pool("warm", str(tiny["spec"]), "--cache-dir", str(tmp_path / "c"), *arguments)
    assert_usage_error(done, "pjrt-pool warm: ", *fragments)


def test_warm_checks_the_manifest_path_before_warming(tiny: dict, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    missing = tmp_path / "no" / "such" / "dir" / "m.json"
    done = pjrt_pool(
        "warm", str(tiny["spec"]), "--cache-dir", str(cache), "--manifest", str(missing)
    )
    assert_usage_error(done, f"--manifest {missing}", "does not exist")
    assert not (cache / "entries").exists() or not any((cache / "entries").iterdir())
    done = pjrt_pool(
        "warm", str(tiny["spec"]), "--cache-dir", str(cache), "--manifest", str(tmp_path)
    )
    assert_usage_error(done, "is a directory")


def test_warm_into_a_regular_file_is_refused(tiny: dict, tmp_path: Path) -> None:
    regular = tmp_path / "a-file"
    regular.write_text("not a cache")
    done = pjrt_pool("warm", str(tiny["spec"]), "--cache-dir", str(regular))
    assert_usage_error(done, f"--cache-dir {regular} is a file, not a directory")
    done = pjrt_pool("warm", str(tiny["spec"]), "--cache-dir", str(regular / "below"))
    assert_usage_error(done, "cannot be created")
    assert regular.read_text() == "not a cache"


@pytest.mark.parametrize(
    ("source", "fragments"),
    [
        ("import sys\nsys.exit(3)\n", ["called sys.exit(3)", "a spec must not exit"]),
        ("import sys\ndef programs():\n    sys.exit(3)\n", ["programs() called sys.exit(3)"]),
        ("def programs():\n    return []\n", ["returned no programs"]),
        ("x = 1\n", ["spec.py has no function programs()"]),
        ("x = 1\ny = x / 0\n", ["failed at line 2: ZeroDivisionError"]),
    ],
    ids=["exit-at-import", "exit-in-programs", "empty", "no-programs", "raises-at-import"],
)
def test_bad_specs_are_one_line_usage_errors(tmp_path: Path, source: str, fragments) -> None:
    spec = tmp_path / "spec.py"
    spec.write_text(source)
    line = assert_usage_error(pjrt_pool("warm", str(spec)), *fragments)
    assert "pjrt_pool_spec_" not in line  # the file, not the module name it is loaded under


# -- run ---------------------------------------------------------------------------


def test_run_refuses_a_negative_worker_count(tiny: dict) -> None:
    done = pjrt_pool("run", str(tiny["manifest"]), "add", "--workers", "-1")
    assert_usage_error(done, "pjrt-pool run: --workers must be 0")


@pytest.mark.parametrize(
    ("arrays", "fragments"),
    [
        ({"arr_0": np.ones(3), "arr_1": np.ones(3)}, ["has shape (3,)", "float32[4]"]),
        ({"arr_0": np.ones(4)}, ["takes 2 arguments", "1 was given"]),
        ({"x": np.ones(4), "y": np.ones(4)}, ["holds x, y", "arr_0, arr_1"]),
    ],
    ids=["shape", "count", "names"],
)
def test_run_checks_inputs_against_the_program(tiny: dict, tmp_path: Path, arrays, fragments):
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, **arrays)
    for workers in ("0", "1"):
        done = pjrt_pool(
            "run", str(tiny["manifest"]), "add", "--inputs", str(inputs), "--workers", workers
        )
        assert_usage_error(done, f"--inputs {inputs}", *fragments)


def test_run_says_which_key_is_missing_and_how_to_warm_it(tiny: dict, tmp_path: Path) -> None:
    stale = tmp_path / "stale.json"
    data = json.loads(tiny["manifest"].read_text())
    data["programs"][0]["key"] = "0" * 64
    stale.write_text(json.dumps(data))
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    key = json.loads(tiny["manifest"].read_text())["programs"][0]["key"]
    cases = [([str(stale)], "0" * 64), ([str(tiny["manifest"]), "--cache-dir", str(empty)], key)]
    for arguments, missing in cases:
        for workers in ("0", "1"):
            done = pjrt_pool("run", arguments[0], "add", *arguments[1:], "--workers", workers)
            assert_usage_error(done, f"add: no executable with key {missing}", "pjrt-pool warm")
    # The real manifest still runs.
    done = pjrt_pool("run", str(tiny["manifest"]), "add", "--json")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("missing.bundle", "bundle {} does not exist: check the path, or make the bundle"),
        ("missing.json", "manifest {} does not exist: check the path, or write the manifest"),
    ],
)
def test_run_names_a_missing_bundle_as_a_bundle(tmp_path: Path, name: str, says: str) -> None:
    """`run missing.bundle NAME` said "manifest missing.bundle does not exist: run pjrt-pool
    warm first" (issue 42)."""
    path = tmp_path / name
    line = assert_usage_error(pjrt_pool("run", str(path), "add"), says.format(path))
    assert line.startswith("pjrt-pool run: ")
    with pytest.raises(ManifestError, match=re.escape(says.format(path))):
        load_manifest(path)


def test_a_bad_compile_mode_is_a_usage_error_for_warm_and_run(tiny):
    """PJRT_POOL_COMPILE=bogus: one line, exit 2, before anything is loaded (issue 29, F)."""
    bogus = {"PJRT_POOL_COMPILE": "bogus"}
    warm = pjrt_pool("warm", str(tiny["spec"]), "--cache-dir", str(tiny["cache"]), env=bogus)
    assert_usage_error(warm, "PJRT_POOL_COMPILE='bogus'", "never", "allow")
    run = pjrt_pool("run", str(tiny["manifest"]), "add", env=bogus)
    assert_usage_error(run, "PJRT_POOL_COMPILE='bogus'")


def test_run_json_is_json_when_an_output_sum_is_nan(tiny, tmp_path):
    """JSON has no NaN: a sum that is not finite is null (issue 29, Also)."""
    inputs = tmp_path / "nan.npz"
    np.savez(inputs, np.array([np.nan, 1, 2, 3], np.float32), np.ones(4, np.float32))
    done = pjrt_pool("run", str(tiny["manifest"]), "add", "--inputs", str(inputs), "--json")
    assert done.returncode == 0, done.stderr
    assert "NaN" not in done.stdout
    (output,) = json.loads(done.stdout)["outputs"]
    assert output["sum"] is None and output["shape"] == [4]


# -- --remote: one check, one exit code ---------------------------------------------


REMOTE_COMMANDS = {
    "cache push": ["cache", "push"],
    "cache pull": ["cache", "pull"],
    "cache gc": ["cache", "gc", "--older-than", "1d"],
    "bundle create": ["bundle", "create", "m.json", "-o", "out.bundle"],
    "bundle check": ["bundle", "check", "m.json"],
    "run": ["run", "m.json", "add"],
    "warm": ["warm", "spec.py"],
}


@pytest.mark.parametrize("command", list(REMOTE_COMMANDS))
def test_a_bad_remote_url_is_a_usage_error_for_every_command(
    command: str, tmp_path: Path, monkeypatch, capsys
) -> None:
    """--remote ftp://... or a bad PJRT_POOL_CACHE_REMOTE: exit 2, naming where it came from,
    and never the URL's credentials."""
    from pool.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PJRT_POOL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "spec.py").write_text(TINY_SPEC)
    (tmp_path / "m.json").write_text('{"format": 1, "programs": []}')
    arguments = REMOTE_COMMANDS[command]
    monkeypatch.delenv("PJRT_POOL_CACHE_REMOTE", raising=False)
    assert main([*arguments, "--remote", "ftp://user:secret@host/x"]) == 2
    err = capsys.readouterr().err
    assert "--remote" in err and "scheme 'ftp'" in err and "secret" not in err, err
    monkeypatch.setenv("PJRT_POOL_CACHE_REMOTE", "ftp://user:secret@host/x")
    assert main(arguments) == 2
    err = capsys.readouterr().err
    assert "PJRT_POOL_CACHE_REMOTE" in err and "scheme 'ftp'" in err and "secret" not in err, err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out.bundle").exists()


def test_python_m_pool_cli_main_says_a_usage_error_in_one_line(tmp_path: Path) -> None:
    """`python -m pool.cli.main` ran the module as `__main__` beside the `pool.cli.main` its
    commands import: their UsageError was another class, so a usage error was a traceback
    and exit 1 (seen in check-plugin and bundle check; issue 52's note)."""
    path = tmp_path / "missing.bundle"
    done = subprocess.run(
        [sys.executable, "-m", "pool.cli.main", "bundle", "check", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    line = assert_usage_error(done, f"bundle {path} does not exist")
    assert line.startswith("pjrt-pool bundle check: ")
