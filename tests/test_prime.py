"""Primed loads: a program's first execution happens at load, on zeros, and changes nothing a
later run sees (Executable.prime, load_manifest(prime=True), Manifest.prime, run --prime)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pjrt_pool, run_python

from pool import compile_program, lower
from pool.manifest import Manifest, load_manifest
from worker.compile.executable import Executable, keeps_state
from worker.records import ProgramSpec

F32 = jnp.float32


def _mlp(x, w1, w2):
    return (jnp.tanh(x @ w1) @ w2,)


MLP_TYPES = [
    jax.ShapeDtypeStruct((64, 256), F32),
    jax.ShapeDtypeStruct((256, 512), F32),
    jax.ShapeDtypeStruct((512, 256), F32),
]


def _rng(x):
    return x + jax.lax.rng_uniform(jnp.float32(0), jnp.float32(1), (8,))


def _manifest(directory: Path, programs: dict) -> Path:
    """Compiles programs (name: (function, types)) into cache_dir and writes their manifest."""
    cache = directory / "cache"
    specs = []
    for name, (function, types) in programs.items():
        executable, _ = compile_program(lower(function, types), cache_dir=cache)
        specs.append(ProgramSpec.from_executable(name, executable))
    path = directory / "m.json"
    Manifest(specs, str(cache), "cpu").write(path)
    return path


def _inputs(seed: int = 0) -> list[np.ndarray]:
    generator = np.random.default_rng(seed)
    return [generator.standard_normal(t.shape).astype(np.float32) for t in MLP_TYPES]


def test_priming_runs_on_zeros_and_changes_no_result(tmp_path):
    path = _manifest(tmp_path, {"mlp": (_mlp, MLP_TYPES)})
    plain = load_manifest(path)
    primed = load_manifest(path, prime=True)
    assert primed.prime_on_load and not plain.prime_on_load
    for seed in range(3):
        expected = plain.run("mlp", _inputs(seed))
        got = primed.run("mlp", _inputs(seed))
        assert [a.tobytes() for a in got] == [a.tobytes() for a in expected]
    assert primed.prime(["mlp"]) == ["mlp"]  # it ran as the program loaded
    assert plain.prime() == ["mlp"]  # loaded without priming: primed now, once
    assert plain.executable("mlp").prime()  # an Executable can be primed again by hand


def test_a_program_with_rng_state_is_not_primed(tmp_path):
    """stablehlo.rng draws from a counter each run advances: priming would shift the draws."""
    executable, _ = compile_program(
        lower(_rng, [jax.ShapeDtypeStruct((8,), F32)]), cache_dir=tmp_path / "c"
    )
    x = np.zeros(8, np.float32)
    first, second = executable.run([x]), executable.run([x])
    assert not np.array_equal(first[0], second[0])  # the state is real
    assert keeps_state(executable.serialize())
    assert not executable.prime()
    loaded = Executable.deserialize(executable.serialize())
    loaded.input_types = executable.input_types
    assert not loaded.prime()


def test_an_executable_without_input_types_is_not_primed(tmp_path):
    executable, _ = compile_program(lower(_mlp, MLP_TYPES), cache_dir=tmp_path / "c")
    loaded = Executable.deserialize(executable.serialize())
    assert loaded.input_types is None
    assert not keeps_state(executable.serialize())
    assert not loaded.prime()


# A child that loads a manifest's program, primed or not, and times its first two runs.
FIRST_RUNS = """
import json, sys, time
import numpy as np
from pool.manifest import load_manifest

manifest = load_manifest(sys.argv[1], prime=sys.argv[2] == "prime")
spec = manifest.spec("mlp")
inputs = [np.full(t.shape, 0.01, t.dtype) for t in spec.input_types]
manifest.executable("mlp")
times = []
for _ in range(4):
    started = time.perf_counter()
    manifest.run("mlp", inputs)
    times.append(time.perf_counter() - started)
print(json.dumps(times))
"""


def _first_runs(manifest: Path, mode: str) -> list[float]:
    code = FIRST_RUNS.replace("sys.argv[1]", repr(str(manifest))).replace("sys.argv[2]", repr(mode))
    return json.loads(run_python(code).stdout.splitlines()[-1])


@pytest.mark.slow
def test_the_first_request_after_priming_runs_at_the_warm_speed(tmp_path):
    path = _manifest(tmp_path, {"mlp": (_mlp, MLP_TYPES)})
    # Alternated, medians of 5: other work on the machine moves single runs by
    # milliseconds. A burst of it (a profiler beside CI once made both first runs 3.8
    # ms) can hide the difference for a while: measured again, at most twice more.
    # Priming that did nothing would never show it.
    for _attempt in range(3):
        unprimed, primed = [], []
        for _ in range(5):
            unprimed.append(_first_runs(path, "plain"))
            primed.append(_first_runs(path, "prime"))
        warm = min(min(times[1:]) for times in unprimed + primed)
        first_unprimed = sorted(times[0] for times in unprimed)[2]
        first_primed = sorted(times[0] for times in primed)[2]
        # Unprimed, the plugin's first execution costs extra; primed, that happened at
        # load, so what is left of the extra is less than half of it.
        if first_unprimed > 2 * warm and first_primed - warm < (first_unprimed - warm) / 2:
            return
    raise AssertionError(
        f"three measurements without priming's effect; the last: first run unprimed "
        f"{first_unprimed * 1e3:.2f} ms, primed {first_primed * 1e3:.2f} ms, warm "
        f"{warm * 1e3:.2f} ms (primed - warm must be under half of unprimed - warm)"
    )


def test_run_prime_primes_as_it_loads_and_gives_the_same_outputs(tmp_path):
    path = _manifest(tmp_path, {"mlp": (_mlp, MLP_TYPES)})
    results = {}
    for flags in ((), ("--prime",)):
        done = pjrt_pool("run", str(path), "mlp", "--json", *flags)
        assert done.returncode == 0, done.stderr
        results[flags] = json.loads(done.stdout)
    assert results[("--prime",)]["primed"] is True
    assert results[()]["primed"] is False
    assert results[("--prime",)]["outputs"] == results[()]["outputs"]
    text = pjrt_pool("run", str(path), "mlp", "--prime")
    assert text.returncode == 0 and "mlp: loaded and primed from the cache" in text.stdout


def test_run_prime_with_workers_is_a_usage_error(tmp_path):
    path = _manifest(tmp_path, {"mlp": (_mlp, MLP_TYPES)})
    done = pjrt_pool("run", str(path), "mlp", "--prime", "--workers", "1")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--prime" in lines[0] and "--workers" in lines[0], done.stderr


def test_the_cli_called_as_a_function_returns(tmp_path, capsys):
    """Only the command line ends without the plugin's teardown: main(argv) returns."""
    from pool.cli.main import main

    path = _manifest(tmp_path, {"mlp": (_mlp, MLP_TYPES)})
    assert main(["run", str(path), "mlp", "--prime"]) == 0
    assert "mlp: loaded and primed from the cache" in capsys.readouterr().out
