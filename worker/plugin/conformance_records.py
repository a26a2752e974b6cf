"""What ``pjrt-pool check-plugin`` found per plugin build, and the warning it gives.

check-plugin compares a plugin's results with JAX's on a battery of small
programs and records each case's outcome here, in the cache directory's
``plugins/`` folder as ``conformance-<plugin sha256>.json``: one record per
plugin build, whatever its path. compile_program and Pool call
warn_known_failures, which warns once per process and plugin build when the
loaded build has failing cases that nothing fixes, naming them and the
command that shows the details: cases failing in the build's record, and
the failures pjrt-pool ships knowledge of (worker.plugin.known_builds) that no
workaround of lower() covers, so that a known build warns in a fresh
environment too.

warn_known_failures runs on compile_program's path, so it must cost next to
nothing: after its first call per plugin and cache directory it is a set
lookup, and the first call hashes the plugin only when some build has a
record at all or the library has the size of a known build with failures
that no workaround in effect covers (the digest is memoized too; see
worker.identity.build).

Records are read and written as the cache's other records about plugin
builds (worker.cache.memos): through the checked plugins/ folder, never
through a symlink, bounded in size and nesting, and signed when the cache
signs its entries.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from worker.cache.open_caches import existing_memos, open_cache
from worker.cache.store import DiskCache
from worker.cache.trust import UntrustedCacheError
from worker.identity.keys import check_key
from worker.plugin.build_identity import plugin_build_sha256
from worker.plugin.known_builds import (
    WORKAROUNDS_ENV,
    KnownBuild,
    known_build,
    may_have_uncovered_failures,
    uncovered_failures,
    workarounds_enabled,
)
from worker.plugin.locate import env_var

MEMO_FORMAT = 2
"""Bumped whenever the record's layout or meaning changes; records of another format are
ignored. 2: outcomes are of the programs as lower() writes them for the build, workarounds
included (format 1 records were measured without any)."""

MEMO_PREFIX = "conformance-"
"""Records are ``plugins/conformance-<sha256>.json`` in the cache directory."""

FAILING = ("wrong", "error", "crash", "timeout")
"""The outcomes that count as failures (pass and skipped do not)."""

NAMED_IN_WARNING = 8
"""How many failing cases the warning names before it says how many more there are."""


class KnownPluginFailuresWarning(UserWarning):
    """The loaded plugin build failed conformance cases when check-plugin last ran on it."""


def memo_path(directory: Path, plugin_sha256: str) -> Path:
    """Returns the file that holds a plugin build's record in a cache directory."""
    return directory / "plugins" / _memo_name(plugin_sha256)


def _memo_name(plugin_sha256: str) -> str:
    return f"{MEMO_PREFIX}{check_key(plugin_sha256, 'a plugin build digest')}.json"


def read_memo(
    cache_dir: str | os.PathLike[str] | None, plugin_sha256: str
) -> dict[str, Any] | None:
    """Returns a plugin build's record, or None when there is none (or it is unreadable).

    The record is a dict: ``plugin_sha256``, ``platform``, ``path`` (where the
    build was last checked), ``checked`` (seconds since the epoch), ``jax``
    (the version that gave the reference results), ``workarounds`` (the
    names of lower()'s workarounds for the build, which the programs had)
    and ``cases``, which maps each case name that was run to its outcome
    ("pass", "wrong", "error", "crash", "timeout" or "skipped").
    """
    try:
        return _read_memo(open_cache(cache_dir), plugin_sha256)
    except (OSError, ValueError, UntrustedCacheError):
        return None


def _read_memo(cache: DiskCache, plugin_sha256: str) -> dict[str, Any] | None:
    """read_memo in an open cache; raises what reading raises."""
    record = cache.memos.read(_memo_name(plugin_sha256))
    if not isinstance(record, dict) or record.get("format") != MEMO_FORMAT:
        return None
    if record.get("plugin_sha256") != plugin_sha256 or not isinstance(record.get("cases"), dict):
        return None
    return record


def write_memo(
    cache_dir: str | os.PathLike[str] | None,
    *,
    plugin_sha256: str,
    platform: str,
    path: str,
    jax_version: str,
    outcomes: Mapping[str, str],
    known_cases: frozenset[str] | None = None,
    workarounds: Sequence[str] = (),
) -> Path:
    """Merges a run's outcomes into a plugin build's record and writes it atomically.

    Cases run before and not now keep their outcome, so that checking a few
    cases does not forget the others; with known_cases (every case of the
    current battery), outcomes of cases that no longer exist are dropped.
    workarounds names those lower() applied for the build in the run (a run
    without the build's workarounds is not recorded: see pool.conformance).
    Returns the record's path. Raises OSError when the directory cannot be
    written.
    """
    cache = open_cache(cache_dir)
    try:
        previous = _read_memo(cache, plugin_sha256)
    except (OSError, ValueError, UntrustedCacheError):
        previous = None  # unreadable: written anew
    cases: dict[str, str] = dict(previous["cases"]) if previous else {}
    cases.update(outcomes)
    if known_cases is not None:
        cases = {name: outcome for name, outcome in cases.items() if name in known_cases}
    record = {
        "format": MEMO_FORMAT,
        "plugin_sha256": plugin_sha256,
        "platform": platform,
        "path": path,
        "checked": time.time(),
        "jax": jax_version,
        "workarounds": list(workarounds),
        "cases": dict(sorted(cases.items())),
    }
    cache.memos.write(_memo_name(plugin_sha256), record)
    return memo_path(cache.directory, plugin_sha256)


def failing_cases(record: Mapping[str, Any] | None) -> list[str]:
    """Returns the names of a record's failing cases, sorted."""
    if not record:
        return []
    return sorted(name for name, outcome in record["cases"].items() if outcome in FAILING)


def details_command(platform: str, path: str, names: list[str]) -> str:
    """Returns the check-plugin command line that reruns `names` on a plugin and shows why."""
    patterns = ",".join(names[:NAMED_IN_WARNING])
    if len(names) > NAMED_IN_WARNING:
        patterns = "*"
    return f"pjrt-pool check-plugin --platform {platform} --plugin {path} --cases '{patterns}'"


def failures_message(
    path: str, digest: str, record: Mapping[str, Any] | None, build: KnownBuild | None
) -> str | None:
    """Returns the warning text for the build at `path`, or None when nothing needs saying.

    The failing cases are those of its record (measured with lower()'s
    workarounds) and the known failures of a known build that no workaround
    in effect covers.
    """
    from_record = failing_cases(record)
    from_build = uncovered_failures(build)
    names = sorted({*from_record, *from_build})
    if not names:
        return None
    platform = record.get("platform", "cpu") if record else build.platform if build else "cpu"
    shown = ", ".join(names[:NAMED_IN_WARNING])
    if len(names) > NAMED_IN_WARNING:
        shown += f" and {len(names) - NAMED_IN_WARNING} more"
    sources = []
    if from_build and build is not None:
        sources.append(f"as pjrt-pool knows of {build.package}")
    if from_record and record is not None:
        checked = time.strftime("%Y-%m-%d", time.localtime(record.get("checked", 0)))
        sources.append(f"as check-plugin found on {checked}")
    off = ""
    if build is not None and build.workarounds and not workarounds_enabled():
        fixable = {c for f in build.failures if f.workaround is not None for c in f.cases}
        off = (
            f" {len(fixable & set(names))} of them are fixed by lower()'s workarounds for this "
            f"build ({', '.join(w.name for w in build.workarounds)}), which "
            f"{WORKAROUNDS_ENV}=off turns off."
        )
    return (
        f"the {platform} PJRT plugin {path} (sha256 {digest[:12]}) computes {len(names)} "
        f"conformance case(s) differently from JAX ({' and '.join(sources)}): {shown}. Results "
        f"of programs that use these operations may be wrong.{off} Details: "
        f"{details_command(platform, path, names)}; to use another plugin, set "
        f"{env_var(platform)}."
    )


_looked: set[tuple[str, str]] = set()  # (plugin path, cache directory) already looked at
_warned: set[str] = set()  # plugin digests already warned about in this process
_lock = threading.Lock()


def _in_pool_worker() -> bool:
    # A pool worker runs `python -m worker`; its parent warns for it, and a
    # warning in the worker would only end up in crash reports' output tails.
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and spec.name in ("worker", "worker.__main__")


def warn_known_failures(plugin_path: str | None, directory: Path) -> None:
    """Warns (KnownPluginFailuresWarning) if the plugin build at plugin_path has failing cases.

    It looks in the record check-plugin keeps in the cache directory (its
    caller's, resolved: worker.cache.location.resolve_cache_dir), once per
    plugin path and cache directory, and
    warns at most once per plugin build in a process. It never raises: a
    missing or unreadable record means nothing is known. compile_program and
    Pool call it; pool workers stay quiet (their parent warns).
    """
    if not plugin_path:
        return
    looked = (plugin_path, str(directory))
    with _lock:
        if looked in _looked:
            return
        _looked.add(looked)
    if _in_pool_worker():
        return
    try:
        found = _known_failures(plugin_path, directory)
    except Exception:  # a damaged record or an unreadable plugin must never break compiling
        return
    if found is None:
        return
    digest, message = found
    with _lock:
        if digest in _warned:
            return
        _warned.add(digest)
    # stacklevel 3: the caller of compile_program or of Pool().
    warnings.warn(message, KnownPluginFailuresWarning, stacklevel=3)


def _known_failures(plugin_path: str, directory: Path) -> tuple[str, str] | None:
    """The plugin build's digest and the warning text, if it has failing cases nothing fixes."""
    plugins_dir = directory / "plugins"
    try:
        recorded = any(name.startswith(MEMO_PREFIX) for name in os.listdir(plugins_dir))
    except OSError:
        recorded = False
    if not recorded and not may_have_uncovered_failures(plugin_path):
        return None  # nothing to warn about, whatever its digest: do not hash it for nothing
    # Never creates the cache directory: a Pool's parent warns before any worker made it.
    digest = plugin_build_sha256(plugin_path, lambda: existing_memos(directory))
    record = read_memo(directory, digest) if recorded else None
    message = failures_message(plugin_path, digest, record, known_build(digest))
    return None if message is None else (digest, message)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Suppresses KnownPluginFailuresWarning inside the block (check-plugin's own pool)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KnownPluginFailuresWarning)
        yield
