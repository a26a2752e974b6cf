"""compile_program: compile a LoweredProgram, or load it from the disk cache.

The protocol that makes one compile per key across processes::

    read entry (no lock) --hit--> deserialize --ok--> done
          | miss / corrupt / rejected / wrongly signed / crashed a loader / unreadable
          v
    take the key's lock (or time out and go on without it)
    read entry again --hit--> deserialize --ok--> done   (another process compiled it)
          | miss / bad (removed now, under the lock) / unreadable (left alone)
          v
    compile, publish atomically (not over an unreadable entry), release the lock

A corrupt or rejected entry, one that signing refuses, or one whose load
killed an earlier process (see cache/loads.py) is removed under the key's
lock, compiled again and republished; an entry that could not be read (an
I/O error says nothing about the entry) is reported and left alone. The
counters say what happened, a debug log line says why each miss happened,
and a warning tells of unreadable, wrongly signed and crashing entries.
Beyond a cache directory that others could write (UntrustedCacheError),
nothing here fails because of the cache: an unusable cache only means
compiling.
"""

from __future__ import annotations

import os
import time
from typing import Any, Literal

from worker.cache import DiskCache, key_of, open_cache, parse_size
from worker.cache import entry as entry_format
from worker.cache.remote import RemoteCache, open_remote
from worker.cache.signing import signer_from_environment
from worker.compile.by_key import Miss, load_entry, load_remote_entry, settle_miss
from worker.compile.executable import Executable
from worker.compile.never_compile import never_compile_on, refusal
from worker.compile.slots import compile_slot
from worker.compile.target import Target, target_for
from worker.identity.environment import host_cpu_flags
from worker.identity.options import checked_compile_options, options_or_default
from worker.identity.target import runtime_key_parts
from worker.log import get_logger
from worker.phases import Phases
from worker.plugin.conformance_records import warn_known_failures
from worker.plugin.runtime import Runtime, get_runtime
from worker.plugin.topology import TopologySpec
from worker.records import CompileStatistics, LoweredProgram, check_program, types_to_json

logger = get_logger("pjrt_pool.cache")


def _check_code(program: LoweredProgram) -> LoweredProgram:
    """Refuses a program without code or text (which compiling and its key need)."""
    if not isinstance(program.code, (bytes, bytearray)) or not program.code:
        raise ValueError("the program's code is empty or not bytes: lower the function again")
    if not isinstance(program.text, str) or not program.text:
        raise ValueError("the program's text is empty: it is needed for the cache key")
    return program


def program_key(
    program: LoweredProgram,
    runtime: Runtime,
    cache: DiskCache | None,
    options: bytes | None = None,
    target: Target | None = None,
) -> tuple[str, dict[str, Any]]:
    """Returns the cache key of a program on this process's plugin, and its parts.

    target is what it is compiled for (default: the runtime's device).
    """
    parts = runtime_key_parts(runtime, cache, program.text, options, target)
    return key_of(parts), parts


def cache_key_of(
    program: LoweredProgram,
    cache_dir: str | os.PathLike[str] | None = None,
    compile_options: bytes | None = None,
    *,
    topology: str | TopologySpec | None = None,
) -> str:
    """The cache key compile_program would give a program here, without loading or compiling
    it: the same plugin, host, topology and cache directory make the same key."""
    options = options_or_default(checked_compile_options(compile_options))
    cache = open_cache(cache_dir)
    runtime = get_runtime(program.platform, deviceless=topology is not None)
    target = target_for(runtime, topology)
    return program_key(program, runtime, cache if cache.usable else None, options, target)[0]


def _load(
    cache: DiskCache, key: str, program: LoweredProgram, target: Target
) -> tuple[Executable, None] | tuple[None, Miss]:
    """Loads a key's entry for a program: (executable, None) on a hit, else (None, why)."""
    loaded = load_entry(cache, key, target)
    if isinstance(loaded, Miss):
        return None, loaded
    executable = loaded[0]
    executable.input_types = program.input_types
    return executable, None


def _compile_and_publish(
    cache: DiskCache | None,
    key: str,
    parts: dict[str, Any],
    program: LoweredProgram,
    max_size: int | None,
    options: bytes,
    phases: Phases,
    target: Target,
    remote: RemoteCache | None = None,
) -> tuple[Executable, float]:
    waiting = time.perf_counter()
    try:
        with compile_slot(target.runtime.platform):
            start = time.perf_counter()
            phases.add("slot_wait", start - waiting)
            executable = target.compile(program.code, options)
            seconds = time.perf_counter() - start
    except BaseException:
        if remote is not None:  # hosts waiting on this process's lease compile themselves
            remote.release(key)
        raise
    phases.add("compile", seconds)
    executable.input_types = program.input_types
    executable.key = key
    local = cache is not None and cache.writable
    if local or (remote is not None and remote.state == "on"):
        metadata = {
            "name": program.name,
            "platform": program.platform,
            "input_types": types_to_json(program.input_types),
            "output_types": types_to_json(executable.output_types),
            "compile_seconds": seconds,
            "created": time.time(),
        }
        if target.topology is not None:
            metadata["topology"] = target.topology  # for people: the key holds what it is
        if target.runtime.platform == "cpu":
            # The key holds only their digest: with the flags, a miss elsewhere
            # can say which features that host lacks (worker.identity.keys.differing_parts).
            metadata["cpu_flags"] = list(host_cpu_flags())
        with phases.time("serialize"):
            payload = executable.serialize()
        signer = cache.signer if cache is not None else signer_from_environment()
        data = entry_format.encode(key, parts, metadata, payload, signer)
        with phases.time("publish"):
            if local:
                assert cache is not None
                cache.publish_file(key, data, max_size)
        if remote is not None:
            with phases.time("remote"):
                remote.publish(key, parts, data)
    return executable, seconds


def _from_remote(
    remote: RemoteCache | None,
    cache: DiskCache | None,
    key: str,
    program: LoweredProgram,
    phases: Phases,
    start: float,
    target: Target,
    lead: bool = True,
) -> tuple[Executable, CompileStatistics] | None:
    """A remote hit, loaded (through the local cache when there is one); None otherwise.

    lead: a miss takes the key's remote lease (this process compiles next),
    or waits for the host that holds it.
    """
    if remote is None:
        return None
    with phases.time("remote"):
        loaded = load_remote_entry(cache, remote, key, target, lead=lead)
    if loaded is None:
        return None
    executable = loaded[0]
    executable.input_types = program.input_types
    logger.debug("remote cache hit for %s (%s)", program.name, key)
    phases.record("compile", program=program.name, cache_key=key, outcome="fetched")
    return executable, CompileStatistics(load_seconds=time.perf_counter() - start, loaded=1)


def compile_program(
    program: LoweredProgram,
    disk_cache: bool = True,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    max_size: int | str | None = None,
    lock_timeout: float | None = None,
    compile_options: bytes | None = None,
    never_compile: bool | None = None,
    remote: str | Literal[False] | None = None,
    topology: str | TopologySpec | None = None,
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
    never_compile=True (default: PJRT_POOL_COMPILE=never in the environment)
    makes a program that is not in the cache raise NeverCompileError, a
    LookupError naming its key and how entries of it built elsewhere differ,
    instead of compiling (see worker.compile.never_compile).
    remote names a remote tier behind the disk cache (default:
    PJRT_POOL_CACHE_REMOTE; False: none), a URL such as s3://bucket/prefix:
    a local miss looks there, a verified remote entry is published into the
    local cache and loaded, and a compile is published there too (see
    worker.cache.remote); a failing remote only means compiling.
    topology compiles for a topology without its devices, named as the
    plugin takes it ("v5e:1x1", "v5e:2x2"; or a worker.plugin.topology.
    TopologySpec with create options): nothing opens a device, so it works on
    a machine without one and beside the process that holds the chip. The
    executable it returns serializes and is published as any other, and its
    run raises NotLoadedError; a process on devices of that topology then
    loads it from the cache without compiling (the key is the same on both
    sides: see worker.compile.target).
    ``worker.cache.open_cache(cache_dir).counters`` tells what the cache did,
    ``worker.cache.remote.open_remote(remote).counters`` what the remote did.
    A cache directory that someone other than this user (or, in a
    group-shared cache, its group) could write raises UntrustedCacheError;
    see worker.cache.trust, and worker.cache.signing for signed entries.
    """
    program = _check_code(check_program(program, "compile_program"))
    options = options_or_default(checked_compile_options(compile_options))
    bound = None if max_size is None else parse_size(max_size)
    never = never_compile_on(never_compile)
    tier = open_remote(remote)
    # The cache first: loading the plugin reads (and fills) the default cache's
    # records about plugin builds only if that cache exists (runtime._existing_memos).
    cache = open_cache(cache_dir) if disk_cache else None
    runtime = get_runtime(program.platform, deviceless=topology is not None)
    target = target_for(runtime, topology)
    warn_known_failures(runtime.location.path, cache_dir)
    if cache is not None and not cache.usable:
        cache = None
    phases = Phases()
    with phases.time("key"):
        key, parts = program_key(program, runtime, cache, options, target)
    if cache is None:
        fetched = _from_remote(
            tier, None, key, program, phases, time.perf_counter(), target, not never
        )
        if fetched is not None:
            return fetched
        if never:
            raise refusal(program.name, key, None, parts, remote=tier)
        logger.debug("compiling %s (%s) without the disk cache", program.name, key)
        executable, seconds = _compile_and_publish(
            None, key, parts, program, bound, options, phases, target, tier
        )
        phases.record("compile", program=program.name, cache_key=key, outcome="compiled")
        return executable, CompileStatistics(compile_seconds=seconds, compiled=1)

    start = time.perf_counter()
    with phases.time("lookup"):
        executable, miss = _load(cache, key, program, target)
    if executable is None and never:
        # No lock: waiting for another process's compile is what this mode forbids.
        assert miss is not None
        fetched = _from_remote(tier, cache, key, program, phases, start, target, lead=False)
        if fetched is not None:
            return fetched
        cache.count("misses")
        logger.debug("cache miss for %s (%s): %s; not compiling", program.name, key, miss.reason)
        reason = "" if miss.counter is None else miss.reason
        raise refusal(program.name, key, cache, parts, reason, remote=tier)
    if executable is None:
        waiting = time.perf_counter()
        with cache.lock(key, lock_timeout):
            phases.add("lock_wait", time.perf_counter() - waiting)
            # Judge the entry again under the lock: another process may have
            # published it while this one waited, or healed a bad one.
            with phases.time("lookup"):
                executable, miss = _load(cache, key, program, target)
            if miss is not None:
                settle_miss(cache, key, miss, program.name)
                fetched = _from_remote(tier, cache, key, program, phases, start, target)
                if fetched is not None:
                    return fetched
                cache.count("misses")
                executable, seconds = _compile_and_publish(
                    cache if miss.publish else None,
                    key,
                    parts,
                    program,
                    bound,
                    options,
                    phases,
                    target,
                    tier,
                )
                phases.record("compile", program=program.name, cache_key=key, outcome="compiled")
                return executable, CompileStatistics(compile_seconds=seconds, compiled=1)
    cache.count("hits")
    logger.debug("cache hit for %s (%s)", program.name, key)
    phases.record("compile", program=program.name, cache_key=key, outcome="loaded")
    return executable, CompileStatistics(load_seconds=time.perf_counter() - start, loaded=1)
