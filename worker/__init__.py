"""pjrt-pool, worker side: compile and run StableHLO on a PJRT plugin, without JAX.

Everything here runs in any process that holds a plugin: a pool worker, or
the user's own process for in-process use. It never imports JAX, so that a
worker starts in a fraction of a second.
"""

from worker.cache import CacheCounters, DiskCache, UntrustedCacheError, explain_key
from worker.compiler import compile_options, compile_program, program_key
from worker.errors import (
    PjrtError,
    PlatformMismatchError,
    PluginLoadError,
    PluginNotFoundError,
)
from worker.executable import Executable
from worker.kernels import FfiVersionError, MissingCustomCallError, register_custom_call
from worker.plugins import PluginLocation, find_plugin
from worker.records import ArrayType, CompileStatistics, LoweredProgram, ProgramSpec
from worker.runtime import get_runtime, loaded_runtime
from worker.stamp import ForeignExecutableError

__all__ = [
    "ArrayType",
    "CacheCounters",
    "CompileStatistics",
    "DiskCache",
    "Executable",
    "FfiVersionError",
    "ForeignExecutableError",
    "LoweredProgram",
    "MissingCustomCallError",
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
