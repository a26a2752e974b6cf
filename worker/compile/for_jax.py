"""Compiling a program for JAX's own persistent cache, in a worker (pool.jax_cache).

The program is the module and compile options JAX compiles; the executable is
made in the form JAX's cache keeps it (worker.plugin.jaxlib_compile: jaxlib's
own compilers) and filed, as JAX's value (worker.cache.jax_values), in the disk
cache and the remote tier under key parts naming JAX's key
(worker.cache.blobs): a value there already is used, not made again, and a miss
holds the key's lock and lease while it compiles, so a program is compiled once
on a host and in a fleet. What the caller gets back is the entry's record (a
ProgramSpec under the entry's own key, with no types: nothing here runs it).
"""

from __future__ import annotations

import os
import time
from typing import Any, Literal

from worker.cache.blobs import BlobStore
from worker.cache.jax_values import Compression, pack
from worker.cache.open_caches import open_cache
from worker.identity.keys import key_of
from worker.plugin.jaxlib_compile import compile_for_cpu, compile_for_topology
from worker.plugin.topology import TopologySpec
from worker.records import CompileStatistics, JaxCompile, LoweredProgram, ProgramSpec

JAX_KEY_PART = "jax_cache"
"""The part of an entry's key parts that names JAX's key."""


def entry_parts(jax_key: str) -> dict[str, Any]:
    """The key parts of the entry that holds JAX's value for a key."""
    return {JAX_KEY_PART: jax_key}


def compile_for_jax(
    program: LoweredProgram,
    request: JaxCompile,
    name: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    remote: str | Literal[False] | None = None,
    lock_timeout: float | None = None,
) -> tuple[ProgramSpec, CompileStatistics]:
    """Files JAX's value of a program under its JAX key (see the module): loaded when the
    disk cache or the remote has it, else compiled here. Raises what the compiler raises."""
    from worker.compile.tiers import open_remote

    started = time.perf_counter()
    store = BlobStore(open_cache(cache_dir), open_remote(remote), lock_timeout)
    parts = entry_parts(request.key)
    spec = ProgramSpec(name, str(program.platform), key_of(parts), None, (), ())
    if store.get(parts) is not None:
        return spec, CompileStatistics(load_seconds=time.perf_counter() - started, loaded=1)
    try:
        compiled = _compile(program, request)
        seconds = time.perf_counter() - started
        value = pack(compiled.serialized, seconds, Compression(request.compression))
        metadata = {
            "name": request.key.rpartition("-")[0],
            "made_by": "pjrt-pool warm",
            "target": request.target,
            "jax_parts": dict(request.parts),
            "compression": request.compression,
            "compile_seconds": seconds,
            "created": time.time(),
        }
    except BaseException:
        store.release(parts)
        raise
    store.put(parts, metadata, value)
    return spec, CompileStatistics(compile_seconds=seconds, compiled=1)


def _compile(program: LoweredProgram, request: JaxCompile) -> Any:
    options = program.compile_options
    if options is None:
        raise ValueError("a program for JAX's cache carries the compile options JAX uses")
    if request.topology is not None:
        spec = TopologySpec.from_json(request.topology)
        return compile_for_topology(str(program.platform), spec, program.code, options)
    if program.platform != "cpu":
        raise ValueError(
            f"JAX cache entries are made for the CPU and TPU topologies, not {program.platform}"
        )
    return compile_for_cpu(program.code, options, request.devices)
