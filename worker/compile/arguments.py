"""Checking and converting a program's arguments, in one place for every caller.

Executable.run (in-process) and Pool.submit (in the parent, before arguments
go to shared memory) both use prepare_arguments, so a wrong argument raises
the same exception wherever a program runs.

An argument converts to its input type only when no value changes meaning:
complex to real, a change of kind (float to int) and values out of the
target's range (1000 for int8, 2**40 for uint32, 1e6 for float16, which
would become inf) are refused with TypeError, for arrays, numpy scalars and
lists alike. To convert anyway, with numpy's wrapping and rounding, convert
the argument yourself, for example ``x.astype(np.int8)``: an argument that
already has the input's dtype and shape is passed as it is, unchecked, and
costs nothing to prepare.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from worker.dtypes import code_of_dtype, is_floating
from worker.records import ArrayType
from worker.words import agreeing, counted

if TYPE_CHECKING:
    from numpy.typing import ArrayLike  # annotations only: importing it costs start-up time


def prepare_arguments(
    arguments: Sequence[ArrayLike],
    types: Sequence[ArrayType] | None,
    skip: Collection[int] = (),
) -> list[np.ndarray]:
    """Returns the arguments as C-contiguous arrays of the program's input types.

    With types None (unknown), each argument keeps its own dtype. Raises
    TypeError for a wrong number of arguments or a value that does not
    convert to its input type, and ValueError for a wrong shape. Arguments at
    the positions `skip` names are passed as they are (a pool's kept values,
    which are checked apart).
    """
    if type(arguments) not in (list, tuple) and (
        isinstance(arguments, (np.ndarray, str, bytes)) or not isinstance(arguments, Sequence)
    ):  # lists and tuples first: the Sequence check (an ABC's) costs a microsecond
        raise TypeError(
            "arguments must be a sequence with one array per program input, "
            f"not {type(arguments).__name__}"
        )
    if types is not None and len(arguments) != len(types):
        raise TypeError(
            f"the program takes {counted(len(types), 'argument')} "
            f"({', '.join(map(str, types))}) but {len(arguments)} "
            f"{agreeing(len(arguments), 'was', 'were')} given"
        )
    prepared = []
    for index, argument in enumerate(arguments):
        if skip and index in skip:
            prepared.append(argument)  # type: ignore[arg-type]
            continue
        if (
            types is not None
            and type(argument) is np.ndarray
            and argument.dtype == types[index].dtype
            and argument.shape == types[index].shape
            and argument.flags.c_contiguous
        ):
            prepared.append(argument)  # the common case, checked cheaply
            continue
        try:
            array = np.asarray(argument)
        except (TypeError, ValueError) as error:
            raise TypeError(f"argument {index} is not an array: {error}") from None
        if types is None:
            code_of_dtype(array.dtype)  # raises TypeError for an unsupported dtype
        else:
            array = _convert(index, argument, array, types[index])
        # Not np.ascontiguousarray: it turns a 0-d array into a 1-d one.
        prepared.append(array if array.flags.c_contiguous else np.asarray(array, order="C"))
    return prepared


def _convert(index: int, value: ArrayLike, array: np.ndarray, expected: ArrayType) -> np.ndarray:
    """Converts one argument to its input type, refusing conversions that lose its meaning."""
    if array.shape != expected.shape:
        raise ValueError(
            f"argument {index} has shape {array.shape} but the program takes "
            f"{expected} (shape {expected.shape})"
        )
    if array.dtype == expected.dtype:
        return array
    source, target = array.dtype, np.dtype(expected.dtype)
    if source.kind == "c" and target.kind != "c":
        raise TypeError(
            f"argument {index} is complex ({source}) but the program takes {target}: "
            "the imaginary part would be lost; pass the real part explicitly"
        )
    if source.kind in "iu" and target.kind in "iu":
        if not isinstance(value, (np.ndarray, np.generic)):
            # Python ints (scalars, lists) have no width of their own: convert them
            # by value, so that 254 fits uint8 and 1000 does not fit int8.
            try:
                return np.asarray(value, dtype=target)
            except OverflowError:
                raise _out_of_range(index, np.asarray(value, dtype=object), target) from None
        info = np.iinfo(target)
        if array.size and (int(array.min()) < info.min or int(array.max()) > info.max):
            raise _out_of_range(index, array, target)
        return array.astype(target)
    if not np.can_cast(source, target, casting="same_kind"):
        raise TypeError(
            f"argument {index} has dtype {source}, which does not convert to the "
            f"program's {target} without changing its kind; convert it explicitly first"
        )
    with np.errstate(over="ignore", invalid="ignore"):  # refused below, with a clear message
        converted = array.astype(target)
    if (is_floating(target) or target.kind == "c") and array.size:
        lost = ~np.isfinite(converted)
        if lost.any() and np.isfinite(array[lost]).any():
            raise _overflows(index, array[lost & np.isfinite(array)], target)
    return converted


_EXPLICIT = "convert it yourself first (for example with .astype) if that is what you mean"


def _out_of_range(index: int, values: np.ndarray, target: np.dtype) -> TypeError:
    info = np.iinfo(target)
    return TypeError(
        f"argument {index} does not fit {target}: its values range from {values.min()} to "
        f"{values.max()}, and {target} holds {info.min} to {info.max}; numpy would wrap "
        f"them around: {_EXPLICIT}"
    )


def _overflows(index: int, finite: np.ndarray, target: np.dtype) -> TypeError:
    largest = finite.flat[int(np.argmax(np.abs(finite)))]
    return TypeError(
        f"argument {index} does not fit {target}: {finite.size} finite value(s), such as "
        f"{largest}, become inf or nan in {target} (outside its range); {_EXPLICIT}"
    )


def types_of(arrays: Sequence[np.ndarray]) -> tuple[ArrayType, ...]:
    """Returns the ArrayType of each array."""
    return tuple(ArrayType(a.dtype, a.shape) for a in arrays)


def random_inputs(types: Sequence[Any], seed: int = 0) -> list[np.ndarray]:
    """Returns seeded random arrays, one per type (anything with .dtype and .shape).

    Floating-point values are standard normal, complex ones normal in both
    parts, integers uniform in [0, 1000) and booleans fair coin flips: inputs
    for trying a program (`pjrt-pool run`, the examples, benchmarks).
    """
    rng = np.random.default_rng(seed)
    arrays = []
    for array_type in types:
        dtype, shape = np.dtype(array_type.dtype), tuple(array_type.shape)
        if is_floating(dtype):
            values = rng.standard_normal(shape)
        elif dtype.kind == "c":
            values = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
        elif dtype.kind in "iu":
            values = rng.integers(0, 1000, size=shape)
        elif dtype.kind == "b":
            values = rng.integers(0, 2, size=shape)
        else:
            raise TypeError(f"no random inputs of dtype {dtype}")
        arrays.append(np.asarray(values).astype(dtype))
    return arrays
