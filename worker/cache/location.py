"""Where the disk cache lives and how large it may grow.

The directory comes from an argument, else ``PJRT_POOL_CACHE_DIR``, else the
platform's user cache directory (``$XDG_CACHE_HOME/pjrt-pool`` or
``~/.cache/pjrt-pool`` on Linux, ``~/Library/Caches/pjrt-pool`` on macOS).
The size bound comes from an argument, else ``PJRT_POOL_CACHE_MAX_SIZE``
(bytes, or with a K/M/G/T suffix), else DEFAULT_MAX_SIZE. The cache's
yes-or-no settings (a shared cache, a read-only remote) are read one way,
flag_from_environment, and so are its numbers (the remote's time limits and
concurrency), number_from_environment.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

CACHE_DIR_ENV = "PJRT_POOL_CACHE_DIR"
MAX_SIZE_ENV = "PJRT_POOL_CACHE_MAX_SIZE"
DEFAULT_MAX_SIZE = 4 << 30
"""4 GiB: thousands of typical executables (tens of KB to a few MB each)."""

SUBDIRECTORIES = ("entries", "locks", "plugins", "loads")
"""The directories under a cache directory, each checked as the directory itself is."""

_N = TypeVar("_N", int, float)

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

YES = frozenset({"1", "true", "yes", "on"})
"""What a yes-or-no variable says for yes (any case, spaces around it ignored)..."""
NO = frozenset({"", "0", "false", "no", "off"})
"""...and for no: unset or empty is no."""


def flag_from_environment(name: str, hint: str = "write 1 or 0") -> bool:
    """Whether the yes-or-no variable `name` says yes (YES) or no (NO); raises ValueError
    naming it, its value and the hint for anything else."""
    value = os.environ.get(name, "").strip().lower()
    if value in YES:
        return True
    if value in NO:
        return False
    raise ValueError(f"{name}={value!r}: {hint}")


def number_from_environment(
    name: str, kind: type[_N], default: _N, fits: Callable[[_N], bool], wanted: str
) -> _N:
    """The number (int or float: kind) the variable `name` gives, default when it is unset or
    empty; raises ValueError naming it, its value and what is wanted for anything that is not
    such a number or does not fit."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: {wanted}") from None
    if not fits(value):
        raise ValueError(f"{name}={text!r}: {wanted}")
    return value


def default_cache_dir() -> Path:
    """Returns the cache directory named by the environment, or the user cache directory."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "pjrt-pool"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pjrt-pool"


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """Returns the cache directory for an argument (None: the default)."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def parse_size(text: str | int) -> int:
    """Reads a size such as 500M, 2G, 1.5GiB or 1048576; raises ValueError otherwise."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if match is None:
        raise ValueError(f"not a size: {text!r} (write bytes, or a number with K, M, G or T)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def resolve_max_size(max_size: str | int | None) -> int:
    """Returns the size bound for an argument (None: the environment, else the default)."""
    if max_size is not None:
        return parse_size(max_size)
    from_env = os.environ.get(MAX_SIZE_ENV)
    if from_env:
        try:
            return parse_size(from_env)
        except ValueError as error:
            raise ValueError(f"{MAX_SIZE_ENV}: {error}") from None
    return DEFAULT_MAX_SIZE


def format_size(size: int) -> str:
    """Returns a size for people: 1.5 MiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
