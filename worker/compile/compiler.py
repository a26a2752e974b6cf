"""compile_program: compile a LoweredProgram, or load it from the disk cache (or a remote).

The protocol that makes one compile per key across processes, as a walk of
the tiers (tiers.py: the disk cache, then a remote)::

    each tier in turn: look the key up (no lock) --hit--> load --ok--> done
          | miss / corrupt / rejected / wrongly signed / crashed a loader / unreadable
          v
    take the tier's claim: the disk cache's lock (or time out and go on without
    it), the remote's lease (or wait for the host that holds it)
    look again --hit--> load --ok--> done   (another process compiled it)
          | miss / bad (removed now, under the lock) / unreadable (left alone)
          v
    the next tier; after the last: compile, publish to each tier (not over an
    unreadable entry), release the claims

A corrupt or rejected entry, one that signing refuses, or one whose load
killed an earlier process (see cache/loads.py) is removed under the key's
lock, compiled again and republished; an entry that could not be read (an
I/O error says nothing about the entry) is reported and left alone. The
counters say what happened, a debug log line says why each miss happened,
and a warning tells of unreadable, wrongly signed and crashing entries.
Beyond a cache directory that others could write (UntrustedCacheError),
nothing here fails because of the cache: an unusable cache only means
compiling. In never-compile mode each tier is only looked in: no claim is
taken, since waiting for another process's compile is what that mode forbids.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from worker.cache import DiskCache, key_of, open_cache, parse_size
from worker.cache.location import resolve_cache_dir
from worker.compile.executable import Executable
from worker.compile.never_compile import never_compile_on, refusal
from worker.compile.slots import compile_slot
from worker.compile.target import MadeFor, Target, target_for
from worker.compile.tiers import Loading, NewEntry, Tier, Tiers, open_remote, open_tiers
from worker.identity.environment import host_cpu_flags
from worker.identity.keys import PlatformPart
from worker.identity.options import checked_compile_options
from worker.identity.target import runtime_key_parts
from worker.log import get_logger
from worker.partitioning import compile_options_for
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

    options are the serialized compile options (default: those compile_program uses,
    worker.partitioning.compile_options_for); target is what it is compiled for
    (default: the runtime's device).
    """
    options = compile_options_for(program, options)
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
    options = compile_options_for(program, checked_compile_options(compile_options))
    cache = open_cache(cache_dir)
    runtime = get_runtime(program.platform, deviceless=topology is not None)
    target = target_for(runtime, topology)
    return program_key(program, runtime, cache if cache.usable else None, options, target)[0]


class _Job(NamedTuple):
    """One compile_program call, once its key is known."""

    program: LoweredProgram
    key: str
    parts: dict[str, Any]
    options: bytes
    target: Target
    tiers: Tiers
    phases: Phases
    start: float
    """When the lookups began: a load's seconds count from here."""
    name: str | None = None
    """The name its caller gives the program (compile_program's name), if not its module's."""

    def loaded(self, executable: Executable, tier: Tier) -> tuple[Executable, CompileStatistics]:
        """Records a load from a tier; returns the executable and its statistics."""
        self.phases.record(
            "compile", program=self.program.name, cache_key=self.key, outcome=tier.outcome
        )
        seconds = time.perf_counter() - self.start
        return executable, CompileStatistics(load_seconds=seconds, loaded=1)


def _load_or_compile(job: _Job, tiers: Sequence[Tier]) -> tuple[Executable, CompileStatistics]:
    """Looks the key up in the first tier; on a miss, holds that tier's claim while the rest
    are walked, and compiles when none has the key (see the module)."""
    if not tiers:
        job.tiers.missed()
        return _compile_and_publish(job)
    executable = tiers[0].lookup(job.key)
    if executable is None:
        with tiers[0].claim(job.key) as executable:
            if executable is None:
                return _load_or_compile(job, tiers[1:])
    return job.loaded(executable, tiers[0])


def _load_only(job: _Job) -> tuple[Executable, CompileStatistics]:
    """Never-compile mode: each tier looked in, none claimed; raises NeverCompileError when
    none has the key."""
    for tier in job.tiers.order:
        executable = tier.lookup(job.key)
        if executable is not None:
            return job.loaded(executable, tier)
    job.tiers.missed()
    disk, remote = job.tiers
    miss = None if disk is None else disk.miss
    if miss is not None:
        logger.debug(
            "cache miss for %s (%s): %s; not compiling", job.program.name, job.key, miss.reason
        )
    reason = "" if miss is None or miss.counter is None else miss.reason
    raise refusal(
        job.program.name,
        job.key,
        None if disk is None else disk.cache,
        job.parts,
        reason,
        remote=None if remote is None else remote.remote,
    )


def _compile_and_publish(job: _Job) -> tuple[Executable, CompileStatistics]:
    """Compiles in a compile slot, then publishes to each tier that takes the entry."""
    program, target, phases = job.program, job.target, job.phases
    if job.tiers.disk is None:
        logger.debug("compiling %s (%s) without the disk cache", program.name, job.key)
    waiting = time.perf_counter()
    with compile_slot(target.runtime.platform):
        start = time.perf_counter()
        phases.add("slot_wait", start - waiting)
        made_for = MadeFor(job.key, program.input_types, program.partitioning)
        executable = target.compile(program.code, job.options, made_for)
        seconds = time.perf_counter() - start
    phases.add("compile", seconds)
    metadata = _metadata(program, executable, seconds, target, job.name)
    entry = NewEntry(job.key, job.parts, metadata, executable, job.tiers.signer, phases)
    for tier in job.tiers.order:
        tier.publish(entry)
    phases.record("compile", program=program.name, cache_key=job.key, outcome="compiled")
    return executable, CompileStatistics(compile_seconds=seconds, compiled=1)


def _metadata(
    program: LoweredProgram,
    executable: Executable,
    seconds: float,
    target: Target,
    given_name: str | None,
) -> dict[str, Any]:
    """What an entry records beside its key parts, for people and for loading by key."""
    metadata: dict[str, Any] = {
        "name": program.name,
        "platform": program.platform,
        "input_types": types_to_json(program.input_types),
        "output_types": types_to_json(executable.output_types),
        "compile_seconds": seconds,
        "created": time.time(),
    }
    if given_name is not None and given_name != program.name:
        # The name its caller knows it by (a spec's, a manifest's): cache explain finds the
        # entries of a program of that name, whose module names (jit__lambda) say little.
        metadata["given_name"] = given_name
    if program.partitioning is not None:
        # What a load by key alone (a manifest, a bundle, a preload) runs it with.
        metadata["partitioning"] = program.partitioning.to_json()
    if target.topology is not None:
        metadata["topology"] = target.topology  # for people: the key holds what it is
    if PlatformPart.HOST in target.runtime.platform_parts:
        # The key holds only their digest: with the flags, a miss elsewhere
        # can say which features that host lacks (worker.identity.keys.differing_parts).
        metadata["cpu_flags"] = list(host_cpu_flags())
    return metadata


def _open(
    program: LoweredProgram,
    disk_cache: bool,
    directory: Path,
    topology: str | TopologySpec | None,
) -> tuple[DiskCache | None, Target]:
    """The disk cache a compile uses (None: none, or one that cannot be used) and its target,
    loading the plugin if none is loaded (compile_program then warns of known failures, in
    its own frame: the warning names the line that called it)."""
    # The cache first: loading the plugin reads (and fills) the default cache's
    # records about plugin builds only if that cache exists (runtime._existing_memos).
    cache = open_cache(directory) if disk_cache else None
    runtime = get_runtime(program.platform, deviceless=topology is not None)
    target = target_for(runtime, topology)
    return (cache if cache is not None and cache.usable else None), target


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
    name: str | None = None,
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
    name is what the caller calls the program (a warm spec's name for it):
    an entry it compiles records it, beside its module's name, so that
    ``pjrt-pool cache explain`` can find the entries of a program of that
    name (it is not part of the key).
    ``worker.cache.open_cache(cache_dir).counters`` tells what the cache did,
    ``worker.cache.remote.open_remote(remote).counters`` what the remote did.
    A cache directory that someone other than this user (or, in a
    group-shared cache, its group) could write raises UntrustedCacheError;
    see worker.cache.trust, and worker.cache.signing for signed entries.
    """
    program = _check_code(check_program(program, "compile_program"))
    options = compile_options_for(program, checked_compile_options(compile_options))
    bound = None if max_size is None else parse_size(max_size)
    never = never_compile_on(never_compile)
    remote_cache = open_remote(remote)
    directory = resolve_cache_dir(cache_dir)  # once: what follows is given the directory
    cache, target = _open(program, disk_cache, directory, topology)
    warn_known_failures(target.runtime.location.path, directory)  # attributed to our caller
    phases = Phases()
    with phases.time("key"):
        key, parts = program_key(program, target.runtime, cache, options, target)
    target.check_devices(program.partitioning)
    loading = Loading(program.name, program.input_types, target, phases)
    tiers = open_tiers(cache, remote_cache, loading, lock_timeout, bound)
    job = _Job(program, key, parts, options, target, tiers, phases, time.perf_counter(), name)
    return _load_only(job) if never else _load_or_compile(job, tiers.order)
