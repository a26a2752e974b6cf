"""``python -m worker.serve.entry_check --platform P``: load entries, checked.

Runs in a child of ``pjrt-pool cache verify --load``, so that an entry that
crashes the plugin takes down this process, not the command. It reads keys
from stdin (one a line) and prints JSON lines on stdout, flushed one by one:

    {"runtime": {...}}                         the plugin and host it checks against
    {"checking": KEY}                          before touching an entry
    {"key": KEY, "status": S, "detail": D}     S: "ok", "bad" or "other plugin/host"
    {"error": MESSAGE, "kind": NAME}           the plugin could not be loaded (exit 1);
                                               NAME is the error's class, PluginLoadError
                                               for a file that is not a plugin

The cache is this process's default, PJRT_POOL_CACHE_DIR, which the
command sets for it: the one way a child that holds a plugin is given its
cache directory, for the entries and the plugin's records alike.

A "checking" line without its result names the entry that killed the
process. Entries whose key parts name another plugin build or host are not
loaded (they could not be used here, and are not bad); nothing is removed
and no access time changes.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from worker.cache.entry import CorruptEntryError, UnreadableEntryError
from worker.cache.report import OTHER, UNREADABLE
from worker.cache.store import DiskCache
from worker.compile.executable import Executable
from worker.errors import PjrtError, PlatformMismatchError, PluginLoadError, PluginNotFoundError
from worker.identity.keys import foreign_parts, is_key
from worker.identity.target import runtime_key_parts
from worker.plugin.runtime import get_runtime


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _check(cache: DiskCache, key: str, here: dict[str, Any]) -> dict[str, Any] | None:
    try:
        found = cache.read(key, touch=False)
    except CorruptEntryError as error:
        return {"status": "bad", "detail": str(error)}
    except UnreadableEntryError as error:
        return {"status": UNREADABLE, "detail": str(error)}
    if found is None:
        return None  # evicted or healed meanwhile
    entry = found[0]
    differing = foreign_parts(entry.parts, here)
    if differing:
        return {"status": OTHER, "detail": "differs in " + ", ".join(differing)}
    try:
        Executable.deserialize(entry.payload)
    except (PjrtError, ValueError) as error:
        return {"status": "bad", "detail": f"rejected by the plugin: {error}"}
    return {"status": "ok", "detail": ""}


def main(argv: list[str] | None = None) -> int:
    """Checks the keys on stdin; see the module docstring for the output."""
    parser = argparse.ArgumentParser(prog="python -m worker.serve.entry_check")
    parser.add_argument("--platform", required=True)
    args = parser.parse_args(argv)
    keys = sys.stdin.read().split()

    cache = DiskCache(create=False)
    try:
        runtime = get_runtime(args.platform)
        here = runtime_key_parts(runtime, cache if cache.usable else None)
    except (PluginNotFoundError, PluginLoadError, PlatformMismatchError, PjrtError) as error:
        _emit({"error": f"{type(error).__name__}: {error}", "kind": type(error).__name__})
        return 1
    _emit({"runtime": {"path": runtime.location.path, "api_version": runtime.api_version}})
    for key in keys:
        if not is_key(key):  # a key names a file: never anything else
            _emit({"key": key, "status": "bad", "detail": "not a cache key"})
            continue
        _emit({"checking": key})
        result = _check(cache, key, here)
        if result is not None:
            _emit({"key": key, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
