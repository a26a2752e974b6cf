"""Dot products, einsum, convolutions (with preferred_element_type), FFT and jnp.linalg.

Dot products and convolutions are held to the SUMMATION budget against
|A|·|B| (the same contraction of the operands' magnitudes), FFTs to the FFT
budget against the sum of |x|, and linear algebra to LINALG on
well-conditioned matrices. jnp.linalg lowers to jaxlib's LAPACK custom calls
on CPU; a plugin that cannot run them reports MissingCustomCallError, and
those cases are skipped with that reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pool.conformance.budgets import EXACT, LINALG, fft, summation
from pool.conformance.case import Budget, Case, shape_name
from pool.conformance.elementwise import dtype, needs_x64
from pool.conformance.inputs import complexes, floats, integers


def _operands(
    *specs: tuple[str, tuple[int, ...]],
) -> Callable[[np.random.Generator], list[np.ndarray]]:
    def make(rng: np.random.Generator) -> list[np.ndarray]:
        arrays = []
        for type_name, shape in specs:
            kind = dtype(type_name)
            if kind.kind == "c":
                arrays.append(complexes(rng, kind, shape, radius=2.0, specials=False))
            elif kind.kind in "iu":
                arrays.append(integers(rng, kind, shape, -100, 100, edges=False))
            else:
                arrays.append(floats(rng, kind, shape, -2.0, 2.0, specials=()))
        return arrays

    return make


def _contraction(subscripts: str) -> Budget:
    return summation(lambda a, b: np.einsum(subscripts, a, b))


MATMUL_SHAPES = ((8, 8, 8), (64, 64, 64), (33, 17, 9))

# (case type, operand dtype, preferred_element_type or None)
DOT_TYPES = (
    ("float32", "float32", None),
    ("float64", "float64", None),
    ("bfloat16", "bfloat16", None),
    ("float16", "float16", None),
    ("bfloat16_to_float32", "bfloat16", "float32"),
    ("float16_to_float32", "float16", "float32"),
    ("int8_to_int32", "int8", "int32"),
    ("int32", "int32", None),
    ("complex64", "complex64", None),
)


def dot_cases() -> Iterator[Case]:
    """dot/<kind>/<types>/<shape>: matmul, matvec, batched and multi-axis einsum, dot_general."""
    for type_name, operand, preferred in DOT_TYPES:
        exact = dtype(operand).kind in "iu"
        shapes = MATMUL_SHAPES if type_name == "float32" else MATMUL_SHAPES[1:]
        for m, k, n in shapes:
            yield Case(
                f"dot/matmul/{type_name}/{m}x{k}x{n}",
                lambda a, b, p=preferred: jnp.matmul(
                    a, b, preferred_element_type=None if p is None else dtype(p)
                ),
                _operands((operand, (m, k)), (operand, (k, n))),
                EXACT if exact else _contraction("ij,jk->ik"),
                x64=needs_x64(operand),
            )
    yield Case(
        "dot/matvec/float32/64x64",
        jnp.dot,
        _operands(("float32", (64, 64)), ("float32", (64,))),
        _contraction("ij,j->i"),
    )
    yield Case(
        "dot/einsum_batched/float32/4x16x32x8",
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        _operands(("float32", (4, 16, 32)), ("float32", (4, 32, 8))),
        _contraction("bij,bjk->bik"),
    )
    yield Case(
        "dot/einsum_two_axes/bfloat16_to_float32/8x6x5x7",
        lambda a, b: jnp.einsum("ijk,jkl->il", a, b, preferred_element_type=jnp.float32),
        _operands(("bfloat16", (8, 6, 5)), ("bfloat16", (6, 5, 7))),
        _contraction("ijk,jkl->il"),
    )
    yield Case(
        "dot/dot_general/float16_to_float32/3x20x10x4",
        lambda a, b: lax.dot_general(
            a, b, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32
        ),
        _operands(("float16", (3, 20, 10)), ("float16", (3, 10, 4))),
        _contraction("bij,bjk->bik"),
    )


def _conv(
    strides: tuple[int, ...],
    padding: str | list[tuple[int, int]],
    dilation: tuple[int, ...] | None = None,
    groups: int = 1,
    preferred: str | None = None,
    lhs_dilation: tuple[int, ...] | None = None,
) -> Callable[[Any, Any], Any]:
    def convolve(x: Any, w: Any) -> Any:
        spatial = x.ndim - 2
        dimensions = ("NHWC", "HWIO", "NHWC") if spatial == 2 else ("NWC", "WIO", "NWC")
        return lax.conv_general_dilated(
            x,
            w,
            strides,
            padding,
            lhs_dilation=lhs_dilation,
            rhs_dilation=dilation,
            dimension_numbers=dimensions,
            feature_group_count=groups,
            preferred_element_type=None if preferred is None else dtype(preferred),
        )

    return convolve


def _conv_budget(convolve: Callable[[Any, Any], Any]) -> Budget:
    def compute(x: np.ndarray, w: np.ndarray) -> Any:
        # The same convolution of the magnitudes (in float32: the bound needs no more).
        return np.asarray(jax.jit(convolve)(x.astype(np.float32), w.astype(np.float32)))

    return summation(compute)


CONVOLUTIONS = (
    ("conv1d", "float32", (2, 50, 3), (5, 3, 4), _conv((1,), "SAME")),
    ("conv1d_strided", "float32", (2, 50, 3), (5, 3, 4), _conv((2,), "VALID")),
    ("conv2d", "float32", (2, 16, 16, 3), (3, 3, 3, 8), _conv((1, 1), "SAME")),
    ("conv2d_strided", "float32", (2, 17, 17, 3), (3, 3, 3, 8), _conv((2, 2), "SAME")),
    ("conv2d_dilated", "float32", (1, 16, 16, 4), (3, 3, 4, 4), _conv((1, 1), "SAME", (2, 2))),
    ("conv2d_grouped", "float32", (1, 12, 12, 4), (3, 3, 2, 6), _conv((1, 1), "SAME", groups=2)),
    (
        "conv2d_transposed",
        "float32",
        (1, 8, 8, 4),
        (3, 3, 4, 4),
        _conv((1, 1), [(2, 2), (2, 2)], lhs_dilation=(2, 2)),
    ),
    ("conv2d", "float64", (2, 16, 16, 3), (3, 3, 3, 8), _conv((1, 1), "SAME")),
    ("conv2d", "bfloat16", (2, 16, 16, 3), (3, 3, 3, 8), _conv((1, 1), "SAME")),
    (
        "conv2d_pref",
        "bfloat16_to_float32",
        (2, 16, 16, 3),
        (3, 3, 3, 8),
        _conv((1, 1), "SAME", preferred="float32"),
    ),
    (
        "conv2d_pref",
        "float16_to_float32",
        (2, 16, 16, 3),
        (3, 3, 3, 8),
        _conv((1, 1), "SAME", preferred="float32"),
    ),
)


def conv_cases() -> Iterator[Case]:
    """conv/<kind>/<types>/<input shape>: 1-D and 2-D, strided, dilated, grouped, transposed."""
    for name, type_name, x_shape, w_shape, convolve in CONVOLUTIONS:
        operand = type_name.split("_to_")[0]
        shape = "x".join(map(str, x_shape))
        yield Case(
            f"conv/{name}/{type_name}/{shape}",
            convolve,
            _operands((operand, x_shape), (operand, w_shape)),
            _conv_budget(convolve),
            x64=needs_x64(operand),
        )


def _fft_bound(inverse: bool = False, axes: int = 1) -> Budget:
    def compute(x: np.ndarray) -> Any:
        total = np.sum(x, axis=tuple(range(x.ndim - axes, x.ndim)), keepdims=True)
        count = np.prod(x.shape[x.ndim - axes :])
        return total / count if inverse else total

    return fft(compute)


FFTS = (
    ("fft", "complex64", (64,), jnp.fft.fft, _fft_bound()),
    ("fft", "complex64", (100,), jnp.fft.fft, _fft_bound()),
    ("fft", "complex64", (127,), jnp.fft.fft, _fft_bound()),
    ("fft", "complex64", (4, 1024), jnp.fft.fft, _fft_bound()),
    ("ifft", "complex64", (64,), jnp.fft.ifft, _fft_bound(inverse=True)),
    ("rfft", "float32", (64,), jnp.fft.rfft, _fft_bound()),
    ("rfft", "float32", (100,), jnp.fft.rfft, _fft_bound()),
    ("irfft", "complex64", (33,), jnp.fft.irfft, _fft_bound(inverse=True)),
    ("fft2", "complex64", (16, 16), jnp.fft.fft2, _fft_bound(axes=2)),
    ("fftn", "complex64", (4, 8, 16), jnp.fft.fftn, _fft_bound(axes=3)),
    ("fft", "complex128", (100,), jnp.fft.fft, _fft_bound()),
    ("rfft", "float64", (64,), jnp.fft.rfft, _fft_bound()),
)


def fft_cases() -> Iterator[Case]:
    """fft/<transform>/<dtype>/<shape>: powers of two, composite and prime lengths, 2-D and 3-D."""
    for name, type_name, shape, function, budget in FFTS:
        yield Case(
            f"fft/{name}/{type_name}/{shape_name(shape)}",
            function,
            _operands((type_name, shape)),
            budget,
            x64=needs_x64(type_name),
        )


def _well_conditioned(
    type_name: str, n: int, symmetric: bool = False, extra: tuple[int, ...] = ()
) -> Callable[[np.random.Generator], list[np.ndarray]]:
    """A matrix with condition number below about 10 (diagonally dominant or SPD), and a b."""

    def make(rng: np.random.Generator) -> list[np.ndarray]:
        kind = dtype(type_name)
        a = rng.uniform(-1, 1, (n, n))
        if kind.kind == "c":
            a = a + 1j * rng.uniform(-1, 1, (n, n))
        a = a @ a.conj().T / n + np.eye(n) if symmetric else a / n + 2 * np.eye(n)
        arrays = [a.astype(kind)]
        if extra:
            arrays.append(rng.uniform(-1, 1, (n, *extra)).astype(kind))
        return arrays

    return make


def _signs_fixed(vectors: Any) -> Any:
    """Eigen- or singular vectors up to sign or phase: each column's largest entry made positive."""
    index = jnp.argmax(jnp.abs(vectors), axis=0)
    pivot = jnp.take_along_axis(vectors, index[None, :], axis=0)
    return vectors / (pivot / jnp.abs(pivot)).astype(vectors.dtype)


def _eigh(a: Any) -> tuple[Any, Any]:
    values, vectors = jnp.linalg.eigh(a)
    return values, _signs_fixed(vectors)


def _qr(a: Any) -> tuple[Any, Any]:
    q, r = jnp.linalg.qr(a)
    signs = jnp.where(jnp.diagonal(r) < 0, -1, 1).astype(a.dtype)
    return q * signs[None, :], r * signs[:, None]


def _svd(a: Any) -> tuple[Any, Any]:
    u, s, _ = jnp.linalg.svd(a)
    return s, _signs_fixed(u)


LINALG_OPS: tuple[tuple[str, Callable[..., Any], bool, tuple[int, ...], tuple[str, ...]], ...] = (
    ("cholesky", jnp.linalg.cholesky, True, (), ()),
    ("eigh", _eigh, True, (), ("eigenvalues", "eigenvectors")),
    ("solve", jnp.linalg.solve, False, (3,), ()),
    ("inv", jnp.linalg.inv, False, (), ()),
    ("det", jnp.linalg.det, False, (), ()),
    ("slogdet", lambda a: tuple(jnp.linalg.slogdet(a)), False, (), ("sign", "logabsdet")),
    ("qr", _qr, False, (), ("q", "r")),
    ("svd", _svd, False, (), ("s", "u")),
    ("lu_factor", lambda a: jax.scipy.linalg.lu_factor(a), False, (), ("lu", "pivots")),
    (
        "solve_triangular",
        lambda a, b: jax.scipy.linalg.solve_triangular(jnp.tril(a), b, lower=True),
        False,
        (3,),
        (),
    ),
    ("lstsq", lambda a, b: jnp.linalg.lstsq(a, b)[0], False, (3,), ()),
    ("pinv", jnp.linalg.pinv, False, (), ()),
    ("matrix_power", lambda a: jnp.linalg.matrix_power(a, 5), False, (), ()),
    ("norm2", lambda a: jnp.linalg.norm(a, 2), False, (), ()),
)


def linalg_cases() -> Iterator[Case]:
    """linalg/<op>/<dtype>/<n>x<n>: factorizations, solves and decompositions (LAPACK on CPU)."""
    for name, function, symmetric, extra, outputs in LINALG_OPS:
        for type_name in ("float32", "float64"):
            yield Case(
                f"linalg/{name}/{type_name}/16x16",
                function,
                _well_conditioned(type_name, 16, symmetric, extra),
                LINALG,
                x64=needs_x64(type_name),
                outputs=outputs,
            )
    for name, function, symmetric, extra, outputs in LINALG_OPS[:3]:
        yield Case(
            f"linalg/{name}/complex64/16x16",
            function,
            _well_conditioned("complex64", 16, symmetric, extra),
            LINALG,
            outputs=outputs,
        )
