"""lower() on JAX users' arguments: pytrees, typed PRNG keys, weak types, and their mistakes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from pool import compile_program, lower

F32 = jnp.float32


def sds(*shape: int, dtype=F32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    """A dataclass pytree, as flax and equinox users hold parameters."""

    w: jax.Array
    b: jax.Array


def layer(params: dict, batch: tuple, scale: list) -> dict:
    dense, extra = params["dense"], params["extra"]
    x, y = batch
    prediction = x @ dense.w + dense.b + extra[0]
    return {"loss": jnp.mean((prediction - y) ** 2) * scale[0], "prediction": prediction}


def test_lower_takes_pytrees_of_shapes_and_flattens_them_in_jax_order() -> None:
    shapes = [
        {"dense": Dense(sds(3, 2), sds(2)), "extra": (sds(2),)},
        (sds(4, 3), sds(4, 2)),
        [sds()],
    ]
    program = lower(layer, shapes)
    leaves = jax.tree_util.tree_leaves(shapes)
    assert program.input_types == tuple((np.dtype(s.dtype), s.shape) for s in leaves)
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s.shape).astype(np.float32) for s in leaves]
    executable, _ = compile_program(program)
    outputs = executable.run(values)
    expected = jax.jit(layer)(
        *jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), values)
    )
    # The outputs are the result's leaves in JAX's order: loss, then prediction.
    for got, want in zip(outputs, jax.tree_util.tree_leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_lower_takes_pytrees_of_arrays_and_none_leaves() -> None:
    arrays = {"a": np.ones(3, np.float32), "skip": None, "b": jnp.zeros((2,), F32)}
    program = lower(lambda tree: tree["a"].sum() + tree["b"].sum(), [arrays])
    assert [str(t) for t in program.input_types] == ["float32[3]", "float32[2]"]


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_keys_go_in_as_their_key_data(impl: str) -> None:
    key = jax.random.key(7, impl=impl)

    def sample(key, x):
        return x + jax.random.normal(key, x.shape)

    data = np.asarray(jax.random.key_data(key))
    for shape in (key, jax.ShapeDtypeStruct((), key.dtype)):
        program = lower(sample, [shape, sds(5)])
        assert [str(t) for t in program.input_types] == [f"uint32[{data.size}]", "float32[5]"]
        executable, _ = compile_program(program)
        (out,) = executable.run([data, np.zeros(5, np.float32)])
        np.testing.assert_allclose(out, jax.jit(sample)(key, jnp.zeros(5)), rtol=1e-6)


def test_a_batch_of_keys_and_keys_returned_are_key_data() -> None:
    keys = jax.random.split(jax.random.key(1), 3)

    def split_each(keys):
        return jax.vmap(jax.random.split)(keys)

    program = lower(split_each, [keys])
    assert [str(t) for t in program.input_types] == ["uint32[3,2]"]
    executable, _ = compile_program(program)
    (out,) = executable.run([np.asarray(jax.random.key_data(keys))])
    np.testing.assert_array_equal(out, jax.random.key_data(jax.jit(split_each)(keys)))


def test_weak_types_are_kept_as_jax_keeps_them() -> None:
    # A weakly typed float32 scalar times bfloat16 stays bfloat16 in JAX.
    weak = jax.ShapeDtypeStruct((), F32, weak_type=True)
    executable, _ = compile_program(lower(lambda x, y: x * y, [sds(3, dtype=jnp.bfloat16), weak]))
    assert [str(t) for t in executable.output_types] == ["bfloat16[3]"]
    strong = lower(lambda x, y: x * y, [sds(3, dtype=jnp.bfloat16), sds()])
    executable, _ = compile_program(strong)
    assert [str(t) for t in executable.output_types] == ["float32[3]"]


def _debug_print(x):
    jax.debug.print("x = {}", x)
    return x + 1


def _pure_callback(x):
    return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _io_callback_in_a_loop(x):
    def body(i, v):
        return io_callback(np.cos, jax.ShapeDtypeStruct(v.shape, v.dtype), v)

    return jax.lax.fori_loop(0, 3, body, x)


@pytest.mark.parametrize(
    ("function", "named"),
    [
        (_debug_print, "jax.debug.print"),
        (_pure_callback, "jax.pure_callback"),
        (_io_callback_in_a_loop, "io_callback"),
    ],
    ids=["debug-print", "pure-callback", "io-callback"],
)
def test_host_callbacks_are_refused_by_name(function, named: str) -> None:
    with pytest.raises(ValueError, match="calls back into Python") as caught:
        lower(function, [sds(2)])
    message = str(caught.value)
    assert named in message and "test_lower_pytrees.py" in message
    assert "standalone program cannot" in message and "NotImplementedError" not in message
    assert "EQX_ON_ERROR" not in message  # a callback of the user's own, not equinox's


@pytest.mark.parametrize(
    ("value", "where"),
    [("relu", r"shapes\[1\]"), ({"activation": "relu"}, r"shapes\[1\]\['activation'\]")],
    ids=["str", "str-in-a-dict"],
)
def test_a_value_that_is_not_an_array_suggests_static_argnums(value, where: str) -> None:
    with pytest.raises(TypeError, match=where) as caught:
        lower(lambda x, n: x, [sds(2), value])
    message = str(caught.value)
    assert "static_argnums" in message and "functools.partial" in message
    assert "jnp.asarray(x)" in message


def gymnax_like_step(params: dict, state: jax.Array) -> jax.Array:
    """gymnax's pattern: environment parameters that are plain Python floats and ints."""
    return state * params["gravity"] + params["steps"] + jnp.where(params["done"], 1, 0)


def test_python_scalars_in_pytrees_are_weakly_typed_inputs_as_in_jax_jit() -> None:
    params = {"gravity": 9.8, "steps": 3, "done": True}
    state = np.arange(3, dtype=np.float32).astype(jnp.bfloat16)
    program = lower(gymnax_like_step, [params, state])
    # Leaves in JAX's order: done, gravity, steps, then the state.
    assert [str(t) for t in program.input_types] == [
        "bool[]",
        "float32[]",
        "int32[]",
        "bfloat16[3]",
    ]
    executable, _ = compile_program(program)
    (got,) = executable.run(jax.tree_util.tree_leaves([params, state]))
    want = jax.jit(gymnax_like_step)(params, state)
    # The weak float keeps the result bfloat16, as under jax.jit; a strong float32 would not.
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got, want)
    assert str(lower(lambda x: x * 1.5, [1.0]).input_types[0]) == "float32[]"


def test_a_python_int_that_jax_cannot_trace_is_refused_as_jax_jit_refuses_it() -> None:
    with pytest.raises(OverflowError):
        jax.jit(lambda x: x)(2**40)
    with pytest.raises(TypeError, match=r"shapes\[0\]\['n'\].*too large"):
        lower(lambda p: p["n"], [{"n": 2**40}])
