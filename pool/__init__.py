"""pjrt-pool: compile and run JAX programs in crash-isolated PJRT worker processes.

The parent side, run in the user's process (it may import JAX): ``lower``
turns JAX functions into LoweredPrograms; the worker-side names
(compile_program, Executable, ...) are re-exported so that every name of the
Programs API imports from here. What the folders hold:

    executor/     the Pool and its machinery (tasks, workers, manager thread, shared memory)
    lowering/     lower(), StableHLO for the plugin's window, Pool.function, save_inputs
    cluster/      compiling and running on a Dask cluster (ClusterPool)
    warm/         warm specs and warming the disk cache
    conformance/  the check-plugin battery
    cli/          the pjrt-pool command line, one module per command
    manifest.py   running warmed programs by name (production jobs)
    errors.py, progress.py, spawn.py   the parent's errors, progress display, child processes
    remote_option.py   the remote cache tier as an option of Pool, ClusterPool, load_manifest

The floors, lowest first: a module imports only from its own floor and the
floors below it, and from worker (tests/test_structure.py checks it)::

    *.py < executor/ < lowering/ < cluster/ < warm/ < conformance/ < cli/

where *.py stands for the modules at the top (manifest.py, errors.py, ...).
The executor uses none of JAX; lowering/ adds it, with Pool.function;
cluster/ runs Pools on Dask's workers; warming may use a cluster; the
conformance battery and the command line use what they need of the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.lazy_names import on_first_use

if TYPE_CHECKING:
    from pool.cluster import ClusterPool
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
    from pool.executor.compile_many import CompileResult
    from pool.lowering.inputs import save_inputs
    from pool.lowering.lower import lower, lowering_platform
    from pool.lowering.pool import Pool
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
    from worker.errors import BundleError, NeverCompileError, NotInCacheError
    from worker.identity.keys import InvalidKeyError
    from worker.wire.protocol import DescriptorLimitError

_ERRORS = (
    "DeviceFailureError",
    "PoolClosedError",
    "PoolError",
    "PoolForkedError",
    "ProgramQuarantinedError",
    "RemoteWorkerError",
    "TaskTimeoutError",
    "TracedPoolFunctionError",
    "WorkerCrashedError",
    "WorkerStartupError",
)
_WORKER = (
    "ArrayType",
    "CompileStatistics",
    "Executable",
    "FfiVersionError",
    "ForeignExecutableError",
    "LoweredProgram",
    "MissingCustomCallError",
    "PjrtError",
    "PlatformMismatchError",
    "PluginLoadError",
    "PluginNotFoundError",
    "ProgramSpec",
    "UntrustedCacheError",
    "compile_options",
    "compile_program",
    "register_custom_call",
)
_MODULES = {
    **dict.fromkeys(_ERRORS, "pool.errors"),
    **dict.fromkeys(_WORKER, "worker"),
    "ClusterPool": "pool.cluster",
    "CompileResult": "pool.executor.compile_many",
    "Pool": "pool.lowering.pool",
    "lower": "pool.lowering.lower",
    "lowering_platform": "pool.lowering.lower",
    "save_inputs": "pool.lowering.inputs",
    "BundleError": "worker.errors",
    "NeverCompileError": "worker.errors",
    "NotInCacheError": "worker.errors",
    "DescriptorLimitError": "worker.wire.protocol",
    "InvalidKeyError": "worker.identity.keys",
}


# Lazy: Python runs this file before any pool module, so whatever it
# imported eagerly every production job paid for when it imported
# pool.manifest: the Pool and its machinery (the wire protocol, subprocess,
# cloudpickle: ~36 ms of imports), and lower(), which imports JAX (about a
# second). Each name is imported on first use instead
# (scripts/bench_cold_start.py measures the cold start).
__getattr__, __dir__ = on_first_use(__name__, _MODULES)

__all__ = [
    "ArrayType",
    "BundleError",
    "ClusterPool",
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
    "NeverCompileError",
    "NotInCacheError",
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
    "save_inputs",
]
