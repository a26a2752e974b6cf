"""What the process's environment and host put into a key.

The code-generation environment is what the plugin reads from environment
variables when it loads (see codegen_environment): XLA_FLAGS, normalized
(parsed as XLA parses it, later flags overriding earlier ones, sorted, and
without the flags that only dump or log, which change no code), and the
thread-count variables PJRT_NPROC and NPROC, which change how XLA:CPU splits
loops into parallel tasks: both change the code a CPU plugin makes
(docs/facts.md, "The code-generation environment").

On CPU the host's CPU features count too: XLA:CPU compiles for the host's
instruction set, and a plugin refuses an executable built for other
features (host_cpu_features).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform as host_platform
from typing import Any

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
        # machine does not; it changes no executable (docs/facts.md, "TPU").
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


def codegen_environment(
    environ: dict[str, str] | None = None, flag_variables: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Returns the environment that changes what the plugin generates, for the key.

    Read when the plugin loads (runtime.py), since the plugin reads it then
    and never again: {"xla_flags": [...]} plus each thread-count variable that
    is set and, for each of the platform's own variables of XLA flags
    (flag_variables: TPU's LIBTPU_INIT_ARGS), its code flags, normalized as
    XLA_FLAGS are, under the variable's name in lower case, when it names
    any. Variables read at run time only (oneDNN's DNNL_MAX_CPU_ISA, the
    TF_CPP_* logging ones) are left out: they leave the serialized executable
    unchanged (docs/facts.md, "The code-generation environment").
    """
    env = os.environ if environ is None else environ
    found: dict[str, Any] = {"xla_flags": normalized_xla_flags(env.get(XLA_FLAGS_ENV))}
    for name in THREAD_ENV:
        if env.get(name):
            found[name] = env[name]
    for variable in flag_variables:
        flags = _code_flags(env.get(variable, ""))
        if flags:
            found[variable.lower()] = flags
    return found


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
