"""XLA flags a plugin must see to compute what JAX computes.

JAX compiles with debug options of its own; this project passes the plugin
compile options without any (the six bytes of compile_options()), so the
plugin takes its debug options from its defaults and XLA_FLAGS. One default
changes results: both CPU plugins have ``xla_cpu_enable_fast_min_max`` on,
so ``max(x, NaN)`` is x where JAX gives NaN (maximum, minimum, hypot, and
max/min reductions; found by ``pjrt-pool check-plugin``). The plugin reads
XLA_FLAGS once, when it loads, and the flag set then makes those results
equal JAX's (docs/facts.md, "Fast min/max").

Each platform names its flags (worker.plugin.platforms: Platform.jax_semantics).
So while a plugin loads, these flags are added to XLA_FLAGS, and the
variable is restored afterwards: the process's environment, and a JAX in
it, stay as they were. A flag is added only when the user's XLA_FLAGS does
not name it (theirs wins), when XLA_FLAGS is not the name of a flag file,
and when the plugin's library contains the flag's name: XLA aborts on a flag
it does not know, and a later XLA may drop this one with its fast min/max.
The flags are part of what the cache key records (worker.identity.environment.codegen_environment).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from worker.identity.build import memoized_by_file
from worker.identity.environment import XLA_FLAGS_ENV, parse_xla_flags
from worker.log import get_logger
from worker.plugin.build_identity import installed_sha256
from worker.plugin.known_builds import known_build
from worker.plugin.locate import environment_variables
from worker.plugin.platforms.registry import platform_named

if TYPE_CHECKING:
    from worker.cache.memos import MemoStore

logger = get_logger("pjrt_pool.runtime")


def plugin_knows_flag(plugin_path: str, flag: str, memos: MemoStore | None = None) -> bool:
    """Whether a plugin library contains an XLA flag's name (a flag it does not know aborts it).

    Known without reading the library for a known build that its installed
    RECORD vouches for (KnownBuild.flags); otherwise memoized per plugin
    build, in memory and in a cache's records when given (signed when the
    cache signs: the answer decides what the plugin computes).
    """
    if _known_to_name(plugin_path, flag):
        return True

    def scan() -> bool:
        with (
            open(plugin_path, "rb") as file,
            mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as image,
        ):
            return image.find(flag.encode()) >= 0

    return bool(memoized_by_file(plugin_path, memos, f"flag-{flag}", scan, _is_bool))


def _known_to_name(plugin_path: str, flag: str) -> bool:
    """Whether the library is a known build (by its installed RECORD) that names the flag."""
    build = known_build(installed_sha256(plugin_path))
    return build is not None and flag in build.flags


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def semantic_flags(
    platform: str, plugin_path: str, memos: Callable[[], MemoStore | None] = lambda: None
) -> list[str]:
    """The flags to add to XLA_FLAGS while this platform's plugin loads (see the module).

    memos() gives the records to memoize a scan of the library in; it is
    called only when the library must be read.
    """
    wanted = platform_named(platform).jax_semantics
    current = os.environ.get(XLA_FLAGS_ENV, "")
    if not wanted or (current.strip() and not current.lstrip().startswith("-")):
        return []  # no such flags, or XLA_FLAGS names a file, which is the user's to write
    named = parse_xla_flags(current)
    flags = []
    for name, value in wanted.items():
        if name in named:
            continue
        try:
            known = _known_to_name(plugin_path, name) or plugin_knows_flag(
                plugin_path, name, memos()
            )
        except OSError as error:
            logger.debug("cannot read %s to look for --%s: %s", plugin_path, name, error)
            known = False
        if known:
            flags.append(f"--{name}={value}")
    return flags


@contextlib.contextmanager
def xla_flags_added(flags: list[str]) -> Iterator[None]:
    """Adds flags to XLA_FLAGS for the with-block, then puts the variable back as it was."""
    if not flags:
        yield
        return
    value = " ".join([os.environ.get(XLA_FLAGS_ENV, ""), *flags]).strip()
    with environment_variables({XLA_FLAGS_ENV: value}):
        yield
