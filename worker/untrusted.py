"""Reading what someone else may have written: sizes and nesting bounded before parsing.

A file in a shared cache, a manifest handed over by someone, a key file: any
of them may be crafted to exhaust a reader. So a file is opened without
blocking (a FIFO would wait for a writer forever), must be a regular file
(``/dev/zero`` never ends), and its size is checked on the opened descriptor
before anything is read; JSON is checked for nesting before it is parsed
(Python's parser recurses once per level, and 100,000 nested lists raise
RecursionError, or with a raised recursion limit overflow the C stack).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Callable
from typing import Any

MAX_JSON_DEPTH = 64
"""Nesting deeper than this is refused: nothing pjrt-pool writes nests beyond ten levels."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

# A JSON string (escapes included), and what is neither a bracket nor a quote.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def read_file(
    path: str | os.PathLike[str],
    limit: int,
    *,
    dir_fd: int | None = None,
    follow_symlinks: bool = False,
    what: str = "file",
    check: Callable[[os.stat_result], None] | None = None,
) -> bytes:
    """Returns a regular file's bytes, refusing one larger than limit before reading it.

    The file is opened without blocking and, unless follow_symlinks, without
    following a symlink (relative to dir_fd when given). Raises OSError:
    FileNotFoundError and the like from opening, ELOOP for a symlink, EINVAL
    for something other than a regular file (a FIFO, a device, a directory)
    and EFBIG for a file over the limit. check, when given, sees the opened
    file's stat before anything is read (and may raise).
    """
    flags = os.O_RDONLY | _NONBLOCK | _CLOEXEC | (0 if follow_symlinks else _NOFOLLOW)
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise OSError(errno.EINVAL, f"the {what} is not a regular file", os.fspath(path))
        if check is not None:
            check(found)
        if found.st_size > limit:
            raise OSError(
                errno.EFBIG,
                f"the {what} is {found.st_size} bytes, more than the {limit} it may have",
                os.fspath(path),
            )
        chunks = []
        left = limit + 1  # one byte more: a file that grew since fstat is refused too
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"the {what} grew past {limit} bytes", os.fspath(path))
        return data
    finally:
        os.close(fd)


def check_json_depth(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raises ValueError if JSON text nests arrays and objects deeper than max_depth.

    Only brackets outside strings count; the text need not be valid JSON
    (the parser judges that afterwards). Linear in the text's length.
    """
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8", errors="replace")
    if text.count("[") + text.count("{") <= max_depth:
        return  # too few brackets to nest deeper, wherever they are (the common case)
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = 0
    for character in brackets:
        if character in "[{":
            depth += 1
            if depth > max_depth:
                raise ValueError(f"JSON nested deeper than {max_depth} levels")
        else:
            depth -= 1


def parse_json(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads after check_json_depth; raises ValueError for bad or too deeply nested JSON."""
    check_json_depth(text, max_depth)
    try:
        return json.loads(text)
    except RecursionError:  # cannot happen after the check; kept as a last line
        raise ValueError("JSON nested too deeply to parse") from None
