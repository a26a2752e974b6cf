"""pjrt-pool: compile and run JAX programs in crash-isolated PJRT worker processes.

The parent side, run in the user's process (it may import JAX): ``lower``
turns JAX functions into LoweredPrograms; the worker-side names
(compile_program, Executable, ...) are re-exported so that every name of the
Programs API imports from here. What the folders hold:

    executor/     the Pool and its machinery (tasks, workers, manager thread, shared memory)
    lowering/     lower(), StableHLO for the plugin's window, Pool.function
    warm/         warm specs and warming the disk cache
    cli/          the pjrt-pool command line, one module per command
    conformance/  the check-plugin battery
    manifest.py   running warmed programs by name (production jobs)
    cluster.py    compiling on a Dask cluster
    errors.py, progress.py, spawn.py   the parent's errors, progress display, child processes
"""

from pool.errors import (
    DeviceFailureError,
    PoolClosedError,
    PoolError,
    PoolForkedError,
    ProgramQuarantinedError,
    RemoteWorkerError,
    TaskTimeoutError,
    TracedPoolFunctionError,
    WorkerCrashedError,
    WorkerStartupError,
)
from pool.executor.compiling import CompileResult
from pool.executor.pool import Pool
from worker import (
    ArrayType,
    CompileStatistics,
    Executable,
    FfiVersionError,
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
from worker.cache.key import InvalidKeyError
from worker.protocol import DescriptorLimitError

_LAZY = {"lower": "pool.lowering.lower", "lowering_platform": "pool.lowering.lower"}


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
    "FfiVersionError",
    "ForeignExecutableError",
    "InvalidKeyError",
    "LoweredProgram",
    "MissingCustomCallError",
    "PjrtError",
    "PlatformMismatchError",
    "PluginLoadError",
    "PluginNotFoundError",
    "Pool",
    "PoolClosedError",
    "PoolError",
    "PoolForkedError",
    "ProgramQuarantinedError",
    "ProgramSpec",
    "RemoteWorkerError",
    "TaskTimeoutError",
    "TracedPoolFunctionError",
    "UntrustedCacheError",
    "WorkerCrashedError",
    "WorkerStartupError",
    "compile_options",
    "compile_program",
    "lower",
    "lowering_platform",
    "register_custom_call",
]
