"""pjrt-pool: compile and run JAX programs in crash-isolated PJRT worker processes.

The parent side: ``lower`` turns JAX functions into LoweredPrograms; the
worker-side names (compile_program, Executable, ...) are re-exported so that
every name of the Programs API imports from here.
"""

from pool.errors import (
    PoolClosedError,
    PoolError,
    ProgramQuarantinedError,
    RemoteWorkerError,
    TaskTimeoutError,
    WorkerCrashedError,
    WorkerStartupError,
)
from pool.lowering import lower, lowering_platform
from pool.pool import Pool
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
    "Pool",
    "PoolClosedError",
    "PoolError",
    "ProgramQuarantinedError",
    "ProgramSpec",
    "RemoteWorkerError",
    "TaskTimeoutError",
    "WorkerCrashedError",
    "WorkerStartupError",
    "compile_options",
    "compile_program",
    "lower",
    "lowering_platform",
    "register_custom_call",
]
