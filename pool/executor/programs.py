"""Which program a task runs: its identity within a pool, and its text's digest.

The pool routes, keeps loaded and quarantines programs by this identity
(platform, compile options and text), and ClusterPool routes by it to a node.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import threading
from typing import Any

from worker.identity.options import options_or_default
from worker.partitioning import compile_options_for
from worker.records import DigestedProgram, LoweredProgram

_MEMO_BYTES = 64 << 20
"""Program text (in characters) that the program-identity memo may keep alive."""

_text_digests: collections.OrderedDict[int, tuple[str, str]] = collections.OrderedDict()
_memo_size = 0
_memo_lock = threading.Lock()


def _text_digest(text: str) -> str:
    """The SHA-256 of a program text, memoized by the text object's identity.

    The same program is usually submitted many times, and hashing a large
    module costs more than a small program's whole round trip. The memo
    keeps the texts it knows alive (to make their identity safe to reuse),
    so it holds at most _MEMO_BYTES of them, the oldest going first.
    """
    global _memo_size
    memo = _text_digests.get(id(text))  # one dict lookup: atomic, no lock needed
    if memo is not None and memo[0] is text:
        return memo[1]
    digest = hashlib.sha256(text.encode()).hexdigest()
    if len(text) <= _MEMO_BYTES // 4:
        with _memo_lock:
            old = _text_digests.pop(id(text), None)
            if old is not None:
                _memo_size -= len(old[0])
            _text_digests[id(text)] = (text, digest)
            _memo_size += len(text)
            while _memo_size > _MEMO_BYTES:
                _, (dropped, _) = _text_digests.popitem(last=False)
                _memo_size -= len(dropped)
    return digest


def program_id(program: LoweredProgram, compile_options: bytes | None = None) -> str:
    """Identifies a program within a pool: platform, compile options and text.

    Two programs with the same text compiled with different options are
    different executables (fast math, for one, changes results), so the
    options are part of the identity wherever the pool routes, caches or
    quarantines a program. None means the program's own options (the default ones, or
    for a program over several devices those its partitioning derives). A program from
    lower() carries its text's digest (DigestedProgram), so that its text is
    hashed once, however large it is.
    """
    options = compile_options_for(program, compile_options)
    return _identity(program_text_digest(program), program.platform, options)


def program_text_digest(program: LoweredProgram) -> str:
    """The SHA-256 of a program's text: the one lower() recorded, or computed (memoized)."""
    if isinstance(program, DigestedProgram):
        return program.text_sha256
    return _text_digest(program.text)


@functools.lru_cache(maxsize=4096)
def _identity(text_digest: str, platform: str | None, options: bytes) -> str:
    return hashlib.sha256(f"{platform or ''}\0{options.hex()}\0{text_digest}".encode()).hexdigest()


def program_key_parts(
    host_parts: dict[str, Any], text_digest: str, compile_options: bytes | None
) -> dict[str, Any]:
    """The cache key parts of a program on workers whose plugin and host have host_parts
    (Pool.key_parts): the parent computes its key (worker.identity.keys.key_of) without a worker.
    compile_options are the program's (compile_options_for; None: the default ones)."""
    options = options_or_default(compile_options)
    return {**host_parts, "program_sha256": text_digest, "compile_options": options.hex()}
