"""The element types the runtime supports, as numpy dtypes and PJRT_Buffer_Type codes.

PJRT names element types by the PJRT_Buffer_Type enum of its C API; numpy
and JAX by dtype. This module is the one table between them. The narrow
floating-point types come from ml_dtypes, which JAX uses for the same types.
Sub-byte types (int4, float4, ...) are left out: their host layout in PJRT is
packed, which numpy cannot view.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

# PJRT_Buffer_Type values from pjrt_c_api.h, in enum order: numpy's own types here,
# the narrow floating-point types of ml_dtypes below.
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
    14: np.dtype(np.complex64),
    15: np.dtype(np.complex128),
}
# ml_dtypes is imported (about 5 ms of a serving process's start) only once a program,
# an array, a dtype or a name needs one of its types (_load_narrow_types): a process
# that runs float32 programs never pays for it.
_NARROW_TYPES: dict[int, str] = {
    13: "bfloat16",
    16: "float8_e5m2",
    17: "float8_e4m3fn",
    18: "float8_e4m3b11fnuz",
    19: "float8_e5m2fnuz",
    20: "float8_e4m3fnuz",
    26: "float8_e4m3",
    27: "float8_e3m4",
    28: "float8_e8m0fnu",
}
_NUMPY_NAMES = frozenset(dtype.name for dtype in _PJRT_TYPES.values())
_CODES: dict[np.dtype, int] = {dtype: code for code, dtype in _PJRT_TYPES.items()}
# ml_dtypes' types have no buffer-protocol format, so numpy cannot hand them to
# the native module; they travel as same-size unsigned integers (filled as they load).
_BUFFER_DTYPES: dict[np.dtype, np.dtype] = {}
_FLOATING: set[np.dtype] = {dtype for dtype in _PJRT_TYPES.values() if dtype.kind == "f"}
_narrow_lock = threading.Lock()
_narrow_loaded = False


def _has_buffer_format(dtype: np.dtype) -> bool:
    try:
        memoryview(np.empty(0, dtype))
    except (ValueError, TypeError):
        return False
    return True


def _load_narrow_types() -> bool:
    """Adds ml_dtypes' types to the tables (once); returns whether this call added them."""
    global _narrow_loaded
    with _narrow_lock:
        if _narrow_loaded:
            return False
        import ml_dtypes

        for code, name in _NARROW_TYPES.items():
            dtype = np.dtype(getattr(ml_dtypes, name))
            # Found by trying rather than by dtype.kind, which ml_dtypes sets to "f"
            # for some (float8_e5m2 in 0.6) and "V" for others.
            if not _has_buffer_format(dtype):
                _BUFFER_DTYPES[dtype] = np.dtype(f"u{dtype.itemsize}")
            if dtype.kind == "f" or dtype in _BUFFER_DTYPES:
                _FLOATING.add(dtype)
            _CODES[dtype] = code
            _PJRT_TYPES[code] = dtype
        _narrow_loaded = True
        return True


def supported_dtypes() -> tuple[np.dtype, ...]:
    """Every dtype that programs may take and return, in PJRT_Buffer_Type order."""
    _load_narrow_types()
    return tuple(_PJRT_TYPES[code] for code in sorted(_PJRT_TYPES))


def __getattr__(name: str) -> Any:
    # SUPPORTED_DTYPES, as docs/api.md names it: the same tuple as supported_dtypes(),
    # made (ml_dtypes imported) only when it is read.
    if name == "SUPPORTED_DTYPES":
        return supported_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_by_name(name: str) -> np.dtype:
    """Returns the dtype of a name as ArrayType.to_json writes it ("float32", "bfloat16")."""
    if name in _NUMPY_NAMES:
        return np.dtype(name)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def buffer_view(value: Any) -> Any:
    """Returns an array of an ml_dtypes type as a same-size uint view, anything else as it is.

    The native module reads arrays through the buffer protocol; the element
    type travels separately, as a PJRT code.
    """
    if isinstance(value, np.ndarray):
        view_as = _BUFFER_DTYPES.get(value.dtype)
        if view_as is None and value.dtype.isbuiltin != 1 and _load_narrow_types():
            view_as = _BUFFER_DTYPES.get(value.dtype)  # an ml_dtypes array met first here
        if view_as is not None:
            return value.view(view_as)
    return value


def is_floating(dtype: np.dtype) -> bool:
    """Returns whether a supported dtype is a real floating-point type (ml_dtypes' included)."""
    dtype = np.dtype(dtype)
    if dtype not in _FLOATING and dtype.isbuiltin != 1:
        _load_narrow_types()
    return dtype in _FLOATING


def dtype_of_code(code: int) -> np.dtype:
    """Returns the numpy dtype of a PJRT_Buffer_Type code."""
    if code in _NARROW_TYPES:
        _load_narrow_types()
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
        found = np.dtype(dtype)
    except TypeError:
        if not _load_narrow_types():  # a name only ml_dtypes registers
            raise
        found = np.dtype(dtype)
    code = _CODES.get(found)
    if code is None and found.isbuiltin != 1 and _load_narrow_types():
        code = _CODES.get(found)  # a narrow type's array or dtype, met first here
    if code is None:
        names = ", ".join(sorted(str(d) for d in supported_dtypes()))
        raise TypeError(f"dtype {found} is not supported by the PJRT runtime; use one of: {names}")
    return code
