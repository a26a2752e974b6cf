"""compile_program: compile a LoweredProgram, or load it from the disk cache.

The protocol that makes one compile per key across processes::

    read entry (no lock) --hit--> deserialize --ok--> done
          | miss / corrupt / rejected
          v
    take the key's lock (or time out and go on without it)
    read entry again --hit--> deserialize --ok--> done   (another process compiled it)
          | miss / corrupt / rejected (removed now, under the lock)
          v
    compile, publish atomically, release the lock

A corrupt or rejected entry is removed under the key's lock, compiled again
and republished; the counters say so, and a debug log line says why each miss
happened. Nothing here ever fails because of the cache: an unusable cache only
means compiling.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, NamedTuple

from worker.cache import CorruptEntryError, DiskCache, key_of, key_parts, open_cache, parse_size
from worker.cache.key import plugin_digest
from worker.conformance_memo import warn_known_failures
from worker.errors import PjrtError
from worker.executable import Executable
from worker.records import CompileStatistics, LoweredProgram, types_to_json
from worker.runtime import Runtime, get_runtime

logger = logging.getLogger("pjrt_pool.cache")


@functools.cache
def compile_options() -> bytes:
    """Returns the serialized CompileOptionsProto for one replica and one partition."""
    # executable_build_options (field 3) { num_replicas (4): 1, num_partitions (5): 1 }
    return bytes.fromhex("1a0420012801")


_default_options = compile_options  # compile_program's keyword shadows the name


def _check_program(program: Any) -> LoweredProgram:
    if not isinstance(program, LoweredProgram):
        kind = type(program).__name__
        raise TypeError(f"compile_program takes a LoweredProgram (from pool.lower), not {kind}")
    if not isinstance(program.code, (bytes, bytearray)) or not program.code:
        raise ValueError("the program's code is empty or not bytes: lower the function again")
    if not isinstance(program.text, str) or not program.text:
        raise ValueError("the program's text is empty: it is needed for the cache key")
    return program


def runtime_key_parts(
    runtime: Runtime, cache: DiskCache | None, text: str = "", options: bytes | None = None
) -> dict[str, Any]:
    """Returns the key parts of a program text on this process's plugin and host.

    With the default empty text, what is left describes the runtime alone
    (plugin build, options, host), to compare with an entry's parts. options
    are the serialized compile options (default: compile_options()).
    """
    client = runtime.client
    return key_parts(
        text=text,
        platform=runtime.platform,
        plugin_sha256=plugin_digest(runtime.location.path, cache.plugins_dir if cache else None),
        api_version=runtime.api_version,
        platform_version=client.platform_version,
        device_kind=client.device_kind,
        compile_options=compile_options() if options is None else options,
    )


def program_key(
    program: LoweredProgram,
    runtime: Runtime,
    cache: DiskCache | None,
    options: bytes | None = None,
) -> tuple[str, dict[str, Any]]:
    """Returns the cache key of a program on this process's plugin, and its parts."""
    parts = runtime_key_parts(runtime, cache, program.text, options)
    return key_of(parts), parts


class _Miss(NamedTuple):
    reason: str  # for the debug log: why there was no executable
    bad: bool  # the entry exists but is corrupt or rejected: remove it
    stat: os.stat_result | None  # the file judged bad, to remove exactly that one


def _load(
    cache: DiskCache, key: str, program: LoweredProgram
) -> tuple[Executable, None] | tuple[None, _Miss]:
    """Reads and deserializes a key's entry: (executable, None) on a hit, else (None, why)."""
    try:
        found = cache.read(key)
    except CorruptEntryError as error:
        return None, _Miss(f"corrupt entry ({error})", True, error.stat)
    if found is None:
        return None, _Miss("no entry", False, None)
    entry, stat = found
    try:
        executable = Executable.deserialize(entry.payload)
    except (PjrtError, ValueError) as error:
        # ValueError: ForeignExecutableError (another build's stamp) or empty bytes.
        return None, _Miss(f"the plugin rejected the entry ({error})", True, stat)
    executable.input_types = program.input_types
    executable.key = key
    return executable, None


def _compile_and_publish(
    cache: DiskCache | None,
    key: str,
    parts: dict[str, Any],
    program: LoweredProgram,
    max_size: int | None,
    options: bytes,
) -> tuple[Executable, float]:
    start = time.perf_counter()
    executable = Executable.compile(program.code, options)
    seconds = time.perf_counter() - start
    executable.input_types = program.input_types
    executable.key = key
    if cache is not None and cache.writable:
        metadata = {
            "name": program.name,
            "platform": program.platform,
            "input_types": types_to_json(program.input_types),
            "output_types": types_to_json(executable.output_types),
            "compile_seconds": seconds,
            "created": time.time(),
        }
        cache.publish(key, parts, metadata, executable.serialize(), max_size)
    return executable, seconds


def compile_program(
    program: LoweredProgram,
    disk_cache: bool = True,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    max_size: int | str | None = None,
    lock_timeout: float | None = None,
    compile_options: bytes | None = None,
) -> tuple[Executable, CompileStatistics]:
    """Compiles a program, or loads its executable from the disk cache.

    The plugin for the platform of the program loads first, unless a plugin is
    loaded already. A cached executable that the plugin rejects is removed and
    compiled again. The executable takes the argument types of the program, so
    Executable.run converts its arguments to them.

    cache_dir names the cache directory (default: PJRT_POOL_CACHE_DIR, else
    the user cache directory). Concurrent calls for one program, in any
    processes sharing the directory, compile it once; the others wait for it
    and load it. max_size bounds the cache when this call stores an entry
    (bytes or "2G"; default PJRT_POOL_CACHE_MAX_SIZE, else 4 GiB).
    lock_timeout is how many seconds to wait for another process's compile of
    the same program before compiling anyway (default 600). compile_options
    replaces the default serialized CompileOptionsProto (and is part of the
    cache key); the plugin checks it, and malformed options can make it abort
    the process, which is why a Pool compiles in worker processes.
    ``worker.cache.open_cache(cache_dir).counters`` tells what the cache did.
    """
    program = _check_program(program)
    if compile_options is None:
        options = _default_options()
    elif isinstance(compile_options, bytes):
        options = compile_options
    else:
        raise TypeError("compile_options must be bytes (a serialized CompileOptionsProto)")
    bound = None if max_size is None else parse_size(max_size)
    runtime = get_runtime(program.platform)
    warn_known_failures(runtime.location.path, cache_dir)
    cache = open_cache(cache_dir) if disk_cache else None
    if cache is not None and not cache.usable:
        cache = None
    key, parts = program_key(program, runtime, cache, options)
    if cache is None:
        logger.debug("compiling %s (%s) without the disk cache", program.name, key)
        executable, seconds = _compile_and_publish(None, key, parts, program, bound, options)
        return executable, CompileStatistics(compile_seconds=seconds, compiled=1)

    start = time.perf_counter()
    executable, _ = _load(cache, key, program)
    if executable is None:
        with cache.lock(key, lock_timeout):
            # Judge the entry again under the lock: another process may have
            # published it while this one waited, or healed a bad one.
            executable, miss = _load(cache, key, program)
            if miss is not None:
                cache.count("misses")
                logger.debug("cache miss for %s (%s): %s", program.name, key, miss.reason)
                if miss.bad:
                    cache.count("corrupt")
                    if cache.remove_if_unchanged(key, miss.stat):
                        logger.debug("removed the bad entry %s", key)
                executable, seconds = _compile_and_publish(
                    cache, key, parts, program, bound, options
                )
                return executable, CompileStatistics(compile_seconds=seconds, compiled=1)
    cache.count("hits")
    logger.debug("cache hit for %s (%s)", program.name, key)
    return executable, CompileStatistics(load_seconds=time.perf_counter() - start, loaded=1)
