"""Conversion cases: every supported dtype to every other, and bit casts.

convert/<source>/to_int/n256 converts to bool and every integer type, and
convert/<source>/to_float/n256 to every floating-point and complex type,
one output per target. Conversions are exact operations (integer
wrap-around, rounding to nearest even, truncation toward zero), so they are
compared bit for bit. Float-to-integer conversions of values out of the
target's range, and of NaN, are implementation-defined in StableHLO, so
those inputs stay in range; everything else (overflow to infinity or NaN in
narrow floats, subnormals, signed zeros) is included. The family runs with
jax_enable_x64 on, since its groups contain the 64-bit types.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from jax import lax

from pool.conformance.case import Case
from pool.conformance.elementwise import FLOAT8, dtype
from pool.conformance.inputs import complexes, finfo, floats, integers, is_float

SIGNED = ("bool", "int8", "int16", "int32", "int64")
UNSIGNED = ("uint8", "uint16", "uint32", "uint64")
FLOATING = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    *FLOAT8,
    "float8_e8m0fnu",
    "complex64",
    "complex128",
)
SOURCES = (*SIGNED, *UNSIGNED, *FLOATING)
"""Every supported dtype; each is converted to every other."""


def _in_range(rng: np.random.Generator, kind: np.dtype, low: float, high: float) -> np.ndarray:
    """Values a float or complex source converts to every integer target without overflow."""
    info = finfo(kind) if is_float(kind) else None
    if info is not None:
        low, high = max(low, float(info.min)), min(high, float(info.max))
    values = rng.uniform(low, high, 256)
    values[:8] = np.clip([0.5, 1.5, -0.5, 2.5, -0.0, 0.0, 127.0, 255.0], low, high)
    if kind.kind == "c":
        return (values + 1j * rng.uniform(-4, 4, 256)).astype(kind)
    return values.astype(kind)


def _to_integers(source: str) -> Callable[[np.random.Generator], list[np.ndarray]]:
    """Inputs for the signed targets (int8's range) and the unsigned ones (uint8's)."""
    kind = dtype(source)

    def make(rng: np.random.Generator) -> list[np.ndarray]:
        if is_float(kind) or kind.kind == "c":
            return [_in_range(rng, kind, -128.0, 127.0), _in_range(rng, kind, 0.0, 255.0)]
        values = integers(rng, kind, 256)
        return [values, values]

    return make


def _to_floats(source: str) -> Callable[[np.random.Generator], list[np.ndarray]]:
    """Wide magnitudes: overflow, underflow and subnormals in the narrow targets."""
    kind = dtype(source)

    def make(rng: np.random.Generator) -> list[np.ndarray]:
        if kind.kind == "c":
            return [complexes(rng, kind, 256, radius=1e3)]
        if is_float(kind):
            values = floats(rng, kind, 256, -1e6, 1e6)
            tiny = np.asarray([1e-5, -3e-8, 6e-8, 1e-40, 2e-45, 65520.0, 448.0, 464.0])
            with np.errstate(over="ignore"):  # overflowing narrow types on purpose
                values[8:16] = tiny.astype(kind)
            return [values]
        return [integers(rng, kind, 256)]

    return make


def _convert(x: Any, targets: tuple[str, ...]) -> tuple[Any, ...]:
    with warnings.catch_warnings():  # complex to real keeps the real part, as intended
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        return tuple(lax.convert_element_type(x, dtype(t)) for t in targets)


def _integer_converter(signed: Any, unsigned: Any) -> tuple[Any, ...]:
    return (*_convert(signed, SIGNED), *_convert(unsigned, UNSIGNED))


BITCASTS = (
    ("float32", "int32"),
    ("float32", "uint32"),
    ("int32", "float32"),
    ("float16", "int16"),
    ("bfloat16", "uint16"),
    ("float64", "int64"),
    ("uint64", "float64"),
    ("float32", "uint8"),
    ("float8_e4m3fn", "int8"),
)
"""(from, to) pairs for bitcast_convert_type, including one that changes the shape."""


def conversion_cases() -> Iterator[Case]:
    """convert/<source>/to_{int,float}/n256 and convert/bitcast/<from>_to_<to>/n256."""
    for source in SOURCES:
        yield Case(
            f"convert/{source}/to_int/n256",
            _integer_converter,
            _to_integers(source),
            x64=True,
            outputs=(*SIGNED, *UNSIGNED),
        )
        yield Case(
            f"convert/{source}/to_float/n256",
            lambda x: _convert(x, FLOATING),
            _to_floats(source),
            x64=True,
            outputs=FLOATING,
        )
    for source, target in BITCASTS:
        yield Case(
            f"convert/bitcast/{source}_to_{target}/n256",
            lambda x, t=target: lax.bitcast_convert_type(x, dtype(t)),
            lambda rng, s=source: [
                integers(rng, dtype(s), 256)
                if dtype(s).kind in "iu"
                else floats(rng, dtype(s), 256, -1e4, 1e4)
            ],
            x64=True,
        )
