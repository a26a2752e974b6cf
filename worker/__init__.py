"""pjrt-pool, worker side: compile and run StableHLO on a PJRT plugin, without JAX.

Everything here runs in any process that holds a plugin: a pool worker
(``python -m worker``), or the user's own process for in-process use. It
never imports JAX, so that a worker starts in a fraction of a second. Where
each thing lives, and so where plugin loading ends and serving begins::

    records.py, arguments.py, dtypes.py, errors.py, phases.py
                  the shared records: ArrayType, LoweredProgram, ProgramSpec,
                  CompileStatistics; converting arguments; the dtypes the runtime
                  takes; the errors; seconds per phase of compiles and start-ups
    untrusted.py  reading files someone else may have written: bounded, then parsed
    fds.py        closing file descriptors in cleanup
    log.py        loggers that import logging only when a message could be seen
    lazy_names.py package namespaces whose names import on first use
    identity/     what a cache key is made of: its parts, the code-generation environment,
                  host CPU features, compile options, a target's and a topology's part,
                  a plugin build's digest and the one memo of values computed from a file
    plugin/       the plugin: finding, loading (Runtime), XLA flags, FFI kernels,
                  device errors, known builds and check-plugin's records
    compile/      compile_program and the cache tiers it walks (the disk cache, a remote:
                  lookup, claim, publish), loading by key, never-compile mode,
                  Executable, what a compile is for, executable stamps, compile slots
    cache/        the shared disk cache of executables (DiskCache)
    bundle/       bundles: warmed programs in one file, checked and loaded read-only
    serve/        a pool worker: the wire protocol, shared memory, the worker's loop
    _pjrt         the native module (native/): plugins, clients, executables, the hot loop

identity/ uses none of the packages here (only untrusted.py), and the shared
records take the form of a key from it; cache/ uses identity/, plugin/ uses
identity/ and cache/ (records about plugin builds), compile/ uses plugin/,
cache/ and identity/, bundle/ uses compile/, and serve/ uses them all;
nothing uses serve/ but the worker's entry point and the parent, which
speaks its protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.lazy_names import on_first_use

if TYPE_CHECKING:
    from worker.cache import CacheCounters, DiskCache, UntrustedCacheError, explain_key
    from worker.compile.compiler import compile_program, program_key
    from worker.compile.executable import Executable
    from worker.compile.stamp import ForeignExecutableError
    from worker.errors import (
        BundleError,
        NeverCompileError,
        NotInCacheError,
        PjrtError,
        PlatformMismatchError,
        PluginLoadError,
        PluginNotFoundError,
    )
    from worker.identity.options import compile_options
    from worker.plugin.kernels import FfiVersionError, MissingCustomCallError, register_custom_call
    from worker.plugin.locate import PluginLocation, find_plugin
    from worker.plugin.runtime import get_runtime, loaded_runtime
    from worker.records import ArrayType, CompileStatistics, LoweredProgram, ProgramSpec

_MODULES = {
    "CacheCounters": "worker.cache",
    "DiskCache": "worker.cache",
    "UntrustedCacheError": "worker.cache",
    "explain_key": "worker.cache",
    "compile_options": "worker.identity.options",
    "compile_program": "worker.compile.compiler",
    "program_key": "worker.compile.compiler",
    "BundleError": "worker.errors",
    "NeverCompileError": "worker.errors",
    "NotInCacheError": "worker.errors",
    "PjrtError": "worker.errors",
    "PlatformMismatchError": "worker.errors",
    "PluginLoadError": "worker.errors",
    "PluginNotFoundError": "worker.errors",
    "Executable": "worker.compile.executable",
    "FfiVersionError": "worker.plugin.kernels",
    "MissingCustomCallError": "worker.plugin.kernels",
    "register_custom_call": "worker.plugin.kernels",
    "PluginLocation": "worker.plugin.locate",
    "find_plugin": "worker.plugin.locate",
    "ArrayType": "worker.records",
    "CompileStatistics": "worker.records",
    "LoweredProgram": "worker.records",
    "ProgramSpec": "worker.records",
    "get_runtime": "worker.plugin.runtime",
    "loaded_runtime": "worker.plugin.runtime",
    "ForeignExecutableError": "worker.compile.stamp",
}


# Lazy: Python runs this file before any worker module, so names imported
# here eagerly were paid for by every process that imports one of them: a
# job running a bundle or a manifest needs no compiler (with its compile
# slots, conformance records, known builds, tempfile and shutil: ~9 ms of
# imports). Each name is imported on first use instead
# (scripts/bench_cold_start.py measures the cold start).
__getattr__, __dir__ = on_first_use(__name__, _MODULES)

__all__ = [
    "ArrayType",
    "BundleError",
    "CacheCounters",
    "CompileStatistics",
    "DiskCache",
    "Executable",
    "FfiVersionError",
    "ForeignExecutableError",
    "LoweredProgram",
    "MissingCustomCallError",
    "NeverCompileError",
    "NotInCacheError",
    "PjrtError",
    "PlatformMismatchError",
    "PluginLoadError",
    "PluginLocation",
    "PluginNotFoundError",
    "ProgramSpec",
    "UntrustedCacheError",
    "compile_options",
    "compile_program",
    "explain_key",
    "find_plugin",
    "get_runtime",
    "loaded_runtime",
    "program_key",
    "register_custom_call",
]
