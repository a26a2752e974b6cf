"""Never-compile mode: serving processes load warmed executables and never compile.

With ``PJRT_POOL_COMPILE=never`` in the environment, or ``never_compile=True``
on compile_program and Pool (which override the variable), a program that
is not in the disk cache raises NeverCompileError, a LookupError, instead of
compiling on the serving node for seconds to minutes: it names the program,
its key, and, when the cache holds an entry for the same program built
elsewhere (another plugin build, other CPU features, other XLA flags), the
key parts in which that entry differs from this process's.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from worker.cache.store import DiskCache
from worker.compile.explain_miss import related_entries
from worker.errors import NeverCompileError
from worker.identity.keys import IDENTITY_PARTS
from worker.words import counted

if TYPE_CHECKING:
    from worker.cache.remote import RemoteCache

COMPILE_ENV = "PJRT_POOL_COMPILE"
"""never: load warmed executables only; allow (or unset): compile what is not cached."""

_NEVER, _ALLOW = "never", "allow"
_SHOWN = 3


def never_compile_on(option: bool | None = None) -> bool:
    """Returns whether this call must not compile: the option, else PJRT_POOL_COMPILE.

    Raises TypeError for an option that is not a bool or None, and ValueError
    for a value of the variable other than never or allow.
    """
    if option is not None:
        if not isinstance(option, bool):
            raise TypeError(f"never_compile must be True, False or None, not {option!r}")
        return option
    value = os.environ.get(COMPILE_ENV, "").strip().lower()
    if value in ("", _ALLOW):
        return False
    if value == _NEVER:
        return True
    raise ValueError(
        f"{COMPILE_ENV}={value!r}: set it to {_NEVER} (load warmed executables only) or "
        f"{_ALLOW} (compile what is not in the cache, the default)"
    )


def built_elsewhere(cache: DiskCache, parts: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """Returns the cache's entries of the same program built elsewhere, and how each differs
    (nearest first; explain_miss.related_entries, which reads only headers)."""
    found = related_entries(cache, parts, sections=IDENTITY_PARTS)
    return [(entry.key, list(entry.differences)) for entry in found]


def refusal(
    name: str,
    key: str,
    cache: DiskCache | None,
    parts: dict[str, Any],
    reason: str = "",
    remote: RemoteCache | None = None,
) -> NeverCompileError:
    """The NeverCompileError for a program without a usable entry in the cache (nor in the
    remote tier, when there is one).

    reason says what was wrong with the entry that was found ("" for none).
    The cache's and the remote's builds of the same program elsewhere are
    named with the key parts in which they differ.
    """
    where = "no disk cache" if cache is None else f"the cache {cache.directory}"
    if remote is not None:
        where += f" nor in the remote {remote.location.shown}"
    state = f"has no usable entry in {where} ({reason})" if reason else f"is not in {where}"
    said = ""
    lines: list[str] = []
    for holder, elsewhere in (
        ("cache", [] if cache is None or not cache.usable else built_elsewhere(cache, parts)),
        ("remote", [] if remote is None else remote.built_elsewhere(key, parts)),
    ):
        found = [
            f"entry {other}: " + "; ".join(diff or ["no part differs"]) for other, diff in elsewhere
        ]
        if found:
            said += (
                f" The {holder} holds it built elsewhere ({counted(len(found), 'entry')}): "
                + " | ".join(found[:_SHOWN])
                + (" | ..." if len(found) > _SHOWN else "")
                + "."
            )
        lines += found
    return NeverCompileError(
        f"{name} (key {key}) {state}, and this process must not compile "
        f"({COMPILE_ENV}=never or never_compile=True): nothing was compiled.{said} Warm it "
        "with this plugin and host settings (pjrt-pool warm), or check a deployment first "
        "(pjrt-pool bundle check)",
        program=name,
        key=key,
        location="" if cache is None else str(cache.directory),
        differences="\n".join(lines),
    )
