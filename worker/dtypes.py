"""The element types the runtime supports, as numpy dtypes and PJRT_Buffer_Type codes.

PJRT names element types by the PJRT_Buffer_Type enum of its C API; numpy
and JAX by dtype. This module is the one table between them. The narrow
floating-point types come from ml_dtypes, which JAX uses for the same types.
Sub-byte types (int4, float4, ...) are left out: their host layout in PJRT is
packed, which numpy cannot view.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

# PJRT_Buffer_Type values from pjrt_c_api.h, in enum order.
_PJRT_TYPES: dict[int, np.dtype] = {
    1: np.dtype(np.bool_),  # PRED
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.uint8),
    7: np.dtype(np.uint16),
    8: np.dtype(np.uint32),
    9: np.dtype(np.uint64),
    10: np.dtype(np.float16),
    11: np.dtype(np.float32),
    12: np.dtype(np.float64),
    13: np.dtype(ml_dtypes.bfloat16),
    14: np.dtype(np.complex64),
    15: np.dtype(np.complex128),
    16: np.dtype(ml_dtypes.float8_e5m2),
    17: np.dtype(ml_dtypes.float8_e4m3fn),
    18: np.dtype(ml_dtypes.float8_e4m3b11fnuz),
    19: np.dtype(ml_dtypes.float8_e5m2fnuz),
    20: np.dtype(ml_dtypes.float8_e4m3fnuz),
    26: np.dtype(ml_dtypes.float8_e4m3),
    27: np.dtype(ml_dtypes.float8_e3m4),
    28: np.dtype(ml_dtypes.float8_e8m0fnu),
}
_CODES: dict[np.dtype, int] = {dtype: code for code, dtype in _PJRT_TYPES.items()}

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(_PJRT_TYPES.values())
"""Every dtype that programs may take and return."""


def _has_buffer_format(dtype: np.dtype) -> bool:
    try:
        memoryview(np.empty(0, dtype))
    except (ValueError, TypeError):
        return False
    return True


# ml_dtypes' types have no buffer-protocol format, so numpy cannot hand them to
# the native module; they travel as same-size unsigned integers. Found by trying
# rather than by dtype.kind, which ml_dtypes sets to "f" for some (float8_e5m2
# in 0.6) and "V" for others.
_BUFFER_DTYPES: dict[np.dtype, np.dtype] = {
    dtype: np.dtype(f"u{dtype.itemsize}")
    for dtype in SUPPORTED_DTYPES
    if not _has_buffer_format(dtype)
}
_FLOATING: frozenset[np.dtype] = frozenset(
    dtype for dtype in SUPPORTED_DTYPES if dtype.kind == "f" or dtype in _BUFFER_DTYPES
)


def buffer_view(value: Any) -> Any:
    """Returns an array of an ml_dtypes type as a same-size uint view, anything else as it is.

    The native module reads arrays through the buffer protocol; the element
    type travels separately, as a PJRT code.
    """
    if isinstance(value, np.ndarray):
        view_as = _BUFFER_DTYPES.get(value.dtype)
        if view_as is not None:
            return value.view(view_as)
    return value


def is_floating(dtype: np.dtype) -> bool:
    """Returns whether a supported dtype is a real floating-point type (ml_dtypes' included)."""
    return np.dtype(dtype) in _FLOATING


def dtype_of_code(code: int) -> np.dtype:
    """Returns the numpy dtype of a PJRT_Buffer_Type code."""
    try:
        return _PJRT_TYPES[code]
    except KeyError:
        raise TypeError(
            f"the PJRT plugin uses element type {code} (PJRT_Buffer_Type), "
            "which pjrt-pool cannot represent as a numpy dtype"
        ) from None


def code_of_dtype(dtype: np.dtype) -> int:
    """Returns the PJRT_Buffer_Type code of a numpy dtype."""
    try:
        return _CODES[np.dtype(dtype)]
    except KeyError:
        names = ", ".join(sorted(str(d) for d in SUPPORTED_DTYPES))
        raise TypeError(
            f"dtype {np.dtype(dtype)} is not supported by the PJRT runtime; use one of: {names}"
        ) from None
