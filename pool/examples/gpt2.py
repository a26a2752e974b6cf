"""A real model from a library users use: transformers' Flax GPT-2, its forward and its AdamW
train step (optax), for the checks and benchmarks that compare pjrt-pool with jax.jit on it.

Needs transformers (4.x: its Flax models; install it without its flax extra, which pins an
old jax), flax and optax, which pjrt-pool itself does not depend on; set HF_HUB_OFFLINE=1
where no hub is reachable (nothing is downloaded: the model is built from its config).

    model = Gpt2(layers=4)                      # GPT-2 width: 768 wide, 12 heads, 50257 tokens
    small = Gpt2(1, positions=8, width=32, heads=2, vocab=128)   # a check's model, in seconds
    params, state = model.parameters()          # made on the CPU, as numpy arrays
    params, state, loss = jax.jit(model.step)(params, state, tokens)

The model object is made on the CPU (its PRNG key is setup, not the model's work), so that
a process that only runs the step compiles nothing else on its device.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

WIDTH, HEADS, VOCAB = 768, 12, 50257
"""GPT-2's width, heads and vocabulary."""


class Gpt2:
    """A GPT-2 language model of `layers` layers, GPT-2's width unless told (see the module)."""

    def __init__(
        self,
        layers: int = 4,
        positions: int = 1024,
        learning_rate: float = 1e-3,
        *,
        width: int = WIDTH,
        heads: int = HEADS,
        vocab: int = VOCAB,
    ):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import optax
        from transformers import FlaxGPT2LMHeadModel, GPT2Config

        self.config = GPT2Config(
            n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=positions
        )
        with jax.default_device(jax.devices("cpu")[0]):
            self._lm = FlaxGPT2LMHeadModel(self.config, seed=0, _do_init=False)
        self.optimizer = optax.adamw(learning_rate)

    def forward(self, params: Any, tokens: Any) -> Any:
        """The logits of a batch of token ids."""
        return self._lm(tokens, params=params, train=False).logits

    def loss(self, params: Any, tokens: Any) -> Any:
        """Next-token cross-entropy of a batch."""
        log_probs = jax.nn.log_softmax(self.forward(params, tokens)[:, :-1])
        return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], -1))

    def step(self, params: Any, state: Any, tokens: Any) -> Any:
        """One AdamW step: (parameters, optimizer state, loss)."""
        import optax

        value, grads = jax.value_and_grad(self.loss)(params, tokens)
        updates, state = self.optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    def shapes(self) -> tuple[Any, Any]:
        """The parameters' and optimizer state's shapes, as pytrees of ShapeDtypeStructs."""
        from transformers import FlaxGPT2LMHeadModel

        params = jax.eval_shape(lambda: FlaxGPT2LMHeadModel(self.config, seed=0).params)
        return params, jax.eval_shape(self.optimizer.init, params)

    def parameters(self) -> tuple[Any, Any]:
        """Freshly initialized parameters and optimizer state (seed 0), made on the CPU."""
        from transformers import FlaxGPT2LMHeadModel

        with jax.default_device(jax.devices("cpu")[0]):
            params = FlaxGPT2LMHeadModel(self.config, seed=0).params
            state = self.optimizer.init(params)
            return jax.tree_util.tree_map(np.asarray, (params, state))

    def tokens(self, batch: int, length: int, seed: int = 0) -> np.ndarray:
        """A batch of random token ids."""
        tokens = np.random.default_rng(seed).integers(0, self.config.vocab_size, (batch, length))
        return tokens.astype(np.int32)
