"""The compile options part of a key: the default serialized options, and checking given ones."""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def compile_options() -> bytes:
    """Returns the serialized CompileOptionsProto for one replica and one partition."""
    # executable_build_options (field 3) { num_replicas (4): 1, num_partitions (5): 1 }
    return bytes.fromhex("1a0420012801")


def checked_compile_options(options: Any) -> bytes | None:
    """Returns compile options as given (None: the default ones); refuses what is not bytes."""
    if options is None or isinstance(options, bytes):
        return options
    raise TypeError("compile_options must be bytes (a serialized CompileOptionsProto)")


def options_or_default(options: bytes | None) -> bytes:
    """The serialized compile options to use: the given ones, else the default."""
    return compile_options() if options is None else options
