"""Example programs: what the README and the docs run, and what the tests and benchmarks use.

example_programs() returns (name, function, shapes) tuples that cover what
users compile: MLPs and their gradients, convolutions and a small CNN, scans,
attention, jnp.linalg (LAPACK custom calls on CPU), FFT, sorting, reductions,
a while loop, elementwise chains, a layer norm and a tiny program. Every
program takes and returns 32-bit types only, so it works without
jax_enable_x64, and every one is valid for random inputs from
example_inputs(): the linalg programs build a symmetric positive definite
matrix from their argument themselves, and loops are bounded.

    for name, function, shapes in example_programs():
        program = pool.lower(function, shapes)
        executable, _ = pool.compile_program(program)
        outputs = executable.run(example_inputs(shapes))

programs() is the same list as a warm spec (docs/warm.md), so that the
command line warms it by name, from a checkout or an installed pjrt-pool:

    pjrt-pool warm pool.examples:programs --manifest example-manifest.json
    pjrt-pool run example-manifest.json mlp_medium

The package ships with pjrt-pool and imports JAX, as the parent side may; its
modules:

    sharded.py    programs over several devices: jax.jit with shardings over a
                  Mesh, and shard_map collectives
    training.py   twelve training steps of transformer-like models: long,
                  multithreaded compiles
    gpt2.py       transformers' Flax GPT-2, its forward and AdamW step (needs
                  transformers, flax and optax)
    models.py     train steps of real models (GPT-2, a ResNet block with batch
                  norm, a CNN), small, with their arguments, for checking
                  numbers against jax.jit (needs flax and optax)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from worker.compile.arguments import random_inputs

ExampleProgram = tuple[str, Callable[..., Any], list[jax.ShapeDtypeStruct]]
"""One example: a unique name, a JAX-traceable function and the shapes of its arguments."""

_F32 = jnp.float32
_I32 = jnp.int32


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, _F32)


def _i32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, _I32)


# -- MLPs --------------------------------------------------------------------


def _mlp_shapes(batch: int, sizes: Sequence[int]) -> list[jax.ShapeDtypeStruct]:
    """Shapes of (x, W1, b1, W2, b2, ...) for an MLP with layer sizes `sizes`."""
    shapes = [_f32(batch, sizes[0])]
    for fan_in, fan_out in itertools.pairwise(sizes):
        shapes += [_f32(fan_in, fan_out), _f32(fan_out)]
    return shapes


def _mlp(x: jax.Array, *params: jax.Array) -> jax.Array:
    """An MLP with tanh hidden layers; params are W1, b1, W2, b2, ..."""
    layers = list(zip(params[::2], params[1::2], strict=True))
    for index, (weight, bias) in enumerate(layers):
        # Scale by 1/sqrt(fan_in) so that standard normal weights keep activations O(1).
        x = x @ weight / math.sqrt(weight.shape[0]) + bias
        if index < len(layers) - 1:
            x = jnp.tanh(x)
    return x


def _mlp_loss(params: tuple[jax.Array, ...], x: jax.Array) -> jax.Array:
    logits = _mlp(x, *params)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[:, 0])


def _mlp_grad(x: jax.Array, *params: jax.Array) -> tuple[jax.Array, ...]:
    """The gradient of a softmax cross-entropy loss with respect to every parameter."""
    return jax.grad(_mlp_loss)(params, x)


# -- convolutions ------------------------------------------------------------


def _conv2d(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """A 'SAME' 3x3 convolution, NCHW input and OIHW kernel."""
    return jax.lax.conv_general_dilated(x, kernel, window_strides=(1, 1), padding="SAME")


def _conv2d_strided_dilated(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """A strided, dilated convolution in NHWC layout with an HWIO kernel."""
    return jax.lax.conv_general_dilated(
        x,
        kernel,
        window_strides=(2, 2),
        padding="VALID",
        rhs_dilation=(2, 2),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )


def _max_pool(x: jax.Array) -> jax.Array:
    """2x2 max pooling with stride 2 over the spatial axes of an NCHW array."""
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")


def _cnn(
    x: jax.Array, k1: jax.Array, k2: jax.Array, weight: jax.Array, bias: jax.Array
) -> jax.Array:
    """conv-relu-pool, conv-relu-pool, global average, dense: class logits."""
    x = _max_pool(jax.nn.relu(_conv2d(x, k1) / 3.0))
    x = _max_pool(jax.nn.relu(_conv2d(x, k2) / 6.0))
    return jnp.mean(x, axis=(2, 3)) @ weight + bias


def _cnn_grad(
    x: jax.Array, k1: jax.Array, k2: jax.Array, weight: jax.Array, bias: jax.Array
) -> tuple[jax.Array, ...]:
    """The gradient of the CNN's mean squared logits with respect to its parameters."""

    def loss(params: tuple[jax.Array, ...]) -> jax.Array:
        return jnp.mean(_cnn(x, *params) ** 2)

    return jax.grad(loss)((k1, k2, weight, bias))


# -- scans -------------------------------------------------------------------


def _rnn(xs: jax.Array, h0: jax.Array, w_x: jax.Array, w_h: jax.Array) -> tuple[jax.Array, ...]:
    """An Elman RNN over the leading (time) axis: the final state and every state."""

    def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = jnp.tanh(x @ w_x / math.sqrt(w_x.shape[0]) + h @ w_h / math.sqrt(w_h.shape[0]))
        return h, h

    return jax.lax.scan(step, h0, xs)


def _cumulative(x: jax.Array) -> tuple[jax.Array, ...]:
    """Cumulative sum, product, maximum and log-sum-exp along the last axis."""
    return (
        jnp.cumsum(x, axis=-1),
        jnp.cumprod(1.0 + 0.01 * x, axis=-1),
        jax.lax.cummax(x, axis=x.ndim - 1),
        jax.lax.cumlogsumexp(x, axis=x.ndim - 1),
    )


def _ema_scan(xs: jax.Array) -> jax.Array:
    """An exponential moving average written as a scan with a carry and no stacked output."""

    def step(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        return 0.9 * carry + 0.1 * x, None

    final, _ = jax.lax.scan(step, jnp.zeros_like(xs[0]), xs)
    return final


# -- attention ---------------------------------------------------------------


def _attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """softmax(Q K^T / sqrt(d)) V."""
    scores = q @ jnp.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    return jax.nn.softmax(scores, axis=-1) @ v


def _multi_head_attention(
    x: jax.Array, w_q: jax.Array, w_k: jax.Array, w_v: jax.Array, w_o: jax.Array
) -> jax.Array:
    """Causal self-attention with 4 heads over (batch, sequence, model) inputs."""
    batch, length, model = x.shape
    heads = 4
    scale = 1 / math.sqrt(model)

    def split(y: jax.Array) -> jax.Array:  # (batch, heads, length, model / heads)
        return y.reshape(batch, length, heads, model // heads).transpose(0, 2, 1, 3)

    q, k, v = (split(x @ w * scale) for w in (w_q, w_k, w_v))
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(model // heads)
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal, scores, -1e9)
    out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)
    return out.transpose(0, 2, 1, 3).reshape(batch, length, model) @ w_o * scale


# -- linalg (each builds a well-conditioned SPD matrix from its argument) ----


def _spd(a: jax.Array) -> jax.Array:
    """a a^T + n I: symmetric positive definite for any a, with eigenvalues >= n."""
    n = a.shape[-1]
    return a @ jnp.swapaxes(a, -1, -2) + n * jnp.eye(n, dtype=a.dtype)


def _cholesky(a: jax.Array) -> jax.Array:
    return jnp.linalg.cholesky(_spd(a))


def _solve(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.linalg.solve(_spd(a), b)


def _eigh(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Eigenvalues, and the matrix rebuilt from the eigendecomposition (sign-free)."""
    w, v = jnp.linalg.eigh(_spd(a))
    return w, (v * w) @ v.T


def _svd(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Singular values, and the matrix rebuilt from U S V^T (sign-free)."""
    u, s, vt = jnp.linalg.svd(a, full_matrices=False)
    return s, (u * s) @ vt


def _qr(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """|diag R| and Q R (both independent of the signs LAPACK chooses)."""
    q, r = jnp.linalg.qr(a)
    return jnp.abs(jnp.diagonal(r)), q @ r


def _inv(a: jax.Array) -> jax.Array:
    return jnp.linalg.inv(_spd(a))


def _det(a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """det, and slogdet's sign and log-magnitude, of a scaled SPD matrix."""
    m = _spd(a) / a.shape[-1]
    sign, logdet = jnp.linalg.slogdet(m)
    return jnp.linalg.det(m), sign, logdet


def _lstsq_normal(a: jax.Array, b: jax.Array) -> jax.Array:
    """Least squares via Cholesky of the (regularized) normal equations."""
    gram = a.T @ a + jnp.eye(a.shape[1], dtype=a.dtype)
    factor = jnp.linalg.cholesky(gram)
    y = jax.scipy.linalg.solve_triangular(factor, a.T @ b, lower=True)
    return jax.scipy.linalg.solve_triangular(factor.T, y, lower=False)


# -- FFT, sorting, reductions, control flow ----------------------------------


def _fft(x: jax.Array) -> jax.Array:
    """The complex FFT along the last axis (complex64 output)."""
    return jnp.fft.fft(x, axis=-1)


def _rfft2_power(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The power spectrum of a 2-D real FFT, and a low-pass round trip through irfft2."""
    spectrum = jnp.fft.rfft2(x)
    mask = jnp.arange(spectrum.shape[-1]) < spectrum.shape[-1] // 2
    smooth = jnp.fft.irfft2(spectrum * mask, s=x.shape[-2:])
    return jnp.abs(spectrum) ** 2, smooth


def _sort(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sorted rows, and the row order of the first column (int32)."""
    return jnp.sort(x, axis=-1), jnp.argsort(x[:, 0])


def _top_k(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 8 largest values of each row and their indices."""
    return jax.lax.top_k(x, 8)


def _reductions(x: jax.Array) -> tuple[jax.Array, ...]:
    """Sums, extrema, moments and norms over different axes."""
    return (
        jnp.sum(x),
        jnp.max(x, axis=0),
        jnp.min(x, axis=1),
        jnp.mean(x, axis=1),
        jnp.var(x, axis=0),
        jnp.linalg.norm(x, axis=1),
        jax.nn.logsumexp(x, axis=1),
        jnp.argmax(x, axis=1),
    )


def _while_newton_sqrt(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Square roots of |x| + 1 by Newton's method in a while loop, and the steps taken."""
    a = jnp.abs(x) + 1.0

    def cond(state: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        _, step, change = state
        return (change > 1e-6) & (step < 50)

    def body(
        state: tuple[jax.Array, jax.Array, jax.Array],
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        y, step, _ = state
        new = 0.5 * (y + a / y)
        return new, step + 1, jnp.max(jnp.abs(new - y) / new)

    y, steps, _ = jax.lax.while_loop(cond, body, (a, jnp.int32(0), jnp.float32(jnp.inf)))
    return y, steps


def _fori_integer(x: jax.Array, y: jax.Array) -> jax.Array:
    """Integer arithmetic in a fori_loop (int32 in and out): a bounded mixing hash."""

    def body(i: jax.Array, h: jax.Array) -> jax.Array:
        h = (h * 31 + y + i) % 65_521
        return jnp.bitwise_xor(h, h >> 3)

    return jax.lax.fori_loop(0, 16, body, x % 65_521)


def _elementwise(x: jax.Array, y: jax.Array) -> jax.Array:
    """A long chain of elementwise operations that XLA fuses into one loop."""
    z = jnp.sin(x) * jnp.cos(y) + jnp.exp(-(x**2)) - jnp.log1p(jnp.abs(y))
    z = jnp.tanh(z) * jax.nn.sigmoid(x - y) + jnp.sqrt(jnp.abs(x) + 1.0)
    z = jnp.where(z > 0, z, 0.1 * z) + jax.nn.gelu(y)
    return jnp.clip(z, -3.0, 3.0) ** 2


def _layer_norm(x: jax.Array, gamma: jax.Array, beta: jax.Array) -> jax.Array:
    """Layer normalization over the last axis, with scale and shift."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + 1e-5) * gamma + beta


def _softmax_xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy with int32 labels (taken modulo the class count)."""
    labels = labels % logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=-1))


def _tiny(x: jax.Array) -> jax.Array:
    return x + 1


def example_programs() -> list[ExampleProgram]:
    """Returns the example programs as (name, function, shapes) tuples.

    Names are unique. Functions take exactly the arguments that shapes
    describe (float32 and int32 only) and are valid for any inputs of those
    shapes, such as example_inputs() makes. A fresh list is returned on
    every call.
    """
    return [
        ("tiny_add_one", _tiny, [_f32(4)]),
        ("mlp_small", _mlp, _mlp_shapes(8, [16, 32, 4])),
        ("mlp_medium", _mlp, _mlp_shapes(64, [128, 256, 256, 10])),
        ("mlp_large", _mlp, _mlp_shapes(128, [512, 1024, 1024, 512, 10])),
        ("mlp_small_grad", _mlp_grad, _mlp_shapes(8, [16, 32, 4])),
        ("mlp_medium_grad", _mlp_grad, _mlp_shapes(64, [128, 256, 256, 10])),
        ("conv2d", _conv2d, [_f32(4, 3, 32, 32), _f32(16, 3, 3, 3)]),
        ("conv2d_strided_dilated", _conv2d_strided_dilated, [_f32(2, 33, 33, 8), _f32(3, 3, 8, 4)]),
        (
            "cnn",
            _cnn,
            [_f32(4, 3, 32, 32), _f32(8, 3, 3, 3), _f32(16, 8, 3, 3), _f32(16, 10), _f32(10)],
        ),
        (
            "cnn_grad",
            _cnn_grad,
            [_f32(4, 3, 16, 16), _f32(8, 3, 3, 3), _f32(16, 8, 3, 3), _f32(16, 10), _f32(10)],
        ),
        ("rnn_scan", _rnn, [_f32(32, 8, 16), _f32(8, 64), _f32(16, 64), _f32(64, 64)]),
        ("cumulative_ops", _cumulative, [_f32(16, 128)]),
        ("ema_scan", _ema_scan, [_f32(100, 32)]),
        ("attention", _attention, [_f32(2, 64, 32), _f32(2, 64, 32), _f32(2, 64, 32)]),
        ("multi_head_attention", _multi_head_attention, [_f32(2, 32, 64)] + [_f32(64, 64)] * 4),
        ("linalg_cholesky", _cholesky, [_f32(32, 32)]),
        ("linalg_solve", _solve, [_f32(32, 32), _f32(32, 4)]),
        ("linalg_eigh", _eigh, [_f32(16, 16)]),
        ("linalg_svd", _svd, [_f32(24, 16)]),
        ("linalg_qr", _qr, [_f32(24, 16)]),
        ("linalg_inv", _inv, [_f32(16, 16)]),
        ("linalg_det", _det, [_f32(8, 8)]),
        ("linalg_lstsq_triangular", _lstsq_normal, [_f32(40, 12), _f32(40, 3)]),
        ("fft", _fft, [_f32(8, 256)]),
        ("rfft2", _rfft2_power, [_f32(4, 32, 32)]),
        ("sort_argsort", _sort, [_f32(16, 64)]),
        ("top_k", _top_k, [_f32(16, 100)]),
        ("reductions", _reductions, [_f32(64, 48)]),
        ("while_loop_newton", _while_newton_sqrt, [_f32(256)]),
        ("fori_loop_int32", _fori_integer, [_i32(64), _i32(64)]),
        ("elementwise_chain", _elementwise, [_f32(128, 128), _f32(128, 128)]),
        ("layer_norm", _layer_norm, [_f32(32, 256), _f32(256), _f32(256)]),
        ("softmax_cross_entropy", _softmax_xent, [_f32(32, 10), _i32(32)]),
    ]


def programs() -> list[ExampleProgram]:
    """The example programs as a warm spec (``pjrt-pool warm pool.examples:programs``)."""
    return example_programs()


def example_inputs(shapes: Sequence[jax.ShapeDtypeStruct], seed: int = 0) -> list[np.ndarray]:
    """Returns random numpy inputs, one per shape, that every example program accepts.

    Floating-point arguments are standard normal; integer arguments are
    uniform in [0, 1000). The same seed gives the same inputs.
    """
    return random_inputs(shapes, seed)
