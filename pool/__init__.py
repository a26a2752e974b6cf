"""pjrt-pool: compile and run JAX programs in crash-isolated PJRT worker processes.

The parent side, run in the user's process (it may import JAX): ``lower``
turns JAX functions into LoweredPrograms; the worker-side names
(compile_program, Executable, ...) are re-exported so that every name of the
Programs API imports from here. What the folders hold:

    face.py       Pool, the one users import, and PoolFace: what a Pool and a ClusterPool
                  both offer (compile, compile_many, map, function), written once
    executor/     the Pool's machinery (tasks, workers, manager thread, shared memory)
    lowering/     lower(), StableHLO for the plugin's window, Pool.function, save_inputs
    cluster/      compiling and running on a Dask or Ray cluster (ClusterPool, RayClusterPool)
    jax_cache/    JAX's own persistent cache, warmed and backed by pjrt-pool
    warm/         warm specs and warming the disk cache
    conformance/  the check-plugin battery
    cli/          the pjrt-pool command line, one module per command
    examples/     example programs: what the README and docs run (pool.examples:programs)
    manifest.py   running warmed programs by name (production jobs)
    errors.py, progress.py, spawn.py   the parent's errors, progress display, child processes
    remote_option.py   the remote cache tier as an option of Pool, ClusterPool, load_manifest

The floors, lowest first: a module imports only from its own floor and the
floors below it, and from worker (tests/test_structure.py checks it)::

    *.py < executor/ < lowering/ < face.py < cluster/ < jax_cache/ < warm/ < conformance/
        < cli/ < examples/

where *.py stands for the modules at the top (manifest.py, errors.py, ...).
The executor uses none of JAX; lowering/ adds it, with Pool.function;
face.py puts the two behind one Pool; cluster/ runs Pools on Dask's workers and Ray's nodes;
warming may use a cluster; the conformance battery and the command line use
what they need of the rest. The examples need only JAX and worker, and
nothing in pool imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.lazy_names import on_first_use

__version__ = "0.1.0"
"""pjrt-pool's version (the wheel's, which the build reads from here: pyproject.toml)."""

# Lazy: Python runs this file before any pool module, so whatever it
# imported eagerly every production job paid for when it imported
# pool.manifest: the Pool and its machinery (the wire protocol, subprocess,
# cloudpickle: ~36 ms of imports), and lower(), which imports JAX (about a
# second). Each name is imported on first use instead
# (benchmarks/bench_start.py measures a serving process's start). The block below is
# the one list of the names (worker.lazy_names reads it on first use).
if TYPE_CHECKING:
    from pool.cluster import ClusterPool as ClusterPool
    from pool.cluster import RayClusterPool as RayClusterPool
    from pool.errors import ConvertedInputWarning as ConvertedInputWarning
    from pool.errors import DeviceFailureError as DeviceFailureError
    from pool.errors import PoolClosedError as PoolClosedError
    from pool.errors import PoolError as PoolError
    from pool.errors import PoolForkedError as PoolForkedError
    from pool.errors import ProgramQuarantinedError as ProgramQuarantinedError
    from pool.errors import RemoteWorkerError as RemoteWorkerError
    from pool.errors import TaskTimeoutError as TaskTimeoutError
    from pool.errors import TracedPoolFunctionError as TracedPoolFunctionError
    from pool.errors import WorkerCrashedError as WorkerCrashedError
    from pool.errors import WorkerStartupError as WorkerStartupError
    from pool.errors import WorkerWarning as WorkerWarning
    from pool.executor.compile_many import CompileResult as CompileResult
    from pool.executor.options import DeviceStart as DeviceStart
    from pool.executor.values import DeviceValue as DeviceValue
    from pool.face import Pool as Pool
    from pool.lowering.inputs import save_inputs as save_inputs
    from pool.lowering.lower import lower as lower
    from pool.lowering.lower import lowering_platform as lowering_platform
    from worker import ArrayType as ArrayType
    from worker import CompileStatistics as CompileStatistics
    from worker import Executable as Executable
    from worker import FfiVersionError as FfiVersionError
    from worker import ForeignExecutableError as ForeignExecutableError
    from worker import LoweredProgram as LoweredProgram
    from worker import MissingCustomCallError as MissingCustomCallError
    from worker import MissingExtraError as MissingExtraError
    from worker import PjrtError as PjrtError
    from worker import PlatformMismatchError as PlatformMismatchError
    from worker import PluginLoadError as PluginLoadError
    from worker import PluginNotFoundError as PluginNotFoundError
    from worker import ProgramSpec as ProgramSpec
    from worker import UntrustedCacheError as UntrustedCacheError
    from worker import compile_options as compile_options
    from worker import compile_program as compile_program
    from worker import register_custom_call as register_custom_call
    from worker.errors import BundleError as BundleError
    from worker.errors import DeviceCountError as DeviceCountError
    from worker.errors import NeverCompileError as NeverCompileError
    from worker.errors import NotInCacheError as NotInCacheError
    from worker.errors import PjrtPoolError as PjrtPoolError
    from worker.identity.keys import InvalidKeyError as InvalidKeyError
    from worker.wire.protocol import DescriptorLimitError as DescriptorLimitError

__getattr__, __dir__ = on_first_use(__name__)
