"""`pjrt-pool warm` and `pjrt-pool run`, as users run them: real commands, real workers."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pjrt_pool

from pool import Pool
from pool.manifest import ManifestError, load_manifest
from pool.warm.spec_file import SpecError, WarmProgram, load_spec

SPEC = str(Path(__file__).resolve().parent / "specs" / "warm_spec.py")
FAILURES = {
    "crash": "worker crash",
    "does_not_lower": "lowering error",
    "hangs": "timeout",
    "compile_error": "compile error",
}


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two warm runs of the test spec into one cache: the first compiles, the second loads."""
    directory = tmp_path_factory.mktemp("warm")
    cache, manifest = directory / "cache", directory / "manifest.json"
    common = ["--cache-dir", str(cache), "--workers", "2", "--timeout", "8", "--json"]
    first = pjrt_pool("warm", SPEC, *common, "--manifest", str(manifest))
    second = pjrt_pool("warm", SPEC, *common, "--lower-workers", "2")
    return {"first": first, "second": second, "cache": cache, "manifest": manifest}


def outcomes(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    report = json.loads(done.stdout)
    return {program["name"]: program["outcome"] for program in report["programs"]}


@pytest.mark.slow
def test_first_run_warms_the_good_programs_and_reports_the_four_failures(warmed: dict) -> None:
    first = warmed["first"]
    assert first.returncode == 1, first.stderr[-3000:]
    found = outcomes(first)
    assert {name: found[name] for name in FAILURES} == FAILURES
    good = {name: outcome for name, outcome in found.items() if name not in FAILURES}
    assert len(good) == 20 and set(good.values()) == {"compiled"}
    report = json.loads(first.stdout)
    assert report["statistics"]["compiled"] == 20
    errors = {p["name"]: p["error"] for p in report["programs"]}
    assert "SIGABRT" in errors["crash"] and "replica_count" in errors["crash"]
    assert "does not lower" in errors["does_not_lower"]
    assert "within 8 s" in errors["hangs"]
    assert "pjrt_pool_test_unregistered" in errors["compile_error"]
    assert all(p["key"] for p in report["programs"] if p["name"] not in FAILURES)
    # Where each compile's time went in its worker (key, lookup, compile, ...).
    assert all(p["phases"]["compile"] > 0 for p in report["programs"] if p["name"] in good)
    # Not a terminal: one progress line per program on stderr.
    assert sum(line.startswith("[") for line in first.stderr.splitlines()) == 24


@pytest.mark.slow
def test_second_run_loads_everything_and_compiles_nothing(warmed: dict) -> None:
    second = warmed["second"]
    assert second.returncode == 1  # the four still fail
    found = outcomes(second)
    assert {name: found[name] for name in FAILURES} == FAILURES
    assert {o for n, o in found.items() if n not in FAILURES} == {"loaded"}
    report = json.loads(second.stdout)
    assert report["statistics"]["compiled"] == 0 and report["statistics"]["loaded"] == 20
    assert report["cache_counters"]["hits"] == 20
    assert all("lookup" in p["phases"] for p in report["programs"] if p["name"] not in FAILURES)


@pytest.mark.slow
def test_the_manifest_runs_what_was_warmed(warmed: dict) -> None:
    manifest = load_manifest(warmed["manifest"])
    assert len(manifest.names) == 20 and "crash" not in manifest.names
    x = np.linspace(-1, 1, 256, dtype=np.float32).reshape(16, 16)
    expected = np.sin(x) * 3.0 + np.cos(x)
    (in_process,) = manifest.run("good_03", [x])
    np.testing.assert_allclose(in_process, expected, rtol=1e-5)
    with Pool(workers=1, cache_dir=manifest.cache_dir) as pool:
        (pooled,) = manifest.run("good_03", [x], pool=pool)
        assert pool.statistics.compiled == 0 and pool.statistics.loaded == 1
    np.testing.assert_allclose(pooled, expected, rtol=1e-5)
    with pytest.raises(ManifestError, match="no program 'crash'"):
        manifest.run("crash", [x])

    done = pjrt_pool("run", str(warmed["manifest"]), "good_03", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["outputs"][0]["shape"] == [16, 16] and result["load_seconds"] < 5


@pytest.mark.slow
def test_fail_fast_stops_at_the_first_failure(tmp_path: Path) -> None:
    done = pjrt_pool(
        "warm",
        SPEC,
        "--cache-dir",
        str(tmp_path),
        "--workers",
        "1",
        "--timeout",
        "4",
        "--fail-fast",
        "--json",
    )
    assert done.returncode == 1
    found = outcomes(done)
    assert "skipped" in found.values()
    assert sum(outcome in FAILURES.values() for outcome in found.values()) >= 1


def test_bad_specs_are_usage_errors(tmp_path: Path) -> None:
    missing = pjrt_pool("warm", str(tmp_path / "nope.py"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    broken = tmp_path / "broken.py"
    broken.write_text("def programs():\n    return [('a', 42, [])]\n")
    done = pjrt_pool("warm", str(broken))
    assert done.returncode == 2 and "not callable" in done.stderr
    with pytest.raises(SpecError, match="neither a Python file nor module:function"):
        load_spec("no_such_thing")
    duplicate = tmp_path / "duplicate.py"
    duplicate.write_text(
        "import jax, jax.numpy as jnp\n"
        "def programs():\n"
        "    s = [jax.ShapeDtypeStruct((2,), jnp.float32)]\n"
        "    return [('a', jnp.sin, s), ('a', jnp.cos, s)]\n"
    )
    with pytest.raises(SpecError, match="unique"):
        load_spec(str(duplicate))


def test_module_function_specs_load() -> None:
    spec = load_spec("pool.examples:example_programs")
    assert len(spec.programs) >= 20 and spec.initializer is None


def test_progress_is_a_live_bar_on_a_terminal_and_lines_otherwise() -> None:
    import io

    from pool.progress import ProgressDisplay

    live = io.StringIO()
    bar = ProgressDisplay(4, stream=live, live=True)
    for outcome in ("compiled", "loaded", "compiled", "worker crash"):
        bar.update("p", outcome, 0.1)
    bar.close()
    text = live.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n")
    assert "4/4" in text and "2 compiled" in text and "1 worker crash" in text and "ETA" in text

    plain = io.StringIO()
    lines = ProgressDisplay(2, stream=plain, live=False)
    lines.update("first", "compiled", 0.25)
    lines.update("second", "compile error", 0.5, "PjrtError: bad\nmore")
    assert plain.getvalue().splitlines() == [
        "[1/2] compiled       first (0.25 s)",
        "[2/2] compile error  second (0.50 s): PjrtError: bad",
    ]


UNSENDABLE_SPEC = """
import dataclasses, threading
import jax, jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:  # registered here: a copy sent by value to another process is not
    w: jax.Array
    b: jax.Array


lock = threading.Lock()
x = jax.ShapeDtypeStruct((4,), jnp.float32)


def dense(params, x):
    return params.w @ x + params.b


def locked(x):
    with lock:  # a lock cannot be pickled
        return x + 1


def broken(x):
    raise ValueError("broken everywhere")


def programs():
    f32 = jnp.float32
    params = Dense(jax.ShapeDtypeStruct((2, 4), f32), jax.ShapeDtypeStruct((2,), f32))
    return [("dense", dense, [params, x]), ("locked", locked, [x]), ("broken", broken, [x])]
"""


@pytest.mark.slow
def test_warm_lowers_here_what_a_lowering_process_cannot_take(tmp_path: Path) -> None:
    spec = tmp_path / "unsendable.py"
    spec.write_text(UNSENDABLE_SPEC)
    common = ["--cache-dir", str(tmp_path / "cache"), "--workers", "1", "--json"]
    done = pjrt_pool("warm", str(spec), *common, "--lower-workers", "1")
    assert done.returncode == 1, done.stderr[-3000:]  # "broken" fails for real
    report = {p["name"]: p for p in json.loads(done.stdout)["programs"]}
    assert report["dense"]["outcome"] == "compiled"
    note = report["dense"]["note"]
    assert note.startswith("could not be sent to a lowering process (lowering there failed")
    assert note.endswith("lowered in this process instead") and "Dense" in note
    assert report["locked"]["outcome"] == "compiled"
    assert "pickling failed" in report["locked"]["note"] and "lock" in report["locked"]["note"]
    assert report["broken"]["outcome"] == "lowering error" and report["broken"]["note"] is None
    assert "broken everywhere" in report["broken"]["error"]
    # The same spec lowered in this process: the same keys, no notes.
    here = {
        p["name"]: p for p in json.loads(pjrt_pool("warm", str(spec), *common).stdout)["programs"]
    }
    assert here["dense"]["outcome"] == "loaded" and here["dense"]["note"] is None
    assert here["dense"]["key"] == report["dense"]["key"]


def test_warm_reports_programs_the_cache_did_not_store(tmp_path: Path) -> None:
    from pool.warm.report import Outcome
    from pool.warm.warming import warm

    f32 = jnp.float32
    shapes = [{"a": jax.ShapeDtypeStruct((3,), f32), "b": (jax.ShapeDtypeStruct((), f32),)}]
    programs = [WarmProgram("tree", lambda t: t["a"] * t["b"][0], shapes)]
    regular = tmp_path / "a-file"
    regular.write_text("not a cache")
    report = warm(programs, workers=1, cache_dir=regular)  # the CLI refuses this first
    (program,) = report.programs
    assert program.outcome is Outcome.NOT_STORED and not report.ok and report.exit_code == 1
    assert "could not be written" in program.error
    good = warm(programs, workers=1, cache_dir=tmp_path / "cache")
    assert good.ok and good.programs[0].outcome is Outcome.COMPILED


PRINTING_SPEC = """
import jax, jax.numpy as jnp
print("Failed to import warp: a library that prints when imported")

def double(x):
    print("tracing double")
    return x * 2

def programs():
    print("building the programs")
    return [("double", double, [jax.ShapeDtypeStruct((4,), jnp.float32)])]
"""


@pytest.mark.parametrize("lower_workers", ["0", "1"])
def test_warm_json_stdout_is_the_report_alone_when_the_spec_prints(tmp_path, lower_workers):
    """A spec's own prints go to stderr, from this process or a lowering worker (issue 29, 15)."""
    spec = tmp_path / "printing.py"
    spec.write_text(PRINTING_SPEC)
    done = pjrt_pool(
        "warm",
        str(spec),
        "--json",
        "--lower-workers",
        lower_workers,
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)  # nothing but the report
    assert report["programs"][0]["name"] == "double"
    assert "Failed to import warp" in done.stderr and "tracing double" in done.stderr


SHARDED_SPEC = """
import jax, jax.numpy as jnp
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
from pool.warm import WarmProgram

MESH = AbstractMesh((2, 2), ("data", "model"))  # 4 devices: the spec says so


def programs():
    rows = NamedSharding(MESH, P("data", None))
    whole = NamedSharding(MESH, P())
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    yield WarmProgram("scale", lambda x: x * 2, [x], in_shardings=rows, out_shardings=rows)
    yield WarmProgram("total", lambda x: x.sum(0), [x], in_shardings=rows, out_shardings=whole)
"""


@pytest.mark.slow
def test_a_sharded_spec_warms_on_as_many_devices_as_its_mesh_and_fewer_is_a_setup_error(
    tmp_path: Path,
) -> None:
    """Issue 63: without --devices-per-worker every program of a sharded spec was a "compile
    error", and that warm replaced the good manifest with an empty one, not marked partial."""
    spec, manifest = tmp_path / "spec.py", tmp_path / "step.json"
    spec.write_text(SHARDED_SPEC)
    common = ("warm", str(spec), "--workers", "1", "--cache-dir", str(tmp_path / "cache"))
    good = pjrt_pool(*common, "--manifest", str(manifest))
    assert good.returncode == 0, good.stdout + good.stderr
    assert "warmed 2 programs" in good.stdout
    written = manifest.read_text()
    assert sorted(load_manifest(manifest).names) == ["scale", "total"]
    short = pjrt_pool(*common, "--devices-per-worker", "2", "--manifest", str(manifest), "--json")
    assert short.returncode == 2, short.stdout + short.stderr  # a setup error: the usage's
    report = json.loads(short.stdout)
    for program in report["programs"]:
        assert program["outcome"] == "setup error"
        assert "needs 4 devices" in program["error"]
        assert "--devices-per-worker 4" in program["error"]
    assert manifest.read_text() == written  # the complete manifest, kept


FAILING_SPEC = """
import jax, jax.numpy as jnp

def broken(x):
    raise ValueError("this one does not lower")

def programs():
    x = [jax.ShapeDtypeStruct((4,), jnp.float32)]
    return [("good", lambda x: x + 1, x), ("broken", broken, x)]
"""


@pytest.mark.slow
def test_a_warm_with_a_failure_writes_a_partial_manifest_that_bundle_create_refuses(
    tmp_path: Path,
) -> None:
    """Issue 63: a spec with one lowering error wrote a one-program manifest, not marked
    partial, which bundle create bundled with exit 0; nor did a failed warm spare a complete
    manifest."""
    spec, manifest, bundle = tmp_path / "spec.py", tmp_path / "m.json", tmp_path / "b.bundle"
    spec.write_text(FAILING_SPEC)
    cache = str(tmp_path / "cache")
    done = pjrt_pool("warm", str(spec), "--cache-dir", cache, "--manifest", str(manifest))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "broken: lowering error: ValueError: this one does not lower" in done.stdout
    assert f"manifest: {manifest}, partial: the 1 of 2 programs warmed" in done.stdout
    written = load_manifest(manifest)
    assert written.partial and written.names == ["good"]
    assert written.missing == {"broken": "lowering error: ValueError: this one does not lower"}
    refused = pjrt_pool("bundle", "create", str(manifest), "-o", str(bundle))
    assert refused.returncode == 2 and "is a partial manifest" in refused.stderr
    assert "broken: lowering error" in refused.stderr and not bundle.exists()
    allowed = pjrt_pool("bundle", "create", str(manifest), "-o", str(bundle), "--allow-partial")
    assert allowed.returncode == 0, allowed.stderr
    # A complete manifest is never replaced by less.
    complete = tmp_path / "complete.json"
    complete_text = json.dumps({**json.loads(manifest.read_text()), "partial": False})
    complete.write_text(complete_text)
    again = pjrt_pool("warm", str(spec), "--cache-dir", cache, "--manifest", str(complete))
    assert again.returncode == 1 and f"manifest: {complete} kept as it was" in again.stdout
    assert complete.read_text() == complete_text
