"""Cache keys: what makes two compilations interchangeable.

An executable may be reused only for the same program text, platform, plugin
build, compile options, client create options, code-generation environment
and, where the platform's executables are tied to them (PlatformPart), the
host's CPU features (environment.py: CPU) or the topology it was compiled
for (target.py: TPU). The key is the SHA-256 of those parts as
canonical JSON (key_of); key_parts assembles them, explain_key shows them,
and differing_parts says where an entry built elsewhere differs.

Keys come from manifests, bundles, replies and the command line, and become
file names in the cache: is_key and check_key say whether a value has a
key's form before any path is built from it.
"""

from __future__ import annotations

import enum
import hashlib
import json
import platform as host_platform
from typing import Any

from worker.errors import PjrtPoolError
from worker.identity.environment import codegen_environment, host_cpu_features, host_cpu_flags

KEY_FORMAT = 2
"""Bumped whenever the meaning of a key's parts changes."""


class PlatformPart(enum.Enum):
    """A key part that only some platforms' executables have (each platform says which of
    them its executables have: worker.plugin.platforms)."""

    HOST = "host"
    """The host's machine and CPU features: XLA:CPU compiles for the host's instruction set,
    and a plugin refuses an executable built for other features."""

    TOPOLOGY = "topology"
    """The topology compiled for (target.topology_part): a TPU executable is tied to it."""


def key_parts(
    *,
    text: str,
    platform: str,
    plugin_sha256: str,
    api_version: str,
    platform_version: str,
    device_kind: str,
    compile_options: bytes,
    client_options: dict[str, Any] | None = None,
    environment: dict[str, Any] | None = None,
    topology: dict[str, Any] | None = None,
    platform_parts: frozenset[PlatformPart] = frozenset(),
) -> dict[str, Any]:
    """Returns the parts that identify an executable, as JSON-ready data.

    client_options are the plugin's client create options and environment
    the code-generation environment (codegen_environment) of the process.
    topology is what the executable is compiled for where the platform's
    executables are tied to a topology (TPU: worker.identity.target.topology_part),
    the same whether compiled for a topology without a device or on the
    devices themselves; None leaves the part out (CPU and GPU keys).
    platform_parts are the parts the platform's executables have beside the
    common ones (PlatformPart.HOST adds the host's; the topology is given).
    """
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
        "client_options": dict(sorted((client_options or {}).items())),
        "environment": environment if environment is not None else codegen_environment(),
    }
    if PlatformPart.HOST in platform_parts:
        parts["host"] = {"machine": host_platform.machine(), "cpu_features": host_cpu_features()}
    if topology is not None:
        parts["topology"] = topology
    return parts


PROGRAM_PARTS = ("program_sha256", "compile_options")
"""The key parts that belong to the program; all others describe where it was built."""

IDENTITY_PARTS = (
    "format",
    "platform",
    "plugin",
    "host",
    "topology",
    "client_options",
    "environment",
)
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


class InvalidKeyError(PjrtPoolError, ValueError):
    """A cache key that is not 64 lowercase hexadecimal digits (a SHA-256)."""


_HEX_DIGITS = frozenset("0123456789abcdef")


def is_key(value: object) -> bool:
    """Whether value has the form of a cache key: 64 lowercase hexadecimal digits."""
    return isinstance(value, str) and len(value) == 64 and _HEX_DIGITS.issuperset(value)


def check_key(value: object, where: str = "a cache key") -> str:
    """Returns value if it has the form of a cache key; raises InvalidKeyError saying where.

    Keys come from manifests, bundles, replies and the command line, and
    become file names in the cache: anything else (a path, "..", a name with
    a slash) is refused before any path is built from it.
    """
    if is_key(value):
        return value  # type: ignore[return-value]
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise InvalidKeyError(
        f"{where} must be 64 lowercase hexadecimal digits (a SHA-256, as pjrt-pool writes "
        f"it), not {shown}"
    )


def _flatten(prefix: str, value: Any) -> dict[str, Any]:
    """Nested parts as {dotted name: leaf value}, names sorted (an empty dict has no leaves)."""
    if not isinstance(value, dict):
        return {prefix: value}
    flat: dict[str, Any] = {}
    for name in sorted(value):
        flat.update(_flatten(f"{prefix}.{name}" if prefix else name, value[name]))
    return flat


def explain_key(parts: dict[str, Any], other: dict[str, Any] | None = None) -> str:
    """Returns a key's parts as readable lines; with `other`, marks the parts that differ."""
    theirs = _flatten("", other) if other is not None else {}
    lines = []
    for name, value in _flatten("", parts).items():
        against = theirs.get(name)
        mark = "" if other is None or against == value else f"   <- differs: {against!r}"
        lines.append(f"{name} = {value!r}{mark}")
    lines.append(f"key = {key_of(parts)}")
    return "\n".join(lines)


LOADING_PARTS = ("format", "platform", "plugin", "host", "topology")
"""The identity parts an executable cannot be loaded across: another platform, plugin
build, host (CPU features) or topology. Across the others (client options, XLA flags,
thread counts) it loads and runs, as what was compiled with them."""


def differing_parts(
    built: dict[str, Any],
    here: dict[str, Any],
    cpu_flags: list[str] | None = None,
    sections: tuple[str, ...] = IDENTITY_PARTS,
) -> list[str]:
    """Says, one line per part, where an entry's identity differs from this process's.

    Only the identity parts count (the program's own parts are the same
    program's, or not comparable): for example "plugin.sha256: built with
    'ab12...', here 'cd34...'". A part one side lacks shows as None.
    cpu_flags are the builder's CPU flags, when its entry recorded them: a
    difference in CPU features then says which flags this host lacks.
    sections are the identity parts compared (default: all of them).
    """
    lines = []
    for section in sections:
        theirs = _flatten(section, built.get(section))
        mine = _flatten(section, here.get(section))
        for name in sorted(theirs.keys() | mine.keys()):
            if theirs.get(name) != mine.get(name):
                built_with, here_with = _shown(theirs.get(name)), _shown(mine.get(name))
                line = f"{name}: built with {built_with}, here {here_with}"
                if name == "compile_options":
                    line += _OPTIONS_NOTE
                if name == "host.cpu_features" and cpu_flags:
                    line += _flag_difference(cpu_flags, host_cpu_flags())
                lines.append(line)
    return lines


_OPTIONS_NOTE = (
    " (serialized CompileOptionsProto; a program lowered from JAX carries jax.jit's, whose"
    " debug options JAX reads from XLA_FLAGS where it lowers)"
)


def options_id(options_hex: str) -> str:
    """Names serialized compile options (the key part's hex): 16 hex digits of its SHA-256,
    as a bundle's index and an explanation of a miss name them."""
    return hashlib.sha256(options_hex.encode()).hexdigest()[:16]


def _shown(value: Any) -> str:
    """A part's value for people: serialized options (hex) by their length and options_id."""
    if isinstance(value, str) and len(value) > 96:
        try:
            size = len(bytes.fromhex(value))
        except ValueError:
            return repr(value)
        return f"{size} bytes sha256:{options_id(value)}"
    return repr(value)


def _flag_difference(built: list[str], here: tuple[str, ...]) -> str:
    lacks = sorted(set(built) - set(here))
    extra = sorted(set(here) - set(built))
    said = []
    if lacks:
        said.append(f"this host lacks {', '.join(lacks)}")
    if extra:
        said.append(f"has {', '.join(extra)}, which the builder had not")
    return f" ({'; '.join(said)})" if said else ""
