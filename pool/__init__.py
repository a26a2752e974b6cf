"""pjrt-pool: compile and run JAX programs in crash-isolated PJRT worker processes.

The parent side: ``lower`` turns JAX functions into LoweredPrograms; the
worker-side names (compile_program, Executable, ...) are re-exported so that
every name of the Programs API imports from here.
"""

from pool.lowering import lower, lowering_platform
from worker import (
    ArrayType,
    CompileStatistics,
    Executable,
    ForeignExecutableError,
    LoweredProgram,
    MissingCustomCallError,
    PjrtError,
    PlatformMismatchError,
    PluginLoadError,
    PluginNotFoundError,
    ProgramSpec,
    compile_options,
    compile_program,
    register_custom_call,
)

__all__ = [
    "ArrayType",
    "CompileStatistics",
    "Executable",
    "ForeignExecutableError",
    "LoweredProgram",
    "MissingCustomCallError",
    "PjrtError",
    "PlatformMismatchError",
    "PluginLoadError",
    "PluginNotFoundError",
    "ProgramSpec",
    "compile_options",
    "compile_program",
    "lower",
    "lowering_platform",
    "register_custom_call",
]
