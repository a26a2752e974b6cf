"""Data movement: gather and scatter (with out-of-bounds and repeated indices), sort, top_k.

All exact. Scatters with repeated indices combine with add, multiply, min or
max on integer-valued data, whose result does not depend on the order;
overwriting scatters use unique indices, since which repeated update wins is
implementation-defined.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pool.conformance.case import Case, shape_name
from pool.conformance.elementwise import dtype, needs_x64
from pool.conformance.inputs import floats, integers


def _data_and_indices(
    type_name: str, shape: tuple[int, ...], count: int, unique: bool = False, outside: bool = True
) -> Callable[[np.random.Generator], list[np.ndarray]]:
    """Data, indices into its first axis (some out of bounds, unless unique) and updates."""

    def make(rng: np.random.Generator) -> list[np.ndarray]:
        kind = dtype(type_name)
        n = shape[0]
        if kind.kind in "iu":
            data = integers(rng, kind, shape, -50, 50, edges=False)
            updates = integers(rng, kind, (count, *shape[1:]), -5, 5, edges=False)
        else:
            # Small integers as floats: sums and products are exact in any order.
            data = rng.integers(-50, 50, shape).astype(kind)
            updates = rng.integers(-5, 5, (count, *shape[1:])).astype(kind)
        if unique:
            indices = rng.permutation(n)[:count].astype(np.int32)
        else:
            indices = rng.integers(0, n, count).astype(np.int32)
            if outside:
                indices[:4] = (-1, -n, n, n + 5)  # negative (wraps in jnp) and out of bounds
        return [data, indices, updates]

    return make


INDEXING: tuple[tuple[str, Callable[..., Any], bool], ...] = (
    ("take", lambda x, i, u: x[i], False),
    ("take_fill", lambda x, i, u: jnp.take(x, i, axis=0, mode="fill", fill_value=-7), False),
    ("take_clip", lambda x, i, u: jnp.take(x, i, axis=0, mode="clip"), False),
    ("scatter_set", lambda x, i, u: x.at[i].set(u), True),
    ("scatter_add", lambda x, i, u: x.at[i].add(u), False),
    ("scatter_mul", lambda x, i, u: x.at[i].multiply(u), False),
    ("scatter_min", lambda x, i, u: x.at[i].min(u), False),
    ("scatter_max", lambda x, i, u: x.at[i].max(u), False),
    (
        "segment_sum",
        lambda x, i, u: jax.ops.segment_sum(u, jnp.clip(i, 0, 9), num_segments=10),
        False,
    ),
)


def _take_along(x: Any, i: Any, u: Any) -> Any:
    order = jnp.argsort(x, axis=1)
    return jnp.take_along_axis(x, order, axis=1)


def _two_d(x: Any, i: Any, u: Any) -> tuple[Any, ...]:
    rows = jnp.clip(i, 0, x.shape[0] - 1)
    columns = rows % x.shape[1]
    return (x[rows, columns], x[rows[:, None], columns[None, :8]])


def _dynamic(x: Any, i: Any, u: Any) -> tuple[Any, ...]:
    start = i[4]
    sliced = lax.dynamic_slice_in_dim(x, start, 16)  # the start is clamped to fit
    updated = lax.dynamic_update_slice_in_dim(x, u[:16], i[5], axis=0)
    clamped = lax.dynamic_slice_in_dim(x, x.shape[0] - 3, 16)  # past the end: clamped
    return (sliced, updated, clamped)


def indexing_cases() -> Iterator[Case]:
    """indexing/<op>/<dtype>/<shape>: gathers and scatters, 1-D and 2-D, dynamic slices."""
    for type_name in ("float32", "int32", "bfloat16", "float64"):
        narrow = type_name in ("bfloat16", "float64")  # the main gathers and scatters only
        for name, function, unique in INDEXING[:5] if narrow else INDEXING:
            yield Case(
                f"indexing/{name}/{type_name}/100x3",
                function,
                _data_and_indices(type_name, (100, 3), 40, unique=unique, outside=not unique),
                x64=needs_x64(type_name),
            )
        yield Case(
            f"indexing/gather_2d/{type_name}/50x20",
            _two_d,
            _data_and_indices(type_name, (50, 20), 30),
            x64=needs_x64(type_name),
            outputs=("points", "block"),
        )
        if narrow:
            continue
        yield Case(
            f"indexing/dynamic_slice/{type_name}/n100",
            _dynamic,
            _data_and_indices(type_name, (100,), 40),
            x64=needs_x64(type_name),
            outputs=("slice", "update_slice", "clamped_slice"),
        )
        yield Case(
            f"indexing/take_along_axis/{type_name}/20x30",
            _take_along,
            _data_and_indices(type_name, (20, 30), 4),
            x64=needs_x64(type_name),
        )


def _sortable(
    type_name: str, shape: tuple[int, ...]
) -> Callable[[np.random.Generator], list[np.ndarray]]:
    """Values with repeats (ties), and NaN, infinities and both zeros for floats."""

    def make(rng: np.random.Generator) -> list[np.ndarray]:
        kind = dtype(type_name)
        if kind.kind in "iu":
            values = integers(rng, kind, shape)
        else:
            values = floats(rng, kind, shape, -100, 100)
        flat = values.reshape(-1)
        repeats = rng.integers(0, flat.size, flat.size // 4)
        flat[repeats] = flat[rng.integers(0, flat.size, repeats.size)]
        return [values]

    return make


SORTS: tuple[tuple[str, Callable[..., Any], tuple[str, ...]], ...] = (
    ("sort", lambda x: jnp.sort(x, axis=-1), ()),
    ("sort_descending", lambda x: jnp.sort(x, axis=-1, descending=True), ()),
    ("argsort_stable", lambda x: jnp.argsort(x, axis=-1, stable=True), ()),
    (
        "sort_key_value",
        lambda x: lax.sort((x, jnp.broadcast_to(jnp.arange(x.shape[-1]), x.shape)), num_keys=1),
        ("keys", "values"),
    ),
    ("top_k", lambda x: lax.top_k(x, min(10, x.shape[-1])), ("values", "indices")),
)


def sort_cases() -> Iterator[Case]:
    """sort/<op>/<dtype>/<shape>: sorting (with NaN and ties), argsort, key-value sort, top_k."""
    for name, function, outputs in SORTS:
        others = (
            ("int32", "bfloat16", "float64", "uint8", "int64") if name == "sort" else ("int32",)
        )
        for type_name in ("float32", *others):
            for shape in ((7,), (1000,), (8, 100)) if type_name == "float32" else ((1000,),):
                yield Case(
                    f"sort/{name}/{type_name}/{shape_name(shape)}",
                    function,
                    _sortable(type_name, shape),
                    x64=needs_x64(type_name),
                    outputs=outputs,
                )
    yield Case(
        "sort/median/float32/n1001",
        jnp.median,
        lambda rng: [floats(rng, np.float32, 1001, -100, 100, specials=())],
    )
