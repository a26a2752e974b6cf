"""Cache keys: what makes two compilations interchangeable.

An executable may be reused only for the same program text, platform, plugin
build, compile options, client create options, code-generation environment
and, on CPU, host CPU features (XLA:CPU compiles for the host's instruction
set, and a plugin refuses an executable built for other features). The key
is the SHA-256 of those parts as canonical JSON; explain_key() shows the
parts.

The code-generation environment is what the plugin reads from environment
variables when it loads (see codegen_environment): XLA_FLAGS, normalized
(parsed as XLA parses it, later flags overriding earlier ones, sorted, and
without the flags that only dump or log, which change no code), and the
thread-count variables PJRT_NPROC and NPROC, which change how XLA:CPU splits
loops into parallel tasks. Measured: ``--xla_cpu_enable_fast_math=true
--xla_cpu_fast_math_honor_nans=false`` turns isnan into false (a program
returns [0 0 0 0] instead of [11 0 11 0]), and PJRT_NPROC=8 or more changes
the serialized executable of a 1024x1024 matmul program on both CPU plugins.

Hashing a plugin library (hundreds of MB) takes a second or so, so its digest
is memoized per (path, size, mtime, inode): in memory, and in the cache
directory's ``plugins/`` folder for later processes (as a record that is
signed when entries are: see memos.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform as host_platform
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.cache.memos import MemoStore

KEY_FORMAT = 2
"""Bumped whenever the meaning of a key's parts changes."""

XLA_FLAGS_ENV = "XLA_FLAGS"
THREAD_ENV = ("PJRT_NPROC", "NPROC")
"""Variables the CPU plugins read for their thread pool, whose size XLA:CPU's
compiler uses to partition loops."""

_NON_CODE_FLAGS = frozenset(
    {
        "xla_enable_dumping",
        "xla_detailed_logging",
        "xla_enable_scoped_logging_timers",
        # Where autotuning results are shared between processes: it decides
        # how fast a GPU program runs, not what it computes.
        "xla_gpu_per_fusion_autotune_cache_dir",
        # What JAX adds to LIBTPU_INIT_ARGS as it is imported on a Cloud TPU VM
        # (jax/_src/cloud_tpu_init.py), so every process there has it and a CPU
        # machine does not: measured with libtpu 0.0.42.1, 14 programs (12 example
        # programs, 2 training steps) compile for v5e:1x1 to the same serialized
        # executable with it and without it.
        "xla_tpu_use_enhanced_launch_barrier",
    }
)


def is_code_flag(name: str) -> bool:
    """Returns whether an XLA flag (without dashes) may change the generated code.

    Dump and log flags (xla_dump_*, *_dump_*, xla_log_*) only write files or
    messages, and the autotune cache directory only shares tuning results;
    every other flag counts, whether or not it is known to change code.
    """
    return not (
        name in _NON_CODE_FLAGS or name.startswith(("xla_dump", "xla_log_")) or "_dump_" in name
    )


def parse_xla_flags(text: str) -> dict[str, str]:
    """Parses flags as XLA parses XLA_FLAGS; returns {name: value}, later flags winning.

    Flags are separated by whitespace and start with "-" (parsing stops at
    the first word that does not); a value may be quoted with ' or " (with
    backslash escapes inside "). A flag without a value is a boolean set to
    "true".
    """
    flags: dict[str, str] = {}
    position = 0
    length = len(text)
    while True:
        while position < length and text[position].isspace():
            position += 1
        if position == length or text[position] != "-":
            return flags
        start = position
        while position < length and (text[position].isalnum() or text[position] in "-_"):
            position += 1
        if text[position : position + 1] == "=" and text[position + 1 : position + 2] in ("'", '"'):
            name, quote = text[start:position], text[position + 1]
            position += 2
            value = []
            while position < length and text[position] != quote:
                if quote == '"' and text[position] == "\\" and position + 1 < length:
                    position += 1  # a backslash escapes the next character inside "..."
                value.append(text[position])
                position += 1
            position += 1  # past the closing quote
        else:
            while position < length and not text[position].isspace():
                position += 1
            name, equals, value_text = text[start:position].partition("=")
            value = [value_text if equals else "true"]
        if name.lstrip("-"):
            flags[name.lstrip("-")] = "".join(value)


def normalized_xla_flags(value: str | None) -> list[str]:
    """Returns XLA_FLAGS as sorted "name=value" strings, leaving out flags that change no code.

    Like XLA, a value that does not start with "-" names a file holding the
    flags; a file that cannot be read gives a marker that keeps such a
    process's entries apart (the plugin itself stops at load in that case).
    """
    if not value or not value.strip():
        return []
    text = value
    if not value.lstrip().startswith("-"):
        try:
            with open(value) as file:
                text = file.read()
        except OSError as error:
            return [f"<unreadable flag file {value}: {error.strerror}>"]
    return _code_flags(text)


def _code_flags(text: str) -> list[str]:
    flags = parse_xla_flags(text)
    return [f"{name}={flags[name]}" for name in sorted(flags) if is_code_flag(name)]


LIBTPU_INIT_ARGS_ENV = "LIBTPU_INIT_ARGS"
"""libtpu's own flags, read as it initializes (TPU's XLA_FLAGS)."""


def codegen_environment(
    environ: dict[str, str] | None = None, platform: str | None = None
) -> dict[str, Any]:
    """Returns the environment that changes what the plugin generates, for the key.

    Read when the plugin loads (runtime.py), since the plugin reads it then
    and never again: {"xla_flags": [...]} plus each thread-count variable that
    is set and, for TPU, LIBTPU_INIT_ARGS's code flags (normalized as
    XLA_FLAGS are) when it names any. Variables read at run time only
    (oneDNN's DNNL_MAX_CPU_ISA, the TF_CPP_* logging ones) are left out:
    measured, DNNL_MAX_CPU_ISA=SSE41 leaves the serialized executable unchanged.
    """
    env = os.environ if environ is None else environ
    found: dict[str, Any] = {"xla_flags": normalized_xla_flags(env.get(XLA_FLAGS_ENV))}
    for name in THREAD_ENV:
        if env.get(name):
            found[name] = env[name]
    if platform == "tpu":
        init_args = _code_flags(env.get(LIBTPU_INIT_ARGS_ENV, ""))
        if init_args:
            found["libtpu_init_args"] = init_args
    return found


_file_memo: dict[tuple[str, tuple[str, int, int, int]], Any] = {}
_memo_lock = threading.Lock()


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def memoized_by_file(
    path: str,
    memos: MemoStore | None,
    kind: str,
    compute: Callable[[], Any],
    valid: Callable[[Any], bool] = lambda value: True,
) -> Any:
    """Returns compute() for a file, memoized per (real path, size, mtime, inode).

    The value is kept in memory and, when memos is given (a cache's
    plugins/ records), in a record there named after `kind` and the
    identity, so that later processes reuse it; a rebuilt or replaced file
    has a new identity and is computed again, and so is a record that
    cannot be trusted (see memos.py) or whose value fails `valid`. The
    value must be JSON-ready.
    """
    stat = os.stat(path)
    identity = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    with _memo_lock:
        if (kind, identity) in _file_memo:
            return _file_memo[kind, identity]
    name = f"{kind}-{hashlib.sha256(repr(identity).encode()).hexdigest()[:32]}.json"
    record = memos.read(name) if memos is not None else None
    if (
        record is not None
        and record.get("identity") == list(identity)
        and "value" in record
        and valid(record["value"])
    ):
        value = record["value"]
    else:
        value = compute()
        if memos is not None:
            # A read-only cache: the in-memory memo still serves this process.
            with contextlib.suppress(OSError):
                memos.write(name, {"identity": list(identity), "value": value})
    with _memo_lock:
        _file_memo[kind, identity] = value
    return value


def plugin_digest(path: str, memos: MemoStore | None) -> str:
    """Returns the SHA-256 of a plugin library, memoized by path, size, mtime and inode."""
    return memoized_by_file(path, memos, "sha256", lambda: _file_digest(path), is_key)


@functools.cache
def host_cpu_flags() -> tuple[str, ...]:
    """Returns the host's CPU model flags, sorted (what XLA:CPU compiles for).

    The key holds only their digest (host_cpu_features); entries record the
    flags themselves so that a miss can say which features a host lacks.
    """
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features", "isa"):
                    return tuple(sorted(value.split()))
    except OSError:
        return (host_platform.processor(),)
    return ()


@functools.cache
def host_cpu_features() -> str:
    """Returns a digest of the host's CPU model flags (what XLA:CPU compiles for)."""
    text = f"{host_platform.machine()}|{' '.join(host_cpu_flags())}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


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
) -> dict[str, Any]:
    """Returns the parts that identify an executable, as JSON-ready data.

    client_options are the plugin's client create options and environment
    the code-generation environment (codegen_environment) of the process.
    topology is what the executable is compiled for where the platform's
    executables are tied to a topology (TPU: worker.plugin.topology.key_part),
    the same whether compiled for a topology without a device or on the
    devices themselves; None leaves the part out (CPU and GPU keys).
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
    if platform == "cpu":
        parts["host"] = {"machine": host_platform.machine(), "cpu_features": host_cpu_features()}
    if topology is not None:
        parts["topology"] = topology
    return parts


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


class InvalidKeyError(ValueError):
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
                line = f"{name}: built with {theirs.get(name)!r}, here {mine.get(name)!r}"
                if name == "host.cpu_features" and cpu_flags:
                    line += _flag_difference(cpu_flags, host_cpu_flags())
                lines.append(line)
    return lines


def _flag_difference(built: list[str], here: tuple[str, ...]) -> str:
    lacks = sorted(set(built) - set(here))
    extra = sorted(set(here) - set(built))
    said = []
    if lacks:
        said.append(f"this host lacks {', '.join(lacks)}")
    if extra:
        said.append(f"has {', '.join(extra)}, which the builder had not")
    return f" ({'; '.join(said)})" if said else ""
