"""A warm spec for the tests: 20 good programs and four that fail in four ways."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pool.warm.spec_file import WarmProgram

GOOD = 20


def _shape(*dims: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(dims, jnp.float32)


def _scaled(factor: float):
    return lambda x: jnp.sin(x) * factor + jnp.cos(x)


def _refuses_to_trace(x):
    raise ValueError("this function does not lower")


def _slow_to_compile(x):
    # An unrolled loop of matmuls: XLA takes about 20 s to compile it on a
    # quiet 2-core machine (400 steps took 8 s, as long as the tests' timeout).
    return jax.lax.fori_loop(0, 1000, lambda i, v: jnp.tanh(v @ v) + i, x, unroll=True)


def _unregistered_call(x):
    return jax.ffi.ffi_call("pjrt_pool_test_unregistered", jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x
    )


def programs() -> list:
    entries: list = [(f"good_{i:02d}", _scaled(float(i)), [_shape(16, 16)]) for i in range(GOOD)]
    entries += [
        WarmProgram("crash", _scaled(-1.0), [_shape(4)], compile_options=b""),
        ("does_not_lower", _refuses_to_trace, [_shape(4)]),
        ("hangs", _slow_to_compile, [_shape(16, 16)]),
        ("compile_error", _unregistered_call, [_shape(4)], None, ["pjrt_pool_test_unregistered"]),
    ]
    return entries
