"""Cache keys: what makes two compilations interchangeable.

An executable may be reused only for the same program text, platform, plugin
build, compile options and, on CPU, host CPU features (XLA:CPU compiles for
the host's instruction set, and a plugin refuses an executable built for
other features). The key is the SHA-256 of those parts as canonical JSON;
explain_key() shows the parts.

Hashing a plugin library (hundreds of MB) takes a second or so, so its digest
is memoized per (path, size, mtime, inode): in memory, and in the cache
directory's ``plugins/`` folder for later processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform as host_platform
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.cache.atomic import write_atomically

KEY_FORMAT = 1
"""Bumped whenever the meaning of a key's parts changes."""

_file_memo: dict[tuple[str, tuple[str, int, int, int]], Any] = {}
_memo_lock = threading.Lock()


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def memoized_by_file(
    path: str, memo_dir: Path | None, kind: str, compute: Callable[[], Any]
) -> Any:
    """Returns compute() for a file, memoized per (real path, size, mtime, inode).

    The value is kept in memory and, when memo_dir is given, in a JSON file
    there named after `kind` and the identity, so that later processes reuse
    it; a rebuilt or replaced file has a new identity and is computed again.
    The value must be JSON-ready.
    """
    stat = os.stat(path)
    identity = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    with _memo_lock:
        if (kind, identity) in _file_memo:
            return _file_memo[kind, identity]
    memo_file = None
    value = None
    if memo_dir is not None:
        name = hashlib.sha256(repr(identity).encode()).hexdigest()[:32]
        memo_file = memo_dir / f"{kind}-{name}.json"
        try:
            record = json.loads(memo_file.read_text())
            if record.get("identity") == list(identity):
                value = record["value"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # absent or unreadable: compute again
    if value is None:
        value = compute()
        if memo_file is not None:
            # A read-only cache: the in-memory memo still serves this process.
            with contextlib.suppress(OSError):
                write_atomically(
                    memo_file, json.dumps({"identity": list(identity), "value": value}).encode()
                )
    with _memo_lock:
        _file_memo[kind, identity] = value
    return value


def plugin_digest(path: str, memo_dir: Path | None) -> str:
    """Returns the SHA-256 of a plugin library, memoized by path, size, mtime and inode."""
    return memoized_by_file(path, memo_dir, "sha256", lambda: _file_digest(path))


_cpu_features: str | None = None


def host_cpu_features() -> str:
    """Returns a digest of the host's CPU model flags (what XLA:CPU compiles for)."""
    global _cpu_features
    if _cpu_features is None:
        flags = ""
        try:
            with open("/proc/cpuinfo") as cpuinfo:
                for line in cpuinfo:
                    name, _, value = line.partition(":")
                    if name.strip() in ("flags", "Features", "isa"):
                        flags = " ".join(sorted(value.split()))
                        break
        except OSError:
            flags = host_platform.processor()
        text = f"{host_platform.machine()}|{flags}"
        _cpu_features = hashlib.sha256(text.encode()).hexdigest()[:24]
    return _cpu_features


def key_parts(
    *,
    text: str,
    platform: str,
    plugin_sha256: str,
    api_version: str,
    platform_version: str,
    device_kind: str,
    compile_options: bytes,
) -> dict[str, Any]:
    """Returns the parts that identify an executable, as JSON-ready data."""
    parts: dict[str, Any] = {
        "format": KEY_FORMAT,
        "program_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "platform": platform,
        "plugin": {
            "sha256": plugin_sha256,
            "api_version": api_version,
            "platform_version": platform_version,
            "device_kind": device_kind,
        },
        "compile_options": compile_options.hex(),
    }
    if platform == "cpu":
        parts["host"] = {"machine": host_platform.machine(), "cpu_features": host_cpu_features()}
    return parts


IDENTITY_PARTS = ("format", "platform", "plugin", "host")
"""The parts that tie an executable to a plugin build and host, not to a program."""


def foreign_parts(parts: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Returns the identity parts in which an entry's parts differ from `here`'s.

    An entry that differs is not bad: it was made by another plugin build or
    on another host, and is never loaded here (its key differs too).
    """
    return [name for name in IDENTITY_PARTS if parts.get(name) != here.get(name)]


def key_of(parts: dict[str, Any]) -> str:
    """Returns the cache key (hex SHA-256) of key parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def explain_key(parts: dict[str, Any], other: dict[str, Any] | None = None) -> str:
    """Returns a key's parts as readable lines; with `other`, marks the parts that differ."""
    lines = []

    def walk(prefix: str, value: Any, against: Any) -> None:
        if isinstance(value, dict):
            for name in sorted(value):
                sub = against.get(name) if isinstance(against, dict) else None
                walk(f"{prefix}{name}.", value[name], sub)
            return
        mark = "" if other is None or against == value else f"   <- differs: {against!r}"
        lines.append(f"{prefix[:-1]} = {value!r}{mark}")

    walk("", parts, other if other is not None else {})
    lines.append(f"key = {key_of(parts)}")
    return "\n".join(lines)
