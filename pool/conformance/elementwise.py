"""Elementwise cases: every float function JAX has, comparisons and selects, integer ops.

Each float operation runs in float32 at sizes on both sides of XLA:CPU's
vector widths and loop-splitting thresholds (7, 64 and 4096 elements), and
in float64, float16 and bfloat16 at 64: the arctan
miscompile of the default CPU plugin shows from about 60 elements, in every
float type. Inputs are drawn from each operation's domain, plus NaN,
infinities, signed zeros and the domain's edges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from pool.conformance.budgets import ELEMENTARY, ELEMENTARY_LOOSE_F64, EXACT, SPECIAL
from pool.conformance.case import Budget, Case
from pool.conformance.inputs import NAN_INF_ZEROS, complexes, floats, integers

FLOAT_SIZES: dict[str, tuple[int, ...]] = {
    "float32": (7, 64, 4096),
    "float64": (64,),
    "float16": (64,),
    "bfloat16": (64,),
}
"""The sizes each float dtype runs at."""

FLOAT8 = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3b11fnuz",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3",
    "float8_e3m4",
)
"""The float8 types with a sign (float8_e8m0fnu, unsigned, is only converted to and from)."""

INTEGERS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def dtype(name: str) -> np.dtype:
    """The numpy dtype of a name, including bfloat16 and the float8 types."""
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def needs_x64(*names: str) -> bool:
    """True when any of the dtypes is 64-bit (JAX needs jax_enable_x64 for it)."""
    return any(n in ("float64", "int64", "uint64", "complex128") for n in names)


@dataclass(frozen=True)
class FloatOp:
    """An elementwise float operation and the domain of each of its operands."""

    name: str
    function: Callable[..., Any]
    domains: tuple[tuple[float, float], ...]
    budget: Budget = ELEMENTARY
    edges: tuple[float, ...] = ()  # special values beyond NaN, infinities and zeros
    outputs: tuple[str, ...] = ()  # the operations of a group of exact ones, one output each

    def inputs(
        self, type_name: str, size: int
    ) -> Callable[[np.random.Generator], list[np.ndarray]]:
        def make(rng: np.random.Generator) -> list[np.ndarray]:
            arrays = [
                floats(rng, dtype(type_name), size, low, high, (*NAN_INF_ZEROS, *self.edges))
                for low, high in self.domains
            ]
            if len(arrays) == 2 and size >= 64:
                # Operand pairs that are special together (inf - inf, 0 / 0, atan2(±0, ±0)).
                specials = np.asarray((*NAN_INF_ZEROS, 1.0, -1.0)).astype(arrays[0].dtype)
                pairs = np.array(np.meshgrid(specials, specials)).reshape(2, -1)
                count = min(pairs.shape[1], size - 16)
                arrays[0][16 : 16 + count] = pairs[0, :count]
                arrays[1][16 : 16 + count] = pairs[1, :count]
            return arrays

        return make


WIDE = (-1e4, 1e4)
UNIT = (-1.0, 1.0)
POSITIVE = (0.0, 1e6)


def _group(*functions: Callable[..., Any]) -> Callable[..., tuple[Any, ...]]:
    return lambda *operands: tuple(f(*operands) for f in functions)


def _exact_group(
    name: str, operations: str, domains: tuple[tuple[float, float], ...], *edges: float
) -> FloatOp:
    """One case of several exact jax.numpy operations (named, space-separated, as jnp names
    them) on the same operands, one output each named by its operation: one program tests
    them all (a program per operation would multiply the compiles), and a failure still
    names the operation."""
    names = tuple(operations.split())
    functions = [getattr(jnp, operation) for operation in names]
    return FloatOp(name, _group(*functions), domains, EXACT, edges, outputs=names)


UNARY = (
    _exact_group("sign_abs", "negative abs sign square reciprocal", (WIDE,)),
    _exact_group("rounding", "floor ceil round trunc", ((-100, 100),), 0.5, 1.5, 2.5, -0.5, -2.5),
    FloatOp("sqrt", jnp.sqrt, (POSITIVE,), EXACT, (-1.0, 1.0)),
    FloatOp("rsqrt", lax.rsqrt, (POSITIVE,), ELEMENTARY, (-1.0, 1.0)),
    FloatOp("cbrt", jnp.cbrt, (WIDE,), ELEMENTARY, (1.0, -8.0)),
    FloatOp("exp", jnp.exp, ((-100, 100),), ELEMENTARY, (1.0,)),
    FloatOp("exp2", jnp.exp2, ((-140, 140),), ELEMENTARY, (1.0, 10.0)),
    FloatOp("expm1", jnp.expm1, ((-100, 100),), ELEMENTARY, (1e-10,)),
    FloatOp("log", jnp.log, (POSITIVE,), ELEMENTARY, (1.0, -1.0)),
    FloatOp("log1p", jnp.log1p, ((-1.0, 1e6),), ELEMENTARY_LOOSE_F64, (-1.0, -2.0, 1e-10)),
    FloatOp("log2", jnp.log2, (POSITIVE,), ELEMENTARY, (1.0, 8.0, -1.0)),
    FloatOp("log10", jnp.log10, (POSITIVE,), ELEMENTARY, (1.0, 100.0, -1.0)),
    FloatOp("logistic", jax.nn.sigmoid, ((-50, 50),), ELEMENTARY),
    FloatOp("sin", jnp.sin, ((-20, 20),), ELEMENTARY),
    FloatOp("cos", jnp.cos, ((-20, 20),), ELEMENTARY),
    FloatOp("tan", jnp.tan, ((-1.5, 1.5),), ELEMENTARY),
    FloatOp("arcsin", jnp.arcsin, (UNIT,), ELEMENTARY, (1.0, -1.0, 1.5)),
    FloatOp("arccos", jnp.arccos, (UNIT,), ELEMENTARY, (1.0, -1.0, 1.5)),
    FloatOp("arctan", jnp.arctan, (WIDE,), ELEMENTARY, (1.0, -1.0)),
    FloatOp("sinh", jnp.sinh, ((-100, 100),), ELEMENTARY),
    FloatOp("cosh", jnp.cosh, ((-100, 100),), ELEMENTARY),
    FloatOp("tanh", jnp.tanh, ((-20, 20),), ELEMENTARY),
    FloatOp("arcsinh", jnp.arcsinh, (WIDE,), ELEMENTARY),
    FloatOp("arccosh", jnp.arccosh, ((1.0, 1e4),), ELEMENTARY, (1.0, 0.5)),
    FloatOp("arctanh", jnp.arctanh, (UNIT,), ELEMENTARY_LOOSE_F64, (1.0, -1.0, 1.5)),
    FloatOp("erf", lax.erf, ((-6, 6),), ELEMENTARY),
    FloatOp("erfc", lax.erfc, ((-6, 12),), ELEMENTARY),
    FloatOp("erf_inv", lax.erf_inv, (UNIT,), SPECIAL, (1.0, -1.0)),
    FloatOp("lgamma", lax.lgamma, ((0.1, 30),), SPECIAL, (1.0, 2.0, -1.0)),
    FloatOp("digamma", lax.digamma, ((0.1, 30),), SPECIAL, (1.0, -1.0)),
    FloatOp("bessel_i0e", lax.bessel_i0e, ((-50, 50),), SPECIAL),
    FloatOp("bessel_i1e", lax.bessel_i1e, ((-50, 50),), SPECIAL),
    FloatOp("integer_pow3", lambda x: lax.integer_pow(x, 3), ((-100, 100),), ELEMENTARY),
)
"""Unary float operations: every transcendental JAX lowers to an op or an expansion."""


def _atan2_constant(constant: float, first: bool = False) -> Callable[[Any], Any]:
    if first:
        return lambda x: jnp.arctan2(jnp.asarray(constant, x.dtype), x)
    return lambda x: jnp.arctan2(x, jnp.asarray(constant, x.dtype))


ATAN2_CONSTANTS = (
    FloatOp("atan2_const1", _atan2_constant(1.0), (WIDE,), ELEMENTARY, (1.0, -1.0)),
    FloatOp("atan2_const2", _atan2_constant(2.0), (WIDE,), ELEMENTARY, (2.0, -2.0)),
    FloatOp("atan2_const_minus1", _atan2_constant(-1.0), (WIDE,), ELEMENTARY, (1.0, -1.0)),
    FloatOp("atan2_const_half", _atan2_constant(0.5), (WIDE,), ELEMENTARY, (1.0, -1.0)),
    FloatOp("atan2_y_const1", _atan2_constant(1.0, first=True), (WIDE,), ELEMENTARY, (1.0, -1.0)),
)
"""atan2 with one constant operand: jnp.arctan is atan2(x, 1), miscompiled by the default plugin."""

BINARY = (
    _exact_group("arithmetic", "add subtract multiply divide", (WIDE, WIDE)),
    _exact_group("minmax", "maximum minimum copysign nextafter", (WIDE, WIDE)),
    FloatOp("fmod", jnp.fmod, (WIDE, (-100, 100)), EXACT),
    FloatOp("atan2", jnp.arctan2, ((-10, 10), (-10, 10)), ELEMENTARY),
    FloatOp("hypot", jnp.hypot, (WIDE, WIDE), ELEMENTARY),
    FloatOp("logaddexp", jnp.logaddexp, ((-100, 100), (-100, 100)), ELEMENTARY),
    FloatOp("power", jnp.power, ((0.0, 100.0), (-8.0, 8.0)), SPECIAL),
)
"""Binary float operations, on two arrays (special values paired with each other)."""

COMPLEX = (
    ("multiply", jnp.multiply, 2),
    ("divide", jnp.divide, 2),
    ("abs", jnp.abs, 1),
    ("exp", jnp.exp, 1),
    ("log", jnp.log, 1),
    ("sqrt", jnp.sqrt, 1),
    ("sin", jnp.sin, 1),
    ("tanh", jnp.tanh, 1),
)
"""Complex operations (complex64, and complex128 with x64), all held to ELEMENTARY."""


def float_cases() -> Iterator[Case]:
    """elementwise/<op>/<dtype>/n<size>: every float operation in every float type and size."""
    for op in (*UNARY, *ATAN2_CONSTANTS, *BINARY):
        for type_name, sizes in FLOAT_SIZES.items():
            for size in sizes:
                yield Case(
                    f"elementwise/{op.name}/{type_name}/n{size}",
                    op.function,
                    op.inputs(type_name, size),
                    op.budget,
                    x64=needs_x64(type_name),
                    outputs=op.outputs,
                )
    arithmetic = BINARY[0]
    for type_name in FLOAT8:
        yield Case(
            f"elementwise/arithmetic/{type_name}/n64",
            arithmetic.function,
            FloatOp("", arithmetic.function, ((-8, 8), (-8, 8))).inputs(type_name, 64),
            EXACT,
            outputs=arithmetic.outputs,
        )
    for type_name in ("complex64", "complex128"):
        for name, function, arity in COMPLEX:
            yield Case(
                f"elementwise/{name}/{type_name}/n64",
                function,
                lambda rng, t=type_name, k=arity: [complexes(rng, dtype(t), 64) for _ in range(k)],
                ELEMENTARY,
                x64=needs_x64(type_name),
            )


COMPARE_TYPES = ("float32", "float64", "float16", "bfloat16", "int8", "int32", "uint32", "int64")


def _pair(type_name: str, size: int) -> Callable[[np.random.Generator], list[np.ndarray]]:
    """Two operands that are equal in about a quarter of the places (ties matter here)."""

    def make(rng: np.random.Generator) -> list[np.ndarray]:
        kind = dtype(type_name)
        if kind.kind in "iu":
            x, y = integers(rng, kind, size), integers(rng, kind, size)
        else:
            x, y = floats(rng, kind, size, -100, 100), floats(rng, kind, size, -100, 100)
            y[5:10] = np.asarray((np.nan, -0.0, 0.0, np.inf, -np.inf)).astype(kind)
        same = rng.random(size) < 0.25
        y[same] = x[same]
        return [x, y]

    return make


def _ordering(x: Any, y: Any) -> tuple[Any, ...]:
    return (x < y, x <= y, x > y, x >= y, x == y, x != y)


def _select(x: Any, y: Any) -> tuple[Any, ...]:
    return (jnp.where(x > y, x, y), jnp.clip(x, jnp.minimum(x, y), y), lax.select(x == y, y, x))


def _classify(x: Any, y: Any) -> tuple[Any, ...]:
    return (jnp.isnan(x), jnp.isinf(x), jnp.isfinite(x), jnp.signbit(x))


def compare_cases() -> Iterator[Case]:
    """compare/{ordering,select,classify}/<dtype>/n256: comparisons, selects, NaN tests."""
    for type_name in COMPARE_TYPES:
        x64 = needs_x64(type_name)
        make = _pair(type_name, 256)
        yield Case(
            f"compare/ordering/{type_name}/n256",
            _ordering,
            make,
            x64=x64,
            outputs=("lt", "le", "gt", "ge", "eq", "ne"),
        )
        yield Case(
            f"compare/select/{type_name}/n256",
            _select,
            make,
            x64=x64,
            outputs=("where", "clip", "select"),
        )
        if dtype(type_name).kind not in "iu":
            yield Case(
                f"compare/classify/{type_name}/n256",
                _classify,
                make,
                x64=x64,
                outputs=("isnan", "isinf", "isfinite", "signbit"),
            )


def _integer_operands(type_name: str) -> Callable[[np.random.Generator], list[np.ndarray]]:
    """x, y, a divisor (no zero, no MIN / -1) and a shift amount (up to the width + 2)."""

    def make(rng: np.random.Generator) -> list[np.ndarray]:
        kind = dtype(type_name)
        x, y, divisor = (integers(rng, kind, 256) for _ in range(3))
        divisor[divisor == 0] = 7  # division by zero and MIN / -1 are implementation-defined
        if kind.kind == "i":
            divisor[(x == np.iinfo(kind).min) & (divisor == -1)] = 3
        # Shift amounts past the width are defined (0, or the sign for arithmetic shifts).
        shift = rng.integers(0, kind.itemsize * 8 + 3, 256).astype(kind)
        return [x, y, divisor, shift]

    return make


def _arithmetic(x: Any, y: Any, divisor: Any, shift: Any) -> tuple[Any, ...]:
    return (
        x + y,
        x - y,
        x * y,
        -x,
        jnp.abs(x),
        jnp.sign(x),
        jnp.maximum(x, y),
        jnp.minimum(x, y),
        lax.integer_pow(x, 3),
    )


def _division(x: Any, y: Any, divisor: Any, shift: Any) -> tuple[Any, ...]:
    return (
        lax.div(x, divisor),
        lax.rem(x, divisor),
        jnp.floor_divide(x, divisor),
        jnp.remainder(x, divisor),
    )


def _bits(x: Any, y: Any, divisor: Any, shift: Any) -> tuple[Any, ...]:
    return (
        x & y,
        x | y,
        x ^ y,
        ~x,
        lax.population_count(x),
        lax.clz(x),
        lax.shift_left(x, shift),
        lax.shift_right_logical(x, shift),
        lax.shift_right_arithmetic(x, shift),
    )


INTEGER_GROUPS: Sequence[tuple[str, Callable[..., Any], tuple[str, ...]]] = (
    (
        "arithmetic",
        _arithmetic,
        ("add", "subtract", "multiply", "negative", "abs", "sign", "max", "min", "pow3"),
    ),
    ("division", _division, ("div", "rem", "floor_divide", "remainder")),
    (
        "bits",
        _bits,
        ("and", "or", "xor", "not", "popcount", "clz", "shl", "shr_logical", "shr_arithmetic"),
    ),
)


def integer_cases() -> Iterator[Case]:
    """integer/<group>/<dtype>/n256: wrapping arithmetic, division, bit operations, shifts."""
    for type_name in INTEGERS:
        for group, function, outputs in INTEGER_GROUPS:
            yield Case(
                f"integer/{group}/{type_name}/n256",
                function,
                _integer_operands(type_name),
                x64=needs_x64(type_name),
                outputs=outputs,
            )
