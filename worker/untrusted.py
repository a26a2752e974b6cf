"""Reading what someone else may have written: sizes and nesting bounded before parsing.

A file in a shared cache, a manifest handed over by someone, a key file: any
of them may be crafted to exhaust a reader. So a file is opened without
blocking (a FIFO would wait for a writer forever), must be a regular file
(``/dev/zero`` never ends), and its size is checked on the opened descriptor
before anything is read. JSON is parsed by orjson: one pass, linear in the
input whatever it holds, UTF-8 only (Python's json.loads guesses UTF-16 and
UTF-32 from the first bytes) and with a nesting limit of its own (1024
levels, so that no raised recursion limit lets it overflow the C stack);
what it returns is then held to MAX_JSON_DEPTH, since Python code that
walks a result recursively (repr, json.dumps, copy) fails near 1000 levels.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from typing import Any

import orjson

MAX_JSON_DEPTH = 64
"""Nesting deeper than this is refused: nothing pjrt-pool writes nests beyond ten levels."""

_UNICODE_MARKS = (b"\xef\xbb\xbf", b"\xfe\xff", b"\xff\xfe")
"""Byte order marks (UTF-8, UTF-16 and UTF-32) that json.loads would decode by."""

_PARSER_DEPTH = 1024
"""orjson's own nesting limit: it refuses deeper text as it reaches the limit."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


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


def parse_json(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parses JSON text (UTF-8 bytes, or str); raises ValueError for bad or too deeply nested JSON.

    Stricter than json.loads where JSON itself is: bytes that are not UTF-8
    (UTF-16 and UTF-32 included, or with a byte order mark), NaN and
    Infinity, and numbers out of a double's range are refused; an integer
    beyond 64 bits becomes a float (so a field that must be an int refuses
    it). Arrays and objects nested deeper than max_depth (at most the
    parser's own 1024) are refused. The time is linear in the text's length.
    """
    if isinstance(text, memoryview):
        text = bytes(text)  # orjson reads bytes, bytearray and str; a view only if contiguous
    try:
        document = orjson.loads(text)
    except orjson.JSONDecodeError as error:  # a ValueError: raised as it is, unless for depth
        if "depth limit" in str(error) or "recursion" in str(error).lower():
            limit = min(max_depth, _PARSER_DEPTH)
            raise ValueError(f"JSON nested deeper than {limit} levels") from None
        if isinstance(text, (bytes, bytearray)) and (
            text.startswith(_UNICODE_MARKS) or 0 in text[:4]
        ):  # JSON text's first four bytes hold a NUL only in UTF-16 or UTF-32
            raise ValueError(
                "JSON must be UTF-8 text without a byte order mark; this has one, or is "
                f"UTF-16 or UTF-32 ({error})"
            ) from None
        raise
    if _nests_deeper(document, max_depth):
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    return document


def _nests_deeper(document: Any, max_depth: int) -> bool:
    """Whether a parsed document nests arrays and objects deeper than max_depth (iteratively)."""
    if type(document) not in (dict, list):
        return False
    containers = [(document, 1)]
    while containers:
        node, depth = containers.pop()
        if depth > max_depth:
            return True
        for child in node.values() if type(node) is dict else node:
            if type(child) is dict or type(child) is list:
                containers.append((child, depth + 1))
    return False
