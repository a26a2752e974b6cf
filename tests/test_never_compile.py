"""Never-compile mode: compile_program, Pool.run, Pool.function and warm refuse to compile.

The programs are real and so are the processes; "built elsewhere" is an
entry compiled by a Pool whose workers ran with PJRT_NPROC=3, which the key
records, as it would record another host's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from cache_helpers import lowered
from conftest import pjrt_pool

from pool import Pool
from worker import compile_program
from worker.cache import DiskCache, open_cache
from worker.compile.never_compile import never_compile_on
from worker.errors import NeverCompileError

X = np.linspace(-1, 1, 4, dtype=np.float32)


def entries(cache_dir: Path) -> list[str]:
    folder = cache_dir / "entries"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_compile_program_refuses_and_says_what_the_cache_holds_instead(cache_dir, monkeypatch):
    program = lowered(5)
    with pytest.raises(NeverCompileError) as refused:
        compile_program(program, never_compile=True)
    error = refused.value
    assert isinstance(error, LookupError)
    assert error.program == program.name and len(error.key) == 64 and error.key in str(error)
    assert "nothing was compiled" in str(error) and error.differences == ""
    assert entries(cache_dir) == [] and open_cache(cache_dir).counters.misses == 1

    # The same program built elsewhere (here: workers with PJRT_NPROC=3): named, with the part.
    monkeypatch.setenv("PJRT_NPROC", "3")
    with Pool(1) as pool:
        elsewhere = pool.compile(program).key
    monkeypatch.delenv("PJRT_NPROC")
    with pytest.raises(NeverCompileError) as refused:
        compile_program(program, never_compile=True)
    assert elsewhere in refused.value.differences
    assert "environment.PJRT_NPROC: built with '3', here None" in str(refused.value)
    assert entries(cache_dir) == [f"{elsewhere}.pjx"]

    # The environment variable does the same; the option overrides it either way.
    monkeypatch.setenv("PJRT_POOL_COMPILE", "never")
    with pytest.raises(NeverCompileError):
        compile_program(program)
    _, statistics = compile_program(program, never_compile=False)
    assert statistics.compiled == 1
    _, statistics = compile_program(program)  # warm now: never-compile loads it
    assert statistics.loaded == 1 and statistics.compiled == 0
    monkeypatch.setenv("PJRT_POOL_COMPILE", "sometimes")
    with pytest.raises(ValueError, match="PJRT_POOL_COMPILE='sometimes'"):
        compile_program(program)
    with pytest.raises(TypeError, match="never_compile"):
        never_compile_on("yes")  # type: ignore[arg-type]


def test_without_a_disk_cache_never_compile_refuses_at_once(cache_dir):
    with pytest.raises(NeverCompileError, match="is not in no disk cache"):
        compile_program(lowered(6), disk_cache=False, never_compile=True)


def test_a_never_compile_pool_fails_the_task_without_a_worker(cache_dir):
    program = lowered(7)
    with Pool(1, never_compile=True) as pool:
        started = time.perf_counter()
        with pytest.raises(NeverCompileError) as refused:
            pool.run(program, [X])
        assert time.perf_counter() - started < 0.5  # no compile, no worker round trip
        assert refused.value.program == program.name
        with pytest.raises(NeverCompileError):
            pool.submit(program, [X])
        with pytest.raises(NeverCompileError):
            pool.submit_compile(program)
        # No worker did anything: it looked nothing up, and compiled nothing.
        assert pool.cache_counters.misses == 0 and pool.statistics.compiled == 0
        assert entries(cache_dir) == []
        compile_program(program)  # warmed now (in this process, into the pool's cache)
        (out,) = pool.run(program, [X])
        np.testing.assert_allclose(out, np.sin(X) * 9 + 9, rtol=1e-6)
        assert pool.statistics.loaded == 1 and pool.statistics.compiled == 0


def test_a_worker_refuses_an_entry_it_cannot_use_rather_than_compile(cache_dir):
    program = lowered(8)
    executable, _ = compile_program(program)
    path = DiskCache(cache_dir).path_of(executable.key)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the entry is there, so the parent lets the task through
    path.write_bytes(bytes(data))
    with Pool(1, never_compile=True) as pool:
        with pytest.raises(NeverCompileError, match="has no usable entry") as refused:
            pool.run(program, [X])
        assert "payload digest mismatch" in str(refused.value)
        assert pool.statistics.compiled == 0


def test_the_environment_variable_makes_pools_never_compile(cache_dir, monkeypatch):
    monkeypatch.setenv("PJRT_POOL_COMPILE", "never")
    with Pool(1) as pool, pytest.raises(NeverCompileError):
        pool.run(lowered(9), [X])
    with Pool(1, never_compile=False) as pool:
        pool.run(lowered(9), [X])  # the option overrides the variable
        assert pool.statistics.compiled == 1


def test_pool_function_fails_on_the_first_call_of_an_unwarmed_signature(cache_dir):
    def step(w, x):
        return jnp.tanh(x @ w)

    w, small, large = np.ones((4, 4), np.float32), np.ones((2, 4), np.float32), np.ones((8, 4))
    with Pool(1, never_compile=True) as pool:
        function = pool.function(step)
        compile_program(function.lower(w, small))  # warm one signature only
        np.testing.assert_allclose(function(w, small), np.tanh(small @ w), rtol=1e-6)
        with pytest.raises(NeverCompileError) as refused:
            function(w, large.astype(np.float32))
        assert refused.value.program == "jit_step"
        assert pool.statistics.compiled == 0


SPEC = """
import jax, jax.numpy as jnp
x = jax.ShapeDtypeStruct((4,), jnp.float32)
def programs():
    return [("warm_one", lambda a: jnp.sin(a) + 1.5, [x]), ("cold_one", lambda a: a * 7.25, [x]),
            ("cold_two", lambda a: a - 3.5, [x])]
"""


@pytest.mark.slow
def test_warm_in_never_compile_mode_stops_at_the_first_miss(tmp_path):
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    cache = tmp_path / "cache"
    common = ["--cache-dir", str(cache), "--workers", "1", "--json"]
    env = {"PJRT_POOL_COMPILE": "never"}
    done = pjrt_pool("warm", str(spec), *common, env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads(done.stdout)
    outcomes = [p["outcome"] for p in report["programs"]]
    assert "not warmed" in outcomes and set(outcomes) <= {"not warmed", "skipped"}
    assert report["statistics"]["compiled"] == 0 and entries(cache) == []
    first = next(p for p in report["programs"] if p["outcome"] == "not warmed")
    assert "NeverCompileError" in first["error"] and first["name"] in first["error"]
    # Warmed for real, then checked in never-compile mode: everything loads.
    assert pjrt_pool("warm", str(spec), *common).returncode == 0
    again = pjrt_pool("warm", str(spec), *common, env=env)
    assert again.returncode == 0, again.stdout[-2000:]
    statistics = json.loads(again.stdout)["statistics"]
    assert statistics["compiled"] == 0 and statistics["loaded"] == 3


def test_compile_many_returns_never_compile_errors_in_place(cache_dir):
    # compile_many(return_exceptions=True) raised the first NeverCompileError
    # (a LookupError raised at submit) instead of returning it in its place.
    warmed, missing = lowered(11), lowered(12)
    compile_program(warmed)
    with Pool(1, never_compile=True) as pool:
        results = pool.compile_many([warmed, missing], return_exceptions=True)
        assert results[0].name == warmed.name
        assert isinstance(results[1], NeverCompileError)
        with pytest.raises(NeverCompileError):
            pool.compile_many([warmed, missing])
