"""pjrt-pool, worker side: compile and run StableHLO on a PJRT plugin, without JAX.

Everything here runs in any process that holds a plugin: a pool worker
(``python -m worker``), or the user's own process for in-process use. It
never imports JAX (only jaxlib, for the CPU's runtime: plugin/jaxlib_cpu/), so that
a worker starts in a fraction of a second. Where
each thing lives, and so where plugin loading ends and serving begins::

    records.py, partitioning.py, dtypes.py, errors.py, phases.py
                  the shared records: ArrayType, LoweredProgram, ProgramSpec,
                  CompileStatistics; a sharded program's Partitioning; the dtypes
                  the runtime takes; the errors (PjrtPoolError, the base of every
                  error pjrt-pool raises); seconds per phase of compiles and start-ups
    untrusted.py  reading files someone else may have written: bounded, then parsed
    extras.py     pjrt-pool's optional extras: the package each feature needs, the one
                  error for a missing one (MissingExtraError), where to install it from
    words.py      counts in messages, their nouns agreeing
    log.py        loggers that import logging only when a message could be seen
    lazy_names.py package namespaces whose names import on first use
    identity/     what a cache key is made of: its parts, the code-generation environment,
                  host CPU features, compile options, a target's and a topology's part,
                  a plugin build's digest and the one memo of values computed from a file
    wire/         the wire between the parent and a pool worker: frames, shared memory,
                  closing the descriptors they pass
    cache/        the shared disk cache of executables (DiskCache); cache/remote/ its remote tier
    plugin/       the plugin: the platforms (one module each), finding, loading (Runtime),
                  jaxlib's own CPU client as a runtime, XLA flags, FFI kernels, device
                  errors, known builds and check-plugin's records
    compile/      compile_program and the cache tiers it walks (the disk cache, a remote:
                  lookup, claim, publish), loading by key, never-compile mode,
                  Executable and converting its arguments, what a compile is for,
                  executable stamps, compile slots
    bundle/       bundles: warmed programs in one file, checked and loaded read-only
    serve/        the child programs that use a plugin: a pool worker's loop, the entry check
    __main__.py   ``python -m worker``: a pool worker (serve/start.py, serve/server.py)
    _pjrt         the native module (built from ``native/``): plugins, clients, executables,
                  the hot loop

The floors, lowest first: a module imports only from its own floor and the
floors below it (tests/test_structure.py checks it, and that nothing here
imports the parent's package, pool, or JAX)::

    errors.py < untrusted.py < identity/ < *.py < wire/ < cache/ < plugin/ < compile/ <
        bundle/ < serve/

where *.py stands for the other modules at the top (the shared records and
the helpers above) and _pjrt. errors.py imports nothing here (the native
module takes its classes from it); identity/ uses none of the packages here
(only errors.py and untrusted.py), and the shared records take the form of a
key from it; the
wire uses only the records; cache/ uses identity/, plugin/ uses identity/
and cache/ (records about plugin builds), compile/ uses plugin/, cache/ and
identity/, bundle/ uses compile/, and serve/ uses them all. Nothing imports
serve/ but the entry point (__main__.py) and, for a pool worker's command
line (serve/command_line.py), the parent that spawns it; nothing imports the
package itself (this file, which only names what the floors hold).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.lazy_names import on_first_use

# Lazy: Python runs this file before any worker module, so names imported
# here eagerly were paid for by every process that imports one of them: a
# job running a bundle or a manifest needs no compiler (with its compile
# slots, conformance records, known builds, tempfile and shutil: ~9 ms of
# imports). Each name is imported on first use instead
# (benchmarks/bench_start.py measures a serving process's start). The block below is
# the one list of the names (worker.lazy_names reads it on first use).
if TYPE_CHECKING:
    from worker.cache import CacheCounters as CacheCounters
    from worker.cache import DiskCache as DiskCache
    from worker.cache import UntrustedCacheError as UntrustedCacheError
    from worker.cache import explain_key as explain_key
    from worker.compile.compiler import compile_program as compile_program
    from worker.compile.compiler import program_key as program_key
    from worker.compile.executable import Executable as Executable
    from worker.compile.stamp import ForeignExecutableError as ForeignExecutableError
    from worker.errors import BundleError as BundleError
    from worker.errors import DeviceCountError as DeviceCountError
    from worker.errors import MissingExtraError as MissingExtraError
    from worker.errors import NeverCompileError as NeverCompileError
    from worker.errors import NotInCacheError as NotInCacheError
    from worker.errors import PjrtError as PjrtError
    from worker.errors import PjrtPoolError as PjrtPoolError
    from worker.errors import PlatformMismatchError as PlatformMismatchError
    from worker.errors import PluginLoadError as PluginLoadError
    from worker.errors import PluginNotFoundError as PluginNotFoundError
    from worker.identity.options import compile_options as compile_options
    from worker.plugin.kernels import FfiVersionError as FfiVersionError
    from worker.plugin.kernels import MissingCustomCallError as MissingCustomCallError
    from worker.plugin.kernels import register_custom_call as register_custom_call
    from worker.plugin.locate import PluginLocation as PluginLocation
    from worker.plugin.locate import find_plugin as find_plugin
    from worker.plugin.runtime import get_runtime as get_runtime
    from worker.plugin.runtime import loaded_runtime as loaded_runtime
    from worker.records import ArrayType as ArrayType
    from worker.records import CompileStatistics as CompileStatistics
    from worker.records import LoweredProgram as LoweredProgram
    from worker.records import ProgramSpec as ProgramSpec

__getattr__, __dir__ = on_first_use(__name__)
