"""Programs of the TPU tests, importable by the tests' child processes too."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


NARROW = {
    "mul_32x16": (lambda x: x * 2, [f32(32, 16)]),
    "transpose_16x32": (lambda x: x.T, [f32(16, 32)]),
    "matmul_256x32": (lambda a, b: a @ b, [f32(256, 64), f32(64, 32)]),
    "batched_4x32x16": (
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        [f32(4, 32, 8), f32(4, 8, 16)],
    ),
    "mlp_grad": (
        lambda w1, w2, x: jax.grad(
            lambda w1, w2: jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2), argnums=(0, 1)
        )(w1, w2),
        [f32(64, 128), f32(128, 16), f32(32, 64)],
    ),
}
