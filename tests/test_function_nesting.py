"""PoolFunctions called inside a lowering trace into their functions, as nested jax.jit does.

Outside any lowering, a call with tracers stays refused (TracedPoolFunctionError).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pool import Pool, TracedPoolFunctionError, compile_program, lower


@pytest.fixture(scope="module")
def pool() -> Pool:
    with Pool(workers=1) as shared:
        yield shared


def test_recursion_through_a_pool_function_returns_what_jax_jit_returns(pool) -> None:
    def doubled(x, n):
        return x if n == 0 else ours(x, n - 1) * 2

    def doubled_jit(x, n):
        return x if n == 0 else theirs(x, n - 1) * 2

    ours = pool.function(doubled, static_argnums=1)
    theirs = jax.jit(doubled_jit, static_argnums=1)
    got, want = ours(1.0, 3), theirs(1.0, 3)
    assert float(want) == 8.0
    assert float(got) == 8.0 and got.dtype == want.dtype and got.shape == want.shape
    # One program, lowered once: the nested calls were traced into it, not run apart.
    assert "1 signatures" in repr(ours)
    assert ours.lower(1.0, 3).text.count("stablehlo.multiply") == 3


def test_a_pool_function_inside_another_ones_lowering_is_part_of_its_program(pool) -> None:
    inner = pool.function(lambda x, scale: jnp.sin(x) * scale, static_argnames="scale")
    outer = pool.function(
        lambda x: inner(x, scale=3.0) + jax.grad(lambda y: inner(y, 2.0).sum())(x)
    )
    reference = jax.jit(
        lambda x: jnp.sin(x) * 3.0 + jax.grad(lambda y: (jnp.sin(y) * 2.0).sum())(x)
    )
    x = np.linspace(0, 1, 5, dtype=np.float32)
    np.testing.assert_allclose(outer(x), reference(x), rtol=1e-6)
    assert "0 signatures" in repr(inner)  # never run on its own


def test_lower_of_a_function_that_calls_a_pool_function_traces_into_it(pool) -> None:
    inner = pool.function(lambda x: x * 2 + 1)
    program = lower(lambda x: inner(x) - 1, [jax.ShapeDtypeStruct((3,), jnp.float32)])
    executable, _ = compile_program(program)
    (got,) = executable.run([np.arange(3, dtype=np.float32)])
    np.testing.assert_array_equal(got, [0.0, 2.0, 4.0])


def test_a_pool_function_traced_outside_any_lowering_is_still_refused(pool) -> None:
    inner = pool.function(lambda x: x * 2)
    x = np.ones(3, np.float32)
    with pytest.raises(TracedPoolFunctionError, match="runs its program in a worker"):
        jax.jit(lambda x: inner(x) + 1)(x)
    # An error raised inside a lowering leaves no lowering state behind.
    failing = pool.function(lambda x: inner(x) + undefined_name)  # noqa: F821
    with pytest.raises(NameError):
        failing(x)
    with pytest.raises(TracedPoolFunctionError):
        jax.vmap(inner)(x)
    np.testing.assert_array_equal(inner(x), 2 * x)


def test_a_nested_pool_functions_custom_calls_are_allowed_in_the_outer_program(pool) -> None:
    target = "pjrt_pool_test_nested_target"

    def call(x):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    inner = pool.function(call, custom_calls=[target])
    outer = pool.function(lambda x: inner(x) * 2)  # names no custom calls itself
    program = outer.lower(np.ones(3, np.float32))
    assert target in program.text
    with pytest.raises(ValueError, match=target):
        pool.function(lambda x: call(x) * 2).lower(np.ones(3, np.float32))
