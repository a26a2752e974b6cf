"""compile_program: compile a LoweredProgram, or load it from the disk cache.

The protocol that makes one compile per key across processes::

    read entry (no lock) --hit--> deserialize --ok--> done
          | miss / corrupt / rejected
          v
    take the key's lock (or time out and go on without it)
    read entry again --hit--> deserialize --ok--> done   (another process compiled it)
          | miss / corrupt (removed now, under the lock)
          v
    compile, publish atomically, release the lock

A corrupt or rejected entry is removed under the key's lock, compiled again
and republished; the counters say so. Nothing here ever fails because of the
cache: an unusable cache only means compiling.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, NamedTuple

from worker.cache import CorruptEntryError, DiskCache, key_of, key_parts, open_cache
from worker.cache.key import plugin_digest
from worker.errors import PjrtError
from worker.executable import Executable
from worker.records import CompileStatistics, LoweredProgram
from worker.runtime import Runtime, get_runtime

logger = logging.getLogger("pjrt_pool.cache")


@functools.cache
def compile_options() -> bytes:
    """Returns the serialized CompileOptionsProto for one replica and one partition."""
    # executable_build_options (field 3) { num_replicas (4): 1, num_partitions (5): 1 }
    return bytes.fromhex("1a0420012801")


def _check_program(program: Any) -> LoweredProgram:
    if not isinstance(program, LoweredProgram):
        kind = type(program).__name__
        raise TypeError(f"compile_program takes a LoweredProgram (from pool.lower), not {kind}")
    if not isinstance(program.code, (bytes, bytearray)) or not program.code:
        raise ValueError("the program's code is empty or not bytes: lower the function again")
    if not isinstance(program.text, str) or not program.text:
        raise ValueError("the program's text is empty: it is needed for the cache key")
    return program


def program_key(
    program: LoweredProgram, runtime: Runtime, cache: DiskCache | None
) -> tuple[str, dict[str, Any]]:
    """Returns the cache key of a program on this process's plugin, and its parts."""
    client = runtime.client
    parts = key_parts(
        text=program.text,
        platform=runtime.platform,
        plugin_sha256=plugin_digest(runtime.location.path, cache.plugins_dir if cache else None),
        api_version=runtime.api_version,
        platform_version=client.platform_version,
        device_kind=client.device_kind,
        compile_options=compile_options(),
    )
    return key_of(parts), parts


class _BadEntry(NamedTuple):
    reason: str  # "corrupt" or "rejected by the plugin"
    detail: str
    stat: os.stat_result | None  # the file judged bad, to remove exactly that one


def _load(
    cache: DiskCache, key: str, program: LoweredProgram
) -> tuple[Executable | None, _BadEntry | None]:
    """Reads and deserializes a key's entry: (executable, None) on a hit, else (None, why).

    `why` is None for a plain miss, or the bad file (corrupt, or rejected by
    the plugin), which the caller removes under the key's lock.
    """
    try:
        found = cache.read(key)
    except CorruptEntryError as error:
        logger.debug("cache miss for %s: corrupt entry (%s)", key, error)
        return None, _BadEntry("corrupt", str(error), error.stat)
    if found is None:
        logger.debug("cache miss for %s: no entry", key)
        return None, None
    entry, stat = found
    try:
        executable = Executable.deserialize(entry.payload)
    except PjrtError as error:
        logger.debug("cache miss for %s: the plugin rejected the entry (%s)", key, error)
        return None, _BadEntry("rejected by the plugin", str(error), stat)
    executable.input_types = program.input_types
    executable.key = key
    return executable, None


def _compile_and_publish(
    cache: DiskCache | None, key: str, parts: dict[str, Any], program: LoweredProgram
) -> tuple[Executable, float]:
    start = time.perf_counter()
    executable = Executable.compile(program.code, compile_options())
    seconds = time.perf_counter() - start
    executable.input_types = program.input_types
    executable.key = key
    if cache is not None and cache.writable:
        metadata = {
            "name": program.name,
            "platform": program.platform,
            "input_types": None
            if program.input_types is None
            else [t.to_json() for t in program.input_types],
            "output_types": [t.to_json() for t in executable.output_types],
            "compile_seconds": seconds,
            "created": time.time(),
        }
        cache.publish(key, parts, metadata, executable.serialize())
    return executable, seconds


def compile_program(
    program: LoweredProgram,
    disk_cache: bool = True,
    *,
    cache_dir: str | None = None,
) -> tuple[Executable, CompileStatistics]:
    """Compiles a program, or loads its executable from the disk cache.

    The plugin for the platform of the program loads first, unless a plugin is
    loaded already. A cached executable that the plugin rejects is removed and
    compiled again. The executable takes the argument types of the program, so
    Executable.run converts its arguments to them.

    cache_dir names the cache directory (default: PJRT_POOL_CACHE_DIR, else
    the user cache directory). Concurrent calls for one program, in any
    processes sharing the directory, compile it once; the others load it.
    """
    program = _check_program(program)
    runtime = get_runtime(program.platform)
    cache = open_cache(cache_dir) if disk_cache else None
    if cache is not None and not cache.usable:
        cache = None
    key, parts = program_key(program, runtime, cache)
    if cache is None:
        executable, seconds = _compile_and_publish(None, key, parts, program)
        return executable, CompileStatistics(compile_seconds=seconds, compiled=1)

    start = time.perf_counter()
    executable, _ = _load(cache, key, program)
    if executable is None:
        with cache.lock(key):
            # Judge the entry again under the lock: another process may have
            # published it while this one waited, or healed a bad one.
            executable, bad = _load(cache, key, program)
            if executable is None:
                cache.count("misses")
                if bad is not None:
                    cache.count("corrupt")
                    if cache.remove_if_unchanged(key, bad.stat):
                        logger.debug("removed entry %s, %s: %s", key, bad.reason, bad.detail)
                executable, seconds = _compile_and_publish(cache, key, parts, program)
                return executable, CompileStatistics(compile_seconds=seconds, compiled=1)
    cache.count("hits")
    return executable, CompileStatistics(load_seconds=time.perf_counter() - start, loaded=1)
