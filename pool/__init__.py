"""pjrt-pool: compile and run JAX programs in crash-isolated PJRT worker processes.

The parent side: ``lower`` turns JAX functions into LoweredPrograms; the
worker-side names (compile_program, Executable, ...) are re-exported so that
every name of the Programs API imports from here.
"""

from pool.compiling import CompileResult
from pool.errors import (
    DeviceFailureError,
    PoolClosedError,
    PoolError,
    ProgramQuarantinedError,
    RemoteWorkerError,
    TaskTimeoutError,
    WorkerCrashedError,
    WorkerStartupError,
)
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
    UntrustedCacheError,
    compile_options,
    compile_program,
    register_custom_call,
)
from worker.protocol import DescriptorLimitError

_LAZY = {"lower": "pool.lowering", "lowering_platform": "pool.lowering"}


def __getattr__(name: str) -> object:
    # lower() needs JAX, whose import takes a second: load it on first use, so
    # that the pool, the CLI's cache commands and manifest runs start fast.
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pool' has no attribute {name!r}")


__all__ = [
    "ArrayType",
    "CompileResult",
    "CompileStatistics",
    "DescriptorLimitError",
    "DeviceFailureError",
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
    "UntrustedCacheError",
    "WorkerCrashedError",
    "WorkerStartupError",
    "compile_options",
    "compile_program",
    "lower",
    "lowering_platform",
    "register_custom_call",
]
