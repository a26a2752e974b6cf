"""Pool.function: JAX code as users write it, run in workers, answering as jax.jit does."""

from __future__ import annotations

import dataclasses
import threading
import warnings
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pool_helpers import handler_initializer

from pool import (
    LoweredProgram,
    Pool,
    ProgramQuarantinedError,
    TaskTimeoutError,
    WorkerCrashedError,
)

F32 = jnp.float32


@pytest.fixture(scope="module")
def pool() -> Pool:
    with Pool(workers=2) as shared:
        yield shared


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    w: jax.Array
    b: jax.Array


def init() -> tuple[dict, tuple]:
    params = {"hidden": Dense(jnp.full((3, 4), 0.1), jnp.zeros(4)), "out": [jnp.ones((4, 2))]}
    momentum = jax.tree_util.tree_map(jnp.zeros_like, params)
    return params, (momentum, jnp.zeros((), jnp.int32))


def train_step(params: dict, state: tuple, batch: dict, key: jax.Array, learning_rate):
    """One step of SGD with momentum and dropout: pytrees in, pytrees and a key out."""
    momentum, count = state
    key, dropout = jax.random.split(key)

    def loss(p):
        hidden = jnp.tanh(batch["x"] @ p["hidden"].w + p["hidden"].b)
        keep = jax.random.bernoulli(dropout, 0.9, hidden.shape)
        prediction = jnp.where(keep, hidden / 0.9, 0.0) @ p["out"][0]
        return jnp.mean((prediction - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    momentum = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, momentum, grads)
    params = jax.tree_util.tree_map(lambda p, m: p - learning_rate * m, params, momentum)
    return params, (momentum, count + 1), {"loss": value, "key": key}


def batch(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((8, 3)).astype(np.float32),
        "y": rng.standard_normal((8, 2)).astype(np.float32),
    }


def is_key(leaf) -> bool:
    return jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def assert_same(got, want) -> None:
    """The same tree; numpy leaves (keys as keys) with jax.jit's dtypes and values."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        if is_key(w):
            assert is_key(g) and g.dtype == w.dtype
            np.testing.assert_array_equal(jax.random.key_data(g), jax.random.key_data(w))
            continue
        assert type(g) is np.ndarray and g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


def test_a_train_step_returns_what_jax_jit_returns(pool: Pool) -> None:
    step, reference = pool.function(train_step), jax.jit(train_step)
    params, state = init()
    expected_params, expected_state = params, state
    key = expected_key = jax.random.key(0)
    for seed in range(3):
        params, state, metrics = step(params, state, batch(seed), key, 0.05)
        expected_params, expected_state, expected = reference(
            expected_params, expected_state, batch(seed), expected_key, 0.05
        )
        assert_same((params, state, metrics), (expected_params, expected_state, expected))
        key, expected_key = metrics["key"], expected["key"]
    assert int(state[1]) == 3


def test_lowers_once_per_signature_like_jax_jit(pool: Pool) -> None:
    traced = []

    def scale(x, factor):
        traced.append(x.shape)
        return x * factor

    scaled = pool.function(scale)
    x = np.ones(4, np.float32)
    scaled(x, 2.0)
    scaled(x + 1, 3.0)  # same shapes, dtypes and weak types: no new trace
    scaled(jnp.asarray(x), 4.0)  # a JAX array of the same type
    assert traced == [(4,)]
    scaled(np.ones(5, np.float32), 2.0)  # a new shape
    scaled(x, np.float32(2.0))  # a strongly typed scalar: another signature
    scaled(x.astype(np.float64), 2.0)  # float64 is float32 with x64 off, as in jax.jit
    assert traced == [(4,), (5,), (4,)]


def test_static_arguments_are_part_of_the_signature(pool: Pool) -> None:
    traced = []

    def power(x, exponent, *, shift):
        traced.append(exponent)
        return x**exponent + shift

    powered = pool.function(power, static_argnums=1)
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(powered(x, 2, shift=1.0), x**2 + 1)
    np.testing.assert_array_equal(powered(x, 3, shift=np.float32(2)), x**3 + 2)
    np.testing.assert_array_equal(powered(x, 2, shift=5.0), x**2 + 5)  # seen: no trace
    np.testing.assert_array_equal(powered(x, 2, shift=np.float32(1)), x**2 + 1)
    assert traced == [2, 3, 2]  # shift is dynamic: only its type counts, weak or not
    with pytest.raises(ValueError, match=r"static argument 1 \(list\) is not hashable"):
        powered(x, [2], shift=1.0)
    with pytest.raises(ValueError, match=r"static_argnums=\(3,\) names positions"):
        pool.function(power, static_argnums=3)  # as jax.jit refuses it


def test_python_scalars_are_weakly_typed_as_in_jax_jit(pool: Pool) -> None:
    def multiply(x, y):
        return x * y

    run, reference = pool.function(multiply), jax.jit(multiply)
    for x, y in [
        (np.ones(3, jnp.bfloat16), 2.0),
        (np.ones(3, np.int8), 3),
        (2, 3),
        (2.5, True),
        (np.ones(2, np.float16), 1j),
    ]:
        assert_same(run(x, y), reference(x, y))


def test_keys_in_and_out(pool: Pool) -> None:
    def fork(keys):
        return {
            "next": jax.vmap(lambda k: jax.random.split(k)[0])(keys),
            "bits": jax.random.bits(keys[0]),
        }

    keys = jax.random.split(jax.random.key(3, impl="rbg"), 4)
    result = pool.function(fork)(keys)
    assert_same(result, jax.jit(fork)(keys))
    assert jax.random.key_impl(result["next"]) == jax.random.key_impl(keys)


def test_submit_lower_and_keyword_arguments(pool: Pool) -> None:
    def affine(x, *, weights):
        return {"y": x @ weights["w"] + weights["b"]}

    run = pool.function(affine)
    x = np.ones((2, 3), np.float32)
    weights = {"w": np.full((3, 4), 0.5, np.float32), "b": np.arange(4, dtype=np.float32)}
    future = run.submit(x, weights=weights)
    assert isinstance(future, Future)
    assert_same(future.result(), jax.jit(affine)(x, weights=weights))
    program = run.lower(x, weights=weights)
    assert isinstance(program, LoweredProgram) and program.name == "jit_affine"
    assert program.platform == pool.worker_info[0]["plugin"]["platform"]
    # The inputs are the leaves in JAX's order: x, then the keyword's b and w.
    assert [str(t) for t in program.input_types] == ["float32[2,3]", "float32[4]", "float32[3,4]"]
    shapes = jax.ShapeDtypeStruct((2, 3), F32)
    assert run.lower(shapes, weights=weights) == program
    with pytest.raises(TypeError, match=r"use \.lower\(\)"):
        run(shapes, weights=weights)


def test_concurrent_calls_from_threads(pool: Pool) -> None:
    run = pool.function(lambda tree: {"sum": tree["a"] + tree["b"], "n": tree["a"].size})
    results: dict[int, np.ndarray] = {}

    def call(i: int) -> None:
        a = np.full(4 + i % 2, float(i), np.float32)
        results[i] = run({"a": a, "b": a})["sum"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, value in results.items():
        np.testing.assert_array_equal(value, np.full(4 + i % 2, 2.0 * i))


def test_bad_arguments_say_what_to_do(pool: Pool) -> None:
    run = pool.function(lambda x, options: x * 2)
    with pytest.raises(TypeError, match=r"argument 1\['mode'\] is str.*static_argnums=\(1,\)"):
        run(np.ones(2), {"mode": "fast"})
    with pytest.raises(TypeError, match="function must be callable"):
        pool.function(42)
    with pytest.raises(TypeError, match="static_argnums must be an int"):
        pool.function(abs, static_argnums="0")


def test_donate_argnums_is_accepted_with_a_warning(pool: Pool) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = pool.function(lambda x: x + 1, donate_argnums=(0,))
    assert len(caught) == 1 and "ignores donate_argnums" in str(caught[0].message)
    assert caught[0].filename == __file__
    x = np.ones(3, np.float32)
    np.testing.assert_array_equal(run(x), x + 1)
    np.testing.assert_array_equal(x, 1.0)  # the "donated" array is still valid


@pytest.mark.slow
def test_crashes_quarantine_and_timeouts_are_the_pools(ffi_library) -> None:
    def crash(x):
        return jax.ffi.ffi_call("null_deref", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    def spin(x):
        return jax.lax.fori_loop(0, 2_000_000_000, lambda i, v: jnp.sin(v) + 1e-3, x)

    initializer = handler_initializer(str(ffi_library))
    with Pool(workers=1, initializer=initializer, max_crashes=2, task_timeout=3.0) as pool:
        crashing = pool.function(crash, custom_calls=["null_deref"], name="crashing")
        x = np.ones(8, np.float32)
        for _ in range(2):
            with pytest.raises(WorkerCrashedError, match="SIGSEGV") as caught:
                crashing(x)
            assert "'crashing'" in str(caught.value)
        with pytest.raises(ProgramQuarantinedError):
            crashing.submit(x)
        with pytest.raises(TaskTimeoutError, match="within 3 s"):
            pool.function(spin)(np.ones(1, np.float32))
        np.testing.assert_array_equal(pool.function(lambda v: v + 1)(x), x + 1)
