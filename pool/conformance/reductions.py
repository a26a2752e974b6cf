"""Reductions and cumulative operations along each axis, in float and integer types.

Float sums are held to the SUMMATION budget: ULPs of the sum of the terms'
magnitudes, since XLA may sum in any order (and does, differently, when it
vectorizes or splits a reduction across threads). Integer results, maxima,
minima and arg-reductions are exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pool.conformance.budgets import ELEMENTARY, EXACT, summation
from pool.conformance.case import Budget, Case
from pool.conformance.elementwise import dtype, needs_x64
from pool.conformance.inputs import floats, integers

SHAPE = (37, 65)
"""An odd shape: no axis is a multiple of a vector width."""

AXES: dict[str, int | None] = {"all": None, "axis0": 0, "axis1": 1}


def _values(type_name: str, shape: tuple[int, ...], low: float = -10, high: float = 10) -> Any:
    kind = dtype(type_name)

    def make(rng: np.random.Generator) -> list[np.ndarray]:
        if kind.kind == "b":
            return [rng.random(shape) < 0.9]
        if kind.kind in "iu":
            return [integers(rng, kind, shape, -100, 100, edges=False)]
        return [floats(rng, kind, shape, low, high, specials=())]

    return make


def _with_nan(type_name: str, shape: tuple[int, ...]) -> Any:
    base = _values(type_name, shape)

    def make(rng: np.random.Generator) -> list[np.ndarray]:
        (x,) = base(rng)
        x[3, 5] = np.nan  # max/min propagate NaN: one row and one column see it
        x[7, 9] = np.inf
        return [x]

    return make


def _summed(axis: int | None, mean: bool = False) -> Budget:
    def compute(x: np.ndarray) -> Any:
        total = np.sum(x, axis=axis)
        return total / (x.size if axis is None else x.shape[axis]) if mean else total

    return summation(compute)


def reduction_cases() -> Iterator[Case]:
    """reduction/<op>/<dtype>/<axes>: sum, prod, max, min, mean, arg-, bool and log reductions."""
    for type_name in ("float32", "float64", "float16", "bfloat16", "int32", "int8", "uint8"):
        for axes, axis in AXES.items() if type_name in ("float32", "int32") else [("axis1", 1)]:
            is_int = dtype(type_name).kind in "iu"
            yield Case(
                f"reduction/sum/{type_name}/{axes}",
                lambda x, a=axis: jnp.sum(x, axis=a),
                _values(type_name, SHAPE),
                EXACT if is_int else _summed(axis),
                x64=needs_x64(type_name),
            )
    yield Case(
        "reduction/sum/float32/n65536",
        jnp.sum,
        _values("float32", (65536,)),
        _summed(None),
    )
    for type_name in ("float32", "float64", "int32"):
        yield Case(
            f"reduction/prod/{type_name}/axis1",
            lambda x: jnp.prod(x[:, :8], axis=1),
            _values(type_name, SHAPE, 0.5, 2.0) if type_name != "int32" else _values("int8", SHAPE),
            ELEMENTARY if type_name != "int32" else EXACT,
            x64=needs_x64(type_name),
        )
    for type_name in ("float32", "bfloat16", "float64", "int32", "uint8", "int64"):
        make = (
            _with_nan(type_name, SHAPE)
            if dtype(type_name).kind == "f"
            else _values(type_name, SHAPE)
        )
        for axes, axis in (
            (("all", None), ("axis1", 1)) if type_name == "float32" else [("axis1", 1)]
        ):
            yield Case(
                f"reduction/max_min/{type_name}/{axes}",
                lambda x, a=axis: (jnp.max(x, axis=a), jnp.min(x, axis=a)),
                make,
                x64=needs_x64(type_name),
                outputs=("max", "min"),
            )
        yield Case(
            f"reduction/argmax_argmin/{type_name}/axis0",
            lambda x: (jnp.argmax(x, axis=0), jnp.argmin(x, axis=0)),
            make,
            x64=needs_x64(type_name),
            outputs=("argmax", "argmin"),
        )
    for type_name in ("float32", "bfloat16", "float64"):
        yield Case(
            f"reduction/mean/{type_name}/axis1",
            lambda x: jnp.mean(x, axis=1),
            _values(type_name, SHAPE),
            _summed(1, mean=True),
            x64=needs_x64(type_name),
        )
        yield Case(
            f"reduction/var/{type_name}/axis1",
            lambda x: jnp.var(x, axis=1),
            _values(type_name, SHAPE),
            summation(lambda x: np.mean(x * x, axis=1) * 4),
            x64=needs_x64(type_name),
        )
        yield Case(
            f"reduction/logsumexp/{type_name}/axis1",
            lambda x: jax.nn.logsumexp(x, axis=1),
            _values(type_name, SHAPE),
            summation(lambda x: np.max(x, axis=1) + np.log(x.shape[1])),
            x64=needs_x64(type_name),
        )
    yield Case(
        "reduction/any_all/bool/axis1",
        lambda x: (jnp.any(x, axis=1), jnp.all(x, axis=1), jnp.any(x), jnp.all(x)),
        _values("bool", SHAPE),
        outputs=("any_axis1", "all_axis1", "any", "all"),
    )


CUMULATIVE: tuple[tuple[str, Callable[..., Any]], ...] = (
    ("cumsum", jnp.cumsum),
    ("cumsum_reverse", lambda x, axis: lax.cumsum(x, axis=axis, reverse=True)),
    ("cumprod", jnp.cumprod),
    ("cummax", lambda x, axis: lax.cummax(x, axis=axis)),
    ("cummin", lambda x, axis: lax.cummin(x, axis=axis)),
    ("cumlogsumexp", lambda x, axis: lax.cumlogsumexp(x, axis=axis)),
)


def _cumulative_budget(name: str, type_name: str, axis: int) -> Budget:
    if dtype(type_name).kind in "iu" or name in ("cummax", "cummin"):
        return EXACT
    if name == "cumprod":
        return summation(lambda x: np.cumprod(x, axis=axis))
    if name == "cumlogsumexp":
        return summation(lambda x: np.maximum.accumulate(x, axis=axis) + np.log(x.shape[axis]))
    if name == "cumsum_reverse":
        return summation(lambda x: np.flip(np.cumsum(np.flip(x, axis), axis=axis), axis))
    return summation(lambda x: np.cumsum(x, axis=axis))


def cumulative_cases() -> Iterator[Case]:
    """cumulative/<op>/<dtype>/<shape>: prefix sums, products, extrema, log-sum-exp."""
    for name, function in CUMULATIVE:
        for type_name in ("float32", "float64", "bfloat16", "int32"):
            if type_name == "int32" and name == "cumlogsumexp":
                continue
            if type_name != "float32" and name != "cumsum":
                continue  # every operation in float32; the others' types with cumsum
            shapes = (("n1000", (1000,), 0), ("37x65_axis1", SHAPE, 1))
            for shape_name, shape, axis in shapes if type_name == "float32" else shapes[:1]:
                low, high = (0.9, 1.1) if name == "cumprod" else (-10, 10)
                make = (
                    _values("int8", shape)
                    if type_name == "int32" and name == "cumprod"
                    else _values(type_name, shape, low, high)
                )
                yield Case(
                    f"cumulative/{name}/{type_name}/{shape_name}",
                    lambda x, f=function, a=axis, n=name, t=type_name: f(
                        x.astype(dtype(t)) if n == "cumprod" else x, axis=a
                    ),
                    make,
                    _cumulative_budget(name, type_name, axis),
                    x64=needs_x64(type_name),
                )
