"""Train steps of real models from popular libraries, for checking numbers against jax.jit.

Each builder returns a ModelStep: a train step (parameters, optimizer state and
batch in; the updated state and the loss out) and its seeded arguments, as a
user writes it with the library:

    gpt2       transformers' FlaxGPT2LMHeadModel with optax.adamw (pool.examples.gpt2),
               small
    resnet     a ResNet block of flax.linen (convolutions, batch norm, a residual
               connection) with optax.adam, its batch statistics updated each step
    cnn        a small flax.linen CNN on MNIST-sized images with optax.adam

The steps' state comes first in their arguments and outputs (``state`` leading
arguments are returned in the same order), so a loop feeds a step's outputs back
(``ModelStep.state``), and a pool keeps them in its worker
(``Pool.function(step, keep=...)``). The sizes are small so that a check runs in
seconds; the builders' keyword arguments make them larger. Needs flax, optax and (gpt2)
``transformers<5`` with HF_HUB_OFFLINE=1 (nothing is downloaded: weights are
initialized from a seed).

    model = cnn()
    expected = jax.jit(model.step)(*model.arguments)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class ModelStep(NamedTuple):
    """A train step and its arguments (see the module)."""

    name: str
    step: Callable[..., Any]
    arguments: tuple[Any, ...]
    state: int
    """How many leading arguments are state the step returns, in order, before its loss."""

    def feed(self, outputs: Any) -> tuple[Any, ...]:
        """The arguments of the next step: this step's state outputs, then the same batch."""
        return (*outputs[: self.state], *self.arguments[self.state :])


def _as_numpy(tree: Any) -> Any:
    return jax.tree_util.tree_map(np.asarray, tree)


def _initial(optimizer: Any, params: Any) -> Any:
    """An optimizer's initial state for params, made under jax.jit (run eagerly, each of
    its operations would compile on its own)."""
    return _as_numpy(jax.jit(optimizer.init)(params))


def gpt2(layers: int = 1, width: int = 32, vocab: int = 128, seq: int = 8, batch: int = 2,
         heads: int = 2) -> ModelStep:  # fmt: skip
    """transformers' GPT-2 language model with AdamW (pool.examples.gpt2), small."""
    from pool.examples.gpt2 import Gpt2

    model = Gpt2(layers, positions=seq, width=width, heads=heads, vocab=vocab)
    params, state = model.parameters()
    return ModelStep("gpt2", model.step, (params, state, model.tokens(batch, seq)), 2)


def resnet(channels: int = 4, size: int = 8, batch: int = 4, classes: int = 10) -> ModelStep:
    """A ResNet block of flax.linen with batch norm (training mode) and Adam."""
    import flax.linen as nn
    import optax

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.Conv(channels, (3, 3), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=False)(x))
            y = nn.Conv(channels, (3, 3), use_bias=False)(x)
            y = nn.relu(nn.BatchNorm(use_running_average=False)(y))
            y = nn.Conv(channels, (3, 3), use_bias=False)(y)
            y = nn.BatchNorm(use_running_average=False, scale_init=nn.initializers.zeros)(y)
            x = nn.relu(x + y)
            return nn.Dense(classes)(jnp.mean(x, axis=(1, 2)))

    model, optimizer = Block(), optax.adam(1e-3)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((batch, size, size, 3)).astype(np.float32)
    labels = rng.integers(0, classes, batch).astype(np.int32)
    variables = jax.jit(model.init)(jax.random.key(0), images)

    def step(params: Any, stats: Any, opt_state: Any, images: jax.Array, labels: jax.Array):
        def loss_fn(p: Any) -> tuple[jax.Array, Any]:
            logits, updated = model.apply(
                {"params": p, "batch_stats": stats}, images, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, updated["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, loss

    params = _as_numpy(variables["params"])
    state = (params, _as_numpy(variables["batch_stats"]), _initial(optimizer, params))
    return ModelStep("resnet", step, (*state, images, labels), 3)


def cnn(batch: int = 8, size: int = 28, classes: int = 10) -> ModelStep:
    """A small CNN of flax.linen on images of size x size (MNIST's 28) with Adam."""
    import flax.linen as nn
    import optax

    class Network(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.avg_pool(nn.relu(nn.Conv(8, (3, 3))(x)), (2, 2), (2, 2))
            x = nn.avg_pool(nn.relu(nn.Conv(16, (3, 3))(x)), (2, 2), (2, 2))
            return nn.Dense(classes)(x.reshape((x.shape[0], -1)))

    model, optimizer = Network(), optax.adam(1e-3)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((batch, size, size, 1)).astype(np.float32)
    labels = rng.integers(0, classes, batch).astype(np.int32)
    params = _as_numpy(jax.jit(model.init)(jax.random.key(0), images)["params"])

    def step(params: Any, opt_state: Any, images: jax.Array, labels: jax.Array):
        def loss_fn(p: Any) -> jax.Array:
            logits = model.apply({"params": p}, images)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return ModelStep("cnn", step, (params, _initial(optimizer, params), images, labels), 2)


MODELS: dict[str, Callable[[], ModelStep]] = {"gpt2": gpt2, "resnet": resnet, "cnn": cnn}
"""Every builder by its model's name."""
