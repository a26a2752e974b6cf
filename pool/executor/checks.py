"""Checking one value a caller gives: its kind and its range.

A value of the wrong kind raises TypeError, one out of range ValueError; both
name the argument, say what it must be and show what it was. Each Pool
option's check (pool.executor.options) is made of these, and so are
ClusterPool's and each call's own (a run's timeout).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any


def check_timeout(value: Any, what: str = "timeout") -> float | None:
    """Returns a timeout in seconds: None for None, math.inf for no limit; refuses the rest.

    A timeout is a positive number of seconds; inf means no limit. NaN, zero,
    negative numbers, booleans and strings raise before any work starts.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{what} must be a number of seconds (or None), not {type(value).__name__} {value!r}"
        )
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(
            f"{what} must be a positive number of seconds (inf: no limit), not {value!r}"
        )
    return seconds


def finite(seconds: float | None) -> float | None:
    """A checked timeout as a bound: None when there is none."""
    return None if seconds is None or math.isinf(seconds) else seconds


def check_count(value: Any, what: str, minimum: int, meaning: str) -> int:
    """Returns an int of at least `minimum`; `meaning` says what it counts, for the error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int ({meaning}), not {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be at least {minimum} ({meaning}), not {value!r}")
    return int(value)


def check_grace(value: Any, what: str) -> float:
    """Returns a finite number of seconds of at least zero (how long to wait before escalating)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__} {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} must be a finite number of seconds, 0 or more, not {value!r}")
    return seconds


def check_flag(value: Any, what: str) -> bool:
    """Returns a bool; refuses anything else (a string "False" would be true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, not {type(value).__name__} {value!r}")
    return value


def check_platform(value: Any) -> str | None:
    """Returns a platform's name (as in PJRT_POOL_PLUGIN_<PLATFORM>), or None for the default."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError(
            f"platform must be a platform's name such as 'cpu' or 'cuda' (or None for the "
            f"default), not {type(value).__name__} {value!r}"
        )
    return value


def check_directory(value: Any, what: str) -> str | None:
    """Returns a directory's path as a str (from a str or os.PathLike of one), or None."""
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path:
        raise TypeError(
            f"{what} must be a directory's path (str or pathlib.Path) or None, "
            f"not {type(value).__name__} {value!r}"
        )
    return path


def check_initargs(value: Any) -> tuple[Any, ...]:
    """Returns the initializer's arguments as a tuple (from a tuple or list)."""
    if not isinstance(value, (tuple, list)):
        raise TypeError(
            f"initargs must be a tuple or list of the initializer's arguments, "
            f"not {type(value).__name__} {value!r}"
        )
    return tuple(value)


def check_initializer(value: Any, what: str = "initializer") -> Any:
    """Returns a callable, or None; refuses anything else."""
    if value is not None and not callable(value):
        raise TypeError(f"{what} must be callable, not {type(value).__name__}")
    return value


def pickle_initializer(initializer: Any, initargs: tuple[Any, ...]) -> bytes:
    """Returns the initializer and its arguments as cloudpickle bytes (b"" for none)."""
    if check_initializer(initializer) is None:
        return b""
    import cloudpickle  # here: a Pool given no initializer, and the CLI, never need it

    try:
        return cloudpickle.dumps((initializer, tuple(initargs)))
    except Exception as error:  # what pickling raises varies with what it met
        raise TypeError(
            "initializer and initargs go to each worker with cloudpickle, which "
            f"cannot pickle them: {type(error).__name__}: {error}"
        ) from error
