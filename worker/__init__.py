"""pjrt-pool, worker side: compile and run StableHLO on a PJRT plugin, without JAX.

Everything here runs in any process that holds a plugin: a pool worker, or
the user's own process for in-process use. It never imports JAX, so that a
worker starts in a fraction of a second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.exports import on_first_use

if TYPE_CHECKING:
    from worker.cache import CacheCounters, DiskCache, UntrustedCacheError, explain_key
    from worker.compiler import compile_program, program_key
    from worker.errors import (
        BundleError,
        NeverCompileError,
        NotInCacheError,
        PjrtError,
        PlatformMismatchError,
        PluginLoadError,
        PluginNotFoundError,
    )
    from worker.executable import Executable
    from worker.identity import compile_options
    from worker.kernels import FfiVersionError, MissingCustomCallError, register_custom_call
    from worker.plugins import PluginLocation, find_plugin
    from worker.records import ArrayType, CompileStatistics, LoweredProgram, ProgramSpec
    from worker.runtime import get_runtime, loaded_runtime
    from worker.stamp import ForeignExecutableError

_MODULES = {
    "CacheCounters": "worker.cache",
    "DiskCache": "worker.cache",
    "UntrustedCacheError": "worker.cache",
    "explain_key": "worker.cache",
    "compile_options": "worker.identity",
    "compile_program": "worker.compiler",
    "program_key": "worker.compiler",
    "BundleError": "worker.errors",
    "NeverCompileError": "worker.errors",
    "NotInCacheError": "worker.errors",
    "PjrtError": "worker.errors",
    "PlatformMismatchError": "worker.errors",
    "PluginLoadError": "worker.errors",
    "PluginNotFoundError": "worker.errors",
    "Executable": "worker.executable",
    "FfiVersionError": "worker.kernels",
    "MissingCustomCallError": "worker.kernels",
    "register_custom_call": "worker.kernels",
    "PluginLocation": "worker.plugins",
    "find_plugin": "worker.plugins",
    "ArrayType": "worker.records",
    "CompileStatistics": "worker.records",
    "LoweredProgram": "worker.records",
    "ProgramSpec": "worker.records",
    "get_runtime": "worker.runtime",
    "loaded_runtime": "worker.runtime",
    "ForeignExecutableError": "worker.stamp",
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
