"""Pool.function where real JAX code surprised it: each case answers as jax.jit does.

Issue 16's items 9 to 16, each against jax.jit in the same process, through a
real Pool of worker processes.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import child

from pool import Pool, TracedPoolFunctionError, lower


@pytest.fixture(scope="module")
def pool() -> Pool:
    with Pool(workers=1) as shared:
        yield shared


def same(got, want) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (g, w)
        if g.dtype != jax.dtypes.float0:
            np.testing.assert_array_equal(g, w)


# -- 9. statics keyed by value and type ----------------------------------------------------


def test_static_arguments_of_equal_value_and_other_types_are_other_programs(pool) -> None:
    ours = pool.function(lambda x, k: x * k, static_argnums=1)
    theirs = jax.jit(lambda x, k: x * k, static_argnums=1)
    xi = np.arange(3, dtype=np.int32)
    for k in (1, 1.0, True, np.int32(1), 0, False, 0.0):
        same(ours(xi, k), theirs(xi, k))
    assert ours(xi, 1.0).dtype == np.float32  # after 1: not int32's program


# -- 10. static_argnames and defaults ----------------------------------------------------------


def apply(params, x, train=False):
    """The common pattern: a model's apply with a static train flag left to its default."""
    y = x @ params["w"]
    return y * 0.5 if train else y


def test_a_static_argument_left_to_its_default_and_static_argnames(pool) -> None:
    params = {"w": np.full((3, 2), 2.0, np.float32)}
    x = np.ones((4, 3), np.float32)
    for options in ({"static_argnums": 2}, {"static_argnames": "train"}):
        ours, theirs = pool.function(apply, **options), jax.jit(apply, **options)
        same(ours(params, x), theirs(params, x))
        same(ours(params, x, True), theirs(params, x, True))
        same(ours(params, x, train=True), theirs(params, x, train=True))
    step = pool.function(lambda x, train=False: x + (1 if train else 0), static_argnums=1)
    np.testing.assert_array_equal(step(np.zeros(2, np.float32)), np.zeros(2))
    with pytest.raises(ValueError, match="static_argnames names"):
        pool.function(apply, static_argnames="training")


# -- 11. no lock held while tracing --------------------------------------------------------------


def test_a_pool_function_that_calls_itself_while_lowering_returns(pool) -> None:
    # Before, the signature lock was held while f traced, and this hung forever:
    # run in a child, so that a hang fails the test rather than the suite.
    done = child(
        """
        import jax.numpy as jnp
        with Pool(workers=1) as pool:
            def f(x, depth):
                if depth == 0:
                    return x + 1
                inner = step(np.ones(3, np.float32), depth - 1)  # a concrete call, in a worker
                return x + inner
            step = pool.function(f, static_argnums=1)
            print("result", step(np.zeros(3, np.float32), 2).tolist())
        """,
        timeout=120,
    )
    assert "result [3.0, 3.0, 3.0]" in done.stdout


# -- 12. the trace context is part of the signature ---------------------------------------------


def test_config_that_changes_programs_is_part_of_the_signature(pool) -> None:
    add = pool.function(lambda a, b: a + b)
    reference = jax.jit(lambda a, b: a + b)
    a, b = np.ones(3, np.float32), np.ones((2, 1), np.float32)
    same(add(a, b), reference(a, b))
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="could not be broadcast"):
            reference(a, b)
        with pytest.raises(ValueError, match="could not be broadcast"):
            add(a, b)
    ints = np.ones(3, np.int32)
    same(add(a, ints), reference(a, ints))
    with jax.numpy_dtype_promotion("strict"), pytest.raises(jax.dtypes.TypePromotionError):
        add(a, ints)

    bits = pool.function(lambda key: jax.random.bits(key, (8,)))
    reference_bits = jax.jit(lambda key: jax.random.bits(key, (8,)))
    key = jax.random.key(0)
    seen = []
    for partitionable in (True, False, True):
        with jax.threefry_partitionable(partitionable):
            seen.append(reference_bits(key))
            same(bits(key), seen[-1])
    assert not np.array_equal(seen[0], seen[1])  # the setting does change the bits


# -- 13. a PoolFunction cannot be traced ----------------------------------------------------------


def test_transforming_a_pool_function_says_it_cannot_be_traced(pool) -> None:
    square = pool.function(lambda x: (x * x).sum())
    x = np.arange(3, dtype=np.float32)
    for transform in (jax.grad, jax.vmap, jax.jit):
        with pytest.raises(TracedPoolFunctionError, match="runs its program in a worker"):
            transform(square)(x)
    assert isinstance(TracedPoolFunctionError("x"), TypeError)
    np.testing.assert_array_equal(pool.function(jax.grad(lambda x: (x * x).sum()))(x), 2 * x)


# -- 14. float0 results -------------------------------------------------------------------------


def test_float0_results_are_float0_arrays_as_under_jax_jit(pool) -> None:
    def loss(x, n):
        return (x * n[0]).sum()

    gradients = jax.grad(loss, argnums=(0, 1), allow_int=True)
    x, n = np.ones(3, np.float32), np.arange(2, dtype=np.int32)
    ours, theirs = pool.function(gradients)(x, n), jax.jit(gradients)(x, n)
    same(ours, theirs)
    assert ours[1].dtype == jax.dtypes.float0 and ours[1].shape == (2,)


# -- 15. callbacks found in the program, not in error text --------------------------------------


def test_a_users_own_error_about_host_callbacks_is_the_users(pool) -> None:
    def unfinished(x):
        raise NotImplementedError("host_callbacks are not supported by my library yet")

    shapes = [jax.ShapeDtypeStruct((3,), jnp.float32)]
    with pytest.raises(NotImplementedError, match="my library"):
        lower(unfinished, shapes)
    with pytest.raises(NotImplementedError, match="my library"):
        pool.function(unfinished)(np.ones(3, np.float32))

    def printing(x):
        jax.debug.print("x = {}", x)
        return x + 1

    with pytest.raises(ValueError, match=r"calls back into Python \(jax.debug.print at"):
        lower(printing, shapes)


# -- 16. a lowered signature's call never touches the program text -------------------------------


def _warm_call_seconds(function, argument, calls: int = 7) -> float:
    """The median time of a call, once the function is lowered and loaded."""
    function(argument)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        function(argument)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@pytest.mark.slow
def test_a_call_with_a_large_constant_costs_what_a_small_one_costs(pool) -> None:
    big = np.random.default_rng(0).standard_normal(16 << 20).astype(np.float32)  # 64 MiB

    def with_constant(x):
        return x + jnp.asarray(big)[:4]

    heavy = pool.function(with_constant)
    x = np.zeros(4, np.float32)
    program = heavy.lower(x)
    assert len(program.text) > 128 << 20  # the constant is in the text, as hex
    light = pool.function(lambda x: x + 1)
    tiny = _warm_call_seconds(light, x)
    large = _warm_call_seconds(heavy, x)
    # Hashing the 134 MB text took ~200 ms a call; a lookup costs nothing like it.
    assert large < 10 * tiny + 0.02, (large, tiny)
    np.testing.assert_array_equal(heavy(x), big[:4])
