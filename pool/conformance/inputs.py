"""Seeded inputs for conformance cases, in each operation's domain, with special values.

Values are half uniform over the domain and half log-uniform in magnitude
(so that tiny and huge values both occur), rounded to the dtype. Special
values (NaN, infinities, signed zeros, domain edges) go first, where the
report's "first differing index" finds them easily; arrays shorter than
MIN_SPECIAL_SIZE get none, so that small sizes test ordinary values.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

NAN_INF_ZEROS = (np.nan, np.inf, -np.inf, -0.0, 0.0)
"""The special values of every float input that the operation accepts them for."""

MIN_SPECIAL_SIZE = 16
"""Arrays with fewer elements get no special values."""


def finfo(dtype: np.dtype) -> ml_dtypes.finfo:
    """Returns the float info of any float dtype numpy or ml_dtypes knows."""
    return ml_dtypes.finfo(dtype)


def is_float(dtype: np.dtype) -> bool:
    """True for real floating-point dtypes, including bfloat16 and the float8 types."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return True
    try:
        ml_dtypes.finfo(dtype)
    except (ValueError, TypeError):
        return False
    return dtype.kind == "V"


def _with_specials(values: np.ndarray, specials: Sequence[float]) -> np.ndarray:
    flat = values.reshape(-1)
    if specials and flat.size >= max(MIN_SPECIAL_SIZE, 2 * len(specials)):
        flat[: len(specials)] = np.asarray(specials).astype(values.dtype)
    return flat.reshape(values.shape)


def floats(
    rng: np.random.Generator,
    dtype: np.dtype | type,
    shape: int | tuple[int, ...],
    low: float = -10.0,
    high: float = 10.0,
    specials: Sequence[float] = NAN_INF_ZEROS,
) -> np.ndarray:
    """Returns floats in [low, high] of a dtype, half uniform and half log-uniform in size.

    The bounds are clipped to the dtype's finite range; specials are placed
    first (for arrays of at least MIN_SPECIAL_SIZE elements).
    """
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    info = finfo(dtype)
    low, high = max(low, float(info.min)), min(high, float(info.max))
    size = int(np.prod(shape))
    uniform = rng.uniform(low, high, size)
    # Log-uniform magnitudes from the smallest normal number up to the bound.
    tiny = max(float(info.smallest_normal), 1e-30)
    top = max(abs(low), abs(high), tiny * 2)
    magnitude = np.exp(rng.uniform(np.log(tiny), np.log(top), size))
    sign = rng.choice([-1.0, 1.0], size) if low < 0 < high else (1.0 if high > 0 else -1.0)
    logarithmic = np.clip(sign * magnitude, low, high)
    values = np.where(rng.random(size) < 0.5, uniform, logarithmic).reshape(shape)
    with np.errstate(over="ignore", invalid="ignore"):  # specials overflow narrow types on purpose
        return _with_specials(values.astype(dtype), specials)


def complexes(
    rng: np.random.Generator,
    dtype: np.dtype | type,
    shape: int | tuple[int, ...],
    radius: float = 4.0,
    specials: bool = True,
) -> np.ndarray:
    """Returns complex numbers with both parts in [-radius, radius] (and a few special ones)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    values = rng.uniform(-radius, radius, shape) + 1j * rng.uniform(-radius, radius, shape)
    values = values.astype(dtype)
    if specials:
        values = _with_specials(
            values, (complex(0.0, 0.0), complex(-0.0, 1.0), complex(np.inf, 0.0), complex(np.nan))
        )
    return values


def integers(
    rng: np.random.Generator,
    dtype: np.dtype | type,
    shape: int | tuple[int, ...],
    low: int | None = None,
    high: int | None = None,
    edges: bool = True,
) -> np.ndarray:
    """Returns integers in [low, high] (default: the dtype's whole range).

    With edges, the bounds and the values next to zero come first: where
    overflow, sign and wrap-around bugs show.
    """
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    info = np.iinfo(dtype)
    low = int(info.min) if low is None else max(low, int(info.min))
    high = int(info.max) if high is None else min(high, int(info.max))
    values = rng.integers(low, high, shape, dtype=dtype, endpoint=True)
    # Half the values small, since most bugs are not at the extremes.
    small = rng.integers(max(low, -100), min(high, 100), shape, endpoint=True).astype(dtype)
    values = np.where(rng.random(shape) < 0.5, values, small).astype(dtype)
    flat = values.reshape(-1)
    special = [v for v in (low, high, 0, 1, -1, low + 1, high - 1) if low <= v <= high]
    if edges and flat.size >= max(MIN_SPECIAL_SIZE, 2 * len(special)):
        flat[: len(special)] = [dtype.type(v) for v in special]
    return flat.reshape(shape)


def values_of(
    rng: np.random.Generator, dtype: np.dtype | type, shape: int | tuple[int, ...]
) -> np.ndarray:
    """Returns typical values of any supported dtype: floats, complexes, integers or bools."""
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        return complexes(rng, dtype, shape)
    if is_float(dtype):
        return floats(rng, dtype, shape)
    return integers(rng, dtype, shape)
