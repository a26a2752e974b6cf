"""pool.save_inputs writes exactly the inputs `pjrt-pool run --inputs` reads.

The leaves of a pytree function's arguments, in JAX's order and of the types
the program takes (keys as key data, Python scalars weakly typed, float64 as
float32 while x64 is off, ml_dtypes' types as raw bytes), round-trip through
the command line to the outputs of calling the function.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import pjrt_pool

from pool import save_inputs
from pool.cli.main import UsageError
from pool.cli.run_files import read_inputs
from pool.lowering.lower import lower_tree
from worker.records import ArrayType

SPEC = """
import jax, jax.numpy as jnp, ml_dtypes, numpy as np

rng = np.random.default_rng(3)
PARAMS = {
    "dense": (rng.standard_normal((6, 4), np.float32), rng.standard_normal(4, np.float32)),
    "scale": 0.5,
}
BATCH = [rng.standard_normal((3, 6), np.float32), np.arange(4, dtype=np.int32)]
HALF = np.linspace(-2, 2, 5).astype(ml_dtypes.bfloat16)


def step(params, batch, key, half):
    weights, bias = params["dense"]
    hidden = jnp.tanh(batch[0] @ weights + bias) * params["scale"]
    noise = jax.random.normal(key, hidden.shape)
    return {"hidden": hidden + noise, "count": batch[1] * 3, "half": half.astype(jnp.float32) * 2}


def arguments():
    return PARAMS, BATCH, jax.random.key(7), HALF


def programs():
    return [("step", step, arguments())]
"""


def _load(path: Path) -> object:
    spec = importlib.util.spec_from_file_location("save_inputs_spec", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_saved_arrays_are_the_inputs_of_the_lowered_program(tmp_path: Path) -> None:
    def f(params, x, *, key, count):
        return params["w"] @ x + count, jax.random.normal(key, (2,)), params["b"][1]

    params = {"w": np.ones((2, 3)), "b": (np.int8(4), 2.5)}  # float64 w: float32 in the program
    arrays = save_inputs(
        tmp_path / "in.npz", params, np.arange(3.0), key=jax.random.key(1), count=3
    )
    traced = {"w": np.ones((2, 3), np.float32), "b": (np.int8(4), 2.5)}  # as jax.jit traces it
    program = lower_tree(
        f, (traced, np.zeros(3, np.float32)), {"key": jax.random.key(1), "count": 3}
    )
    assert [ArrayType.of(a.dtype, a.shape) for a in arrays] == list(program.program.input_types)
    # JAX's order: b before w (dict keys sorted), then x, then the keywords (count before key).
    assert [a.dtype.name for a in arrays] == [
        "int8",
        "float32",
        "float32",
        "float32",
        "int32",
        "uint32",
    ]
    np.testing.assert_array_equal(arrays[5], jax.random.key_data(jax.random.key(1)))
    with np.load(tmp_path / "in.npz") as saved:
        assert saved.files == [f"arr_{i}" for i in range(6)]
        for index, array in enumerate(arrays):
            np.testing.assert_array_equal(saved[f"arr_{index}"], array)


def test_narrow_float_types_survive_the_file(tmp_path: Path) -> None:
    values = np.linspace(-3, 3, 7)
    leaves = [values.astype(t) for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e5m2)]
    path = tmp_path / "narrow"  # written as named: no .npz appended
    arrays = save_inputs(path, leaves, np.float16(1.5))
    assert path.is_file() and not (tmp_path / "narrow.npz").exists()
    spec = SimpleNamespace(
        name="p", input_types=tuple(ArrayType.of(a.dtype, a.shape) for a in arrays)
    )
    read = read_inputs(str(path), spec, "--inputs")
    assert [a.dtype for a in read] == [a.dtype for a in arrays]
    for got, want in zip(read, arrays, strict=True):
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_a_leaf_that_is_not_a_value_is_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"argument 1\['b'\] is str"):
        save_inputs(tmp_path / "x.npz", np.ones(2), {"a": 1.0, "b": "text"})
    with pytest.raises(TypeError, match=r"keyword argument \['x'\] is a jax.ShapeDtypeStruct"):
        save_inputs(tmp_path / "x.npz", x=jax.ShapeDtypeStruct((2,), jnp.float32))
    assert not (tmp_path / "x.npz").exists()


def test_inputs_of_another_program_are_refused_by_run(tmp_path: Path) -> None:
    save_inputs(tmp_path / "in.npz", np.ones(3, np.float32))
    spec = SimpleNamespace(name="p", input_types=(ArrayType.of(np.float32, (3,)),) * 2)
    with pytest.raises(UsageError, match="takes 2 arguments"):
        read_inputs(str(tmp_path / "in.npz"), spec, "--inputs")


def test_a_pytree_program_runs_from_the_command_line_on_saved_arguments(tmp_path: Path) -> None:
    spec_file, cache, manifest = tmp_path / "spec.py", tmp_path / "cache", tmp_path / "m.json"
    spec_file.write_text(SPEC)
    warm = pjrt_pool(
        "warm",
        str(spec_file),
        "--workers",
        "1",
        "--cache-dir",
        str(cache),
        "--manifest",
        str(manifest),
    )
    assert warm.returncode == 0, warm.stderr[-3000:]
    module = _load(spec_file)
    arguments = module.arguments()
    expected = jax.tree_util.tree_leaves(jax.jit(module.step)(*arguments))
    arrays = save_inputs(tmp_path / "inputs.npz", *arguments)

    run = pjrt_pool(
        "run", str(manifest), "step", "--inputs", str(tmp_path / "inputs.npz"), "--json"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    outputs = json.loads(run.stdout)["outputs"]
    assert [(o["dtype"], tuple(o["shape"])) for o in outputs] == [
        (str(e.dtype), e.shape) for e in expected
    ]
    for output, want in zip(outputs, expected, strict=True):
        assert output["sum"] == pytest.approx(float(np.asarray(want, np.float64).sum()), rel=1e-5)

    from pool.manifest import load_manifest

    got = load_manifest(str(manifest)).run("step", arrays)  # the same arrays, in this process
    for value, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(value, np.asarray(want), rtol=1e-6, atol=1e-6)
