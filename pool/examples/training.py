"""Twelve training steps of transformer-like models: long, multithreaded compiles.

Each step is a gelu MLP plus an attention-like block, both behind RMS
normalization, with a mean-squared-error loss, its jax.grad and an SGD
update, on a batch of 256 in float32: widths 256, 512 and 1024 with 2, 4 and 8
layers, plus 768x6, 384x12 and 640x3. Each takes seconds to compile for a TPU,
which is what benchmarks/bench_tpu_compile.py compares pjrt-pool's pool with
JAX on.

    for name, function, shapes in train_steps():
        program = pool.lower(function, shapes, platform="tpu")

sharded_train_steps(mesh) gives the same steps split over a mesh of axes
("data", "model"), as a data- and model-parallel step is: the batch over
"data", W_in by columns and W_out by rows over "model", W_qk and the loss
replicated; each with the in_shardings and out_shardings to give jax.jit
(and pool.lower).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

BATCH = 256
SIZES = (
    (256, 2), (256, 4), (256, 8),
    (512, 2), (512, 4), (512, 8),
    (1024, 2), (1024, 4), (1024, 8),
    (768, 6), (384, 12), (640, 3),
)  # fmt: skip
"""(width, layers) of each step."""


def _rms(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _layer(x: jax.Array, w_in: jax.Array, w_out: jax.Array, w_qk: jax.Array) -> jax.Array:
    h = _rms(x)
    scores = jax.nn.softmax((h @ w_qk) @ h.T / jnp.sqrt(h.shape[-1]), axis=-1)
    x = x + scores @ h
    return x + jax.nn.gelu(_rms(x) @ w_in) @ w_out


def _loss(params: list[tuple[jax.Array, ...]], x: jax.Array, y: jax.Array) -> jax.Array:
    for w_in, w_out, w_qk in params:
        x = _layer(x, w_in, w_out, w_qk)
    return jnp.mean((x - y) ** 2)


def _step(layers: int) -> Callable[..., Any]:
    def step(x: jax.Array, y: jax.Array, *flat: jax.Array) -> tuple[Any, ...]:
        params = [tuple(flat[3 * i : 3 * i + 3]) for i in range(layers)]
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updated = [w - 0.01 * g for layer in zip(params, grads, strict=True)
                   for w, g in zip(*layer, strict=True)]  # fmt: skip
        return (loss, *updated)

    return step


def train_steps() -> list[tuple[str, Callable[..., Any], list[jax.ShapeDtypeStruct]]]:
    """(name, function, shapes) of each step: x and y of (BATCH, width), then per layer
    W_in (width, 4*width), W_out (4*width, width) and W_qk (width, width)."""
    steps = []
    for width, layers in SIZES:
        f32 = jnp.float32
        shapes = [jax.ShapeDtypeStruct((BATCH, width), f32)] * 2
        for _ in range(layers):
            shapes += [
                jax.ShapeDtypeStruct((width, 4 * width), f32),
                jax.ShapeDtypeStruct((4 * width, width), f32),
                jax.ShapeDtypeStruct((width, width), f32),
            ]
        steps.append((f"train_{width}x{layers}", _step(layers), shapes))
    return steps


def sharded_train_steps(mesh: Any) -> list[tuple[str, Callable[..., Any], list[Any], Any, Any]]:
    """(name, function, shapes, in_shardings, out_shardings) of each step over a mesh of axes
    ("data", "model") (see the module)."""
    data = NamedSharding(mesh, P("data", None))
    columns, rows = NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("model", None))
    replicated = NamedSharding(mesh, P())
    steps = []
    for name, function, shapes in train_steps():
        layers = (len(shapes) - 2) // 3
        weights = (columns, rows, replicated) * layers
        steps.append((name, function, shapes, (data, data, *weights), (replicated, *weights)))
    return steps
