"""Control flow (cond, switch, while, fori, scan, map) and random numbers.

Loop bodies use exact arithmetic (integers, or floats whose steps round the
same way in any correct compiler) where they can, so that these cases test
the control flow rather than the math. Random bits, uniform floats,
integers and permutations are defined bit for bit by the key and the
algorithm (threefry, or rng_bit_generator with an explicit algorithm:
XLA's default algorithm is the plugin's choice, so it is not tested).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pool.conformance.budgets import ELEMENTARY, EXACT, LOOP
from pool.conformance.case import Case
from pool.conformance.elementwise import dtype, needs_x64
from pool.conformance.inputs import floats


def _cond(p: Any, x: Any) -> Any:
    return lax.cond(p[0] > 0, lambda v: jnp.sin(v) * 2, lambda v: v[::-1] - 1, x)


def _switch(i: Any, x: Any) -> Any:
    branches = [lambda v: v + 1, lambda v: v * v, lambda v: -v, lambda v: v // 3]
    return lax.switch(i[0], branches, x)  # an index out of range is clamped


def _newton_sqrt(x: Any) -> tuple[Any, Any]:
    def body(state: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        y, _, count = state
        nxt = 0.5 * (y + x / y)
        return nxt, y, count + 1

    def more(state: tuple[Any, Any, Any]) -> Any:
        y, previous, count = state
        return jnp.any(jnp.abs(y - previous) > 1e-6 * y) & (count < 50)

    y, _, count = lax.while_loop(more, body, (x, x + 1, jnp.int32(0)))
    return y, count


def _collatz(n: Any) -> Any:
    def body(state: tuple[Any, Any]) -> tuple[Any, Any]:
        value, steps = state
        active = value != 1
        value = jnp.where(active, jnp.where(value % 2 == 0, value // 2, 3 * value + 1), value)
        return value, steps + active.astype(jnp.int32)

    return lax.while_loop(lambda s: jnp.any(s[0] != 1), body, (n, jnp.zeros_like(n)))[1]


def _fori(x: Any) -> Any:
    return lax.fori_loop(0, 100, lambda i, v: (v * 3 + i) % 1000003, x)


def _scan(x: Any) -> tuple[Any, Any]:
    def step(carry: Any, row: Any) -> tuple[Any, Any]:
        carry = carry * 0.5 + row
        return carry, jnp.sum(carry)

    return lax.scan(step, jnp.zeros_like(x[0]), x)


def _scan_reverse(x: Any) -> tuple[Any, Any]:
    def step(carry: tuple[Any, Any], value: Any) -> tuple[tuple[Any, Any], Any]:
        total, count = carry
        return (total + value, count + (value > 0)), total

    (total, count), partial = lax.scan(step, (jnp.int32(0), jnp.int32(0)), x, reverse=True)
    return total, count, partial


def _nested(x: Any) -> Any:
    def row(carry: Any, values: Any) -> tuple[Any, Any]:
        inner = lax.fori_loop(0, 5, lambda i, v: v + values * i, carry)
        return inner, inner[0]

    return lax.scan(row, jnp.zeros_like(x[0]), x)


def _map(x: Any) -> Any:
    return lax.map(lambda row: jnp.where(row > 0, row, 0).sum() + jnp.max(row), x)


def _integer_inputs(low: int, high: int, shape: tuple[int, ...]) -> Any:
    return lambda rng: [rng.integers(low, high, shape).astype(np.int32)]


def control_cases() -> Iterator[Case]:
    """control/<construct>/<dtype>/...: branches, loops with data-dependent trip counts, scans."""
    values = lambda rng: [floats(rng, np.float32, 64, -3, 3, specials=())]  # noqa: E731
    for taken, p in (("true", 1.0), ("false", -1.0)):
        yield Case(
            f"control/cond_{taken}/float32/n64",
            _cond,
            lambda rng, p=p: [np.float32([p]), floats(rng, np.float32, 64, -3, 3, specials=())],
            ELEMENTARY,
        )
    for index in (0, 1, 2, 3, 7, -1):
        yield Case(
            f"control/switch_{index}/int32/n64",
            _switch,
            lambda rng, i=index: [np.int32([i]), rng.integers(-1000, 1000, 64).astype(np.int32)],
        )
    yield Case(
        "control/while_newton/float32/n64",
        _newton_sqrt,
        lambda rng: [floats(rng, np.float32, 64, 0.01, 1e4, specials=())],
        LOOP,
        outputs=("sqrt", "iterations"),
    )
    yield Case("control/while_collatz/int32/n64", _collatz, _integer_inputs(1, 1000, (64,)))
    yield Case("control/fori/int32/n64", _fori, _integer_inputs(0, 1000003, (64,)))
    yield Case(
        "control/scan/float32/50x8",
        _scan,
        lambda rng: [floats(rng, np.float32, (50, 8), -3, 3, specials=())],
        LOOP,
        outputs=("carry", "sums"),
    )
    yield Case(
        "control/scan_reverse/int32/n100",
        _scan_reverse,
        _integer_inputs(-100, 100, (100,)),
        outputs=("total", "positives", "partial"),
    )
    yield Case("control/scan_fori/int32/20x4", _nested, _integer_inputs(-100, 100, (20, 4)))
    yield Case(
        "control/map/float32/16x32",
        _map,
        lambda rng: [floats(rng, np.float32, (16, 32), specials=())],
    )
    yield Case(
        "control/vmap_cond/float32/n64",
        lambda p, x: jax.vmap(lambda a, b: lax.cond(a > 0, jnp.exp, jnp.cos, b))(p, x),
        lambda rng: [*values(rng), *values(rng)],
        ELEMENTARY,
    )


def _key(impl: str) -> Any:
    size = 4 if impl == "rbg" else 2
    return lambda rng: [rng.integers(0, 2**32, size, dtype=np.uint64).astype(np.uint32)]


def _threefry(function: Any) -> Any:
    return lambda data: function(jax.random.wrap_key_data(data, impl="threefry2x32"))


RANDOM: tuple[tuple[str, str, Any, Any], ...] = (
    ("bits", "uint32", lambda k: jax.random.bits(k, (1000,), jnp.uint32), EXACT),
    ("bits", "uint8", lambda k: jax.random.bits(k, (1000,), jnp.uint8), EXACT),
    ("bits", "uint16", lambda k: jax.random.bits(k, (1000,), jnp.uint16), EXACT),
    ("bits", "uint64", lambda k: jax.random.bits(k, (1000,), jnp.uint64), EXACT),
    ("uniform", "float32", lambda k: jax.random.uniform(k, (1000,), jnp.float32), EXACT),
    ("uniform", "bfloat16", lambda k: jax.random.uniform(k, (1000,), jnp.bfloat16), EXACT),
    ("uniform", "float16", lambda k: jax.random.uniform(k, (1000,), jnp.float16), EXACT),
    ("uniform", "float64", lambda k: jax.random.uniform(k, (1000,), jnp.float64), EXACT),
    ("normal", "float32", lambda k: jax.random.normal(k, (1000,), jnp.float32), ELEMENTARY),
    ("randint", "int32", lambda k: jax.random.randint(k, (1000,), -50, 1000), EXACT),
    ("permutation", "int32", lambda k: jax.random.permutation(k, 1000), EXACT),
    ("bernoulli", "bool", lambda k: jax.random.bernoulli(k, 0.3, (1000,)), EXACT),
    (
        "split_fold_in",
        "uint32",
        lambda k: jax.random.key_data(jax.random.split(jax.random.fold_in(k, 7), 8)),
        EXACT,
    ),
)


def random_cases() -> Iterator[Case]:
    """random/<function>/<dtype>/n1000: threefry and rng_bit_generator, keys from inputs."""
    for name, type_name, function, budget in RANDOM:
        yield Case(
            f"random/{name}/{type_name}/n1000",
            _threefry(function),
            _key("threefry"),
            budget,
            x64=needs_x64(type_name),
        )
    for algorithm in ("THREE_FRY", "PHILOX"):
        for type_name in ("uint32", "uint64"):
            yield Case(
                f"random/rng_bit_generator_{algorithm.lower()}/{type_name}/n1000",
                lambda key, a=algorithm, t=type_name: lax.rng_bit_generator(
                    key, (1000,), dtype(t), getattr(lax.RandomAlgorithm, f"RNG_{a}")
                ),
                _key("rbg"),
                x64=needs_x64(type_name),
                outputs=("key", "bits"),
            )
