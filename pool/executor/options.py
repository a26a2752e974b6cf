"""The Pool's options, each declared once: its name, type, default, check and documentation.

POOL_OPTIONS is the one list. What is made of it:

- Pool's signature (WorkerPool.__init__, written out so that type checkers
  see it; tests/test_pool_options.py checks that it states exactly these
  options, in this order, with these types and defaults);
- the options section of Pool's docstring (document);
- PoolSettings (pool.executor.settings): each option checked by its own
  check, in this order, then what takes several of them together;
- ClusterPool's checks of the options it passes to its nodes' Pools;
- the `pjrt-pool` command line's options that set one (the `flag`,
  pool.cli.options.add_pool_option).

Adding an option is one PoolOption here, its parameter in WorkerPool's
signature (the test names what is missing) and its use: a PoolSettings field
of the same name carries its checked value to the executor, and a field of
worker.serve.command_line.WorkerCommand (stated there once for both sides)
carries it to a worker that needs it.
"""

from __future__ import annotations

import enum
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pool.executor.checks import (
    check_count,
    check_directory,
    check_flag,
    check_grace,
    check_initargs,
    check_initializer,
    check_platform,
    check_timeout,
)
from worker.plugin.topology import parse_topology

DEFAULT_CACHE_BYTES = 512 << 20
"""How many bytes of segments a pool keeps for reuse (or will get back from live results)."""

DEFAULT_MAX_FDS = 64
"""How many segment descriptors a pool keeps beyond those of tasks in flight."""

MAX_DISPATCH_AHEAD = 3
"""The most runs a pool sends one worker ahead of their replies (dispatch_ahead): each has
its own quarter of the worker's arena for its inputs (pool.executor.worker_process)."""


class DeviceStart(enum.Enum):
    """When the device workers of a pool that also has compile workers start (a TPU host's
    pool, or Pool(run_workers=r)): see pool.executor.roles."""

    WHEN_NEEDED = "when needed"
    """At the first task only they take (a run, put, fetch), or once the compile workers
    have had nothing queued or running for a moment, whichever comes first: compiles from
    a fresh pool never share the host with a chip being opened."""
    AT_ONCE = "at once"
    """With the compile workers, as the pool starts (the pool still waits for these alone)."""


def _device_start(value: Any, name: str) -> DeviceStart:
    if isinstance(value, DeviceStart):
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be a DeviceStart (DeviceStart.WHEN_NEEDED or DeviceStart.AT_ONCE), "
            f"not {type(value).__name__} {value!r}"
        )
    try:
        return DeviceStart(value)
    except ValueError:
        choices = ", ".join(repr(member.value) for member in DeviceStart)
        message = f"{name} must be a DeviceStart or one of {choices}, not {value!r}"
        raise ValueError(message) from None


Check = Callable[[Any, str], Any]
"""An option's check: (value, the name to call it in errors) -> the value checked, itself a
value the option takes; raises TypeError for a value of the wrong kind, ValueError for one
out of range."""


@dataclass(frozen=True)
class Flag:
    """How `pjrt-pool`'s commands take an option: its flag (``--cache-dir``), the word its
    help shows for the value, and the type argparse converts the text to."""

    name: str
    metavar: str
    type: Callable[[str], Any] = str
    shown_default: str | None = None
    """How the default reads in a command's help, where every command means the same one."""


@dataclass(frozen=True)
class PoolOption:
    """One option of Pool (see the module docstring)."""

    name: str
    annotation: str
    """Its type, as Pool's signature writes it."""
    default: Any
    check: Check
    doc: str
    """What it means, for Pool's docstring: sentences, the first naming it."""
    shown_default: str | None = None
    """How its default reads for people, where its repr does not say it well."""
    flag: Flag | None = None
    """How `pjrt-pool`'s commands take it, for those that do."""
    positional: bool = False
    """Whether it may be given by position too (only the first, workers)."""

    def checked(self, value: Any, name: str | None = None) -> Any:
        """The value checked by the option's check, errors naming `name` (default: its own)."""
        return self.check(value, name or self.name)

    def shown(self) -> str:
        """Its default as Pool's signature shows it to people."""
        return self.shown_default or repr(self.default)


def _optional(check: Check) -> Check:
    return lambda value, name: None if value is None else check(value, name)


def _count(minimum: int, meaning: str) -> Check:
    return lambda value, name: check_count(value, name, minimum, meaning)


def _dispatch_ahead(value: Any, name: str) -> int:
    count = check_count(value, name, 0, "runs sent ahead of their replies")
    if count > MAX_DISPATCH_AHEAD:
        raise ValueError(
            f"{name} must be at most {MAX_DISPATCH_AHEAD} (runs sent ahead of their replies), "
            f"not {value!r}"
        )
    return count


def _never_compile(value: Any, name: str) -> bool:
    # Imported here, as _remote's check: `pjrt-pool`'s commands read the declarations
    # for their flags, and one that runs a bundle imports none of the cache's machinery.
    from worker.compile.never_compile import never_compile_on

    return never_compile_on(value)


def _remote(value: Any, name: str) -> Any:
    from pool.remote_option import check_remote

    return check_remote(value)


def _as_given(value: Any, name: str) -> Any:
    # Checked with what it takes together with other options (PoolSettings.check).
    return value


POOL_OPTIONS: tuple[PoolOption, ...] = (
    PoolOption(
        "workers",
        "int | None",
        None,
        _optional(_count(1, "worker processes")),
        "workers is the number of worker processes (default: the CPU count; on a TPU host, "
        "or with run_workers, the number of compile workers: see run_workers).",
        flag=Flag("--workers", "N", int),
        positional=True,
    ),
    PoolOption(
        "platform",
        "str | None",
        None,
        lambda value, name: check_platform(value),
        'platform names the plugin to load (default: PJRT_POOL_PLATFORM, else "cpu").',
        flag=Flag("--platform", "P", shown_default="$PJRT_POOL_PLATFORM, else cpu"),
    ),
    PoolOption(
        "cache_dir",
        "str | os.PathLike[str] | None",
        None,
        check_directory,
        "cache_dir is the shared disk cache (default: PJRT_POOL_CACHE_DIR, else the user "
        "cache directory). It is resolved once, here, and given to every worker, the "
        "replacements too, as its PJRT_POOL_CACHE_DIR. One that others could write raises "
        "UntrustedCacheError here (worker.cache.trust).",
        flag=Flag(
            "--cache-dir",
            "DIR",
            shown_default="$PJRT_POOL_CACHE_DIR, else the user cache directory",
        ),
    ),
    PoolOption(
        "task_timeout",
        "float | None",
        None,
        check_timeout,
        "task_timeout bounds each task's time in a worker, in seconds (None or inf: no "
        "bound); a task past it has its worker killed and replaced. A call's own timeout "
        "overrides it.",
        flag=Flag("--timeout", "SECONDS", float),
    ),
    PoolOption(
        "start_timeout",
        "float",
        120.0,
        check_timeout,
        "start_timeout bounds the constructor's wait for the workers to start (and to "
        "preload), in seconds; past it, WorkerStartupError (None or inf: no bound).",
    ),
    PoolOption(
        "initializer",
        "Callable[..., Any] | None",
        None,
        check_initializer,
        "initializer(*initargs) runs in each worker after its plugin loads, for example to "
        "register custom calls; if it raises, the pool does not start. Both go to the "
        "workers with cloudpickle.",
    ),
    PoolOption(
        "initargs",
        "Sequence[Any]",
        (),
        lambda value, name: check_initargs(value),
        "initargs are the initializer's arguments (a tuple or list).",
    ),
    PoolOption(
        "max_loaded",
        "int",
        64,
        _count(1, "executables each worker keeps loaded"),
        "max_loaded is how many executables each worker keeps loaded, the least recently "
        "used unloaded first; tasks go to a worker that has their program loaded.",
    ),
    PoolOption(
        "max_crashes",
        "int",
        2,
        _count(1, "worker crashes that quarantine a program"),
        "A program that crashes max_crashes workers is quarantined: its later tasks fail "
        "with ProgramQuarantinedError.",
    ),
    PoolOption(
        "zero_copy",
        "bool",
        True,
        check_flag,
        "zero_copy lets the plugin read a run's inputs where they lie in shared memory, "
        "without a copy of its own (a call's zero_copy overrides it).",
    ),
    PoolOption(
        "stop_grace",
        "float",
        2.0,
        check_grace,
        "stop_grace is the seconds close() and terminate() wait between a worker's exit "
        "request, SIGTERM and SIGKILL.",
    ),
    PoolOption(
        "segment_cache_bytes",
        "int",
        DEFAULT_CACHE_BYTES,
        _count(0, "bytes of shared memory kept for reuse"),
        "Up to segment_cache_bytes of shared memory from finished large inputs and dropped "
        "results is kept for reuse (what nothing uses; the longest unused goes first), "
        "since fresh shared memory is slow to fault in; a dropped result's memory past "
        "that goes with its arrays.",
        shown_default="512 MiB",
    ),
    PoolOption(
        "segment_fds",
        "int",
        DEFAULT_MAX_FDS,
        _count(0, "descriptors kept for shared memory"),
        "segment_fds bounds the descriptors the pool keeps for shared memory beyond those "
        "of running tasks (queued large inputs, live large results, segments kept for "
        "reuse), so a deep queue or many kept results never exhaust the process's "
        "descriptor limit.",
    ),
    PoolOption(
        "never_compile",
        "bool | None",
        None,
        _never_compile,
        "never_compile=True (default: PJRT_POOL_COMPILE=never in the environment) makes "
        "the pool load what its cache holds and never compile: a program that is not there "
        "fails with NeverCompileError, a LookupError, raised when it is submitted, before "
        "any worker is used (see worker.compile.never_compile). With a remote (this one, "
        "or the environment's), it refuses only what neither the cache nor the remote "
        "holds: the worker fetches.",
    ),
    PoolOption(
        "preload",
        "Manifest | str | os.PathLike[str] | None",
        None,
        _as_given,
        "preload (a Manifest, or the path of a manifest or bundle: what load_manifest "
        "takes) makes the pool start loaded: every worker loads the programs it names from "
        "the cache as it starts, all workers at once. The constructor returns once every "
        "worker holds them all, so no task for one of them (Pool.submit_spec, "
        "Manifest.run(..., pool)) waits for a load; start_timeout bounds that too. A "
        "program that does not load (not in the cache, as never_compile would find at its "
        "first task) raises its NotInCacheError here, naming it, with the workers stopped; "
        "a worker that dies preloading raises WorkerStartupError. A bundle is imported "
        "into cache_dir first. Replacement workers preload too.",
    ),
    PoolOption(
        "preload_names",
        "Sequence[str] | None",
        None,
        _as_given,
        "preload_names preloads only those of preload's programs (default: all).",
    ),
    PoolOption(
        "prime",
        "bool",
        False,
        check_flag,
        "prime=True has each worker prime what it preloads (Executable.prime: one run on "
        "zeros, skipped for programs that keep state).",
    ),
    PoolOption(
        "remote",
        "str | Literal[False] | None",
        None,
        _remote,
        "remote is the URL of the remote cache tier (worker.cache.remote), given to the "
        "workers as their PJRT_POOL_CACHE_REMOTE (this process's environment is left as it "
        "is); False gives them none, whatever this process's PJRT_POOL_CACHE_REMOTE says; "
        "a URL of no known scheme is a ValueError.",
        flag=Flag("--remote", "URL"),
    ),
    PoolOption(
        "topology",
        "str | TopologySpec | None",
        None,
        _optional(lambda value, name: parse_topology(value)),
        'topology (a name such as "v5e:1x1", or a TopologySpec) makes every worker compile '
        "for that topology without a device (compile_program's topology): such a pool "
        "opens no device, so it compiles for a TPU on a machine without one, or beside the "
        "process that holds the chip; submitting a run to it raises PoolError. On a TPU "
        'host a pool for platform "tpu" without a topology has workers compile beside one '
        "device worker per chip, which runs what they compiled (pool.executor.roles): "
        "workers is then the number of compile workers (default a third of the cores, at "
        "least 2), the device workers come in addition, and a program's first run compiles "
        "it on a compile worker before a device worker loads it from the cache.",
        flag=Flag("--topology", "NAME"),
    ),
    PoolOption(
        "run_workers",
        "int | None",
        None,
        _optional(_count(0, "workers that run programs")),
        "run_workers (at most the chips there) says how many device workers a TPU host's "
        "pool starts. Elsewhere run_workers=r splits the pool the same way: workers compile "
        "only, r more workers only run, loading what the others compiled from the cache, "
        "so that runs never wait behind long compiles (default 0: every worker does both). "
        "See pool.executor.roles. Every method takes the same calls whatever the workers' "
        "roles (worker_info says each one's).",
    ),
    PoolOption(
        "devices_per_worker",
        "int",
        1,
        _count(1, "devices each worker holds"),
        "devices_per_worker (default 1) is how many devices each worker holds, for programs "
        "over several devices (a jax.jit with shardings over a Mesh, a shard_map: see "
        "docs/sharding.md): on the CPU that many host devices (the CPU plugin's "
        "cpu_device_count), on a TPU host one chip per worker or all of them "
        "(devices_per_worker=1 or the host's chips; compile workers then compile for that "
        "many chips), on a GPU the GPUs the worker sees. A program over more devices than "
        "that is refused when it is submitted, before it compiles, with a DeviceCountError "
        "naming both counts and this setting. Such a program takes and returns global "
        "arrays, as jax.jit does: each worker splits them over its devices and runs once "
        "over all.",
        flag=Flag("--devices-per-worker", "N", int),
    ),
    PoolOption(
        "device_start",
        "DeviceStart",
        DeviceStart.WHEN_NEEDED,
        _device_start,
        "device_start says when the device workers of a pool that also has compile workers "
        "(a TPU host's, or one given run_workers) start: DeviceStart.WHEN_NEEDED (the "
        "default) at the first task only they take (a run, put, fetch: it starts them at "
        "once, even while compiles are queued), or once the compile workers have had nothing "
        "queued or running for a second, whichever comes first, so that compile_many from a "
        "fresh pool never shares the host with a chip being opened (worker_info shows them "
        '"not started" until then); DeviceStart.AT_ONCE with the compile workers, as the '
        "pool starts. Either way the pool is ready once its compile workers are (unless it "
        "preloads), and start_timeout bounds a device worker's start from when it begins.",
        shown_default="DeviceStart.WHEN_NEEDED",
    ),
    PoolOption(
        "dispatch_ahead",
        "int",
        MAX_DISPATCH_AHEAD,
        _dispatch_ahead,
        f"dispatch_ahead (0 to {MAX_DISPATCH_AHEAD}, default {MAX_DISPATCH_AHEAD}) is how many "
        "runs whose outputs all stay in the worker (keep= naming every output, as "
        "Pool.function(step, keep=True) does) a caller may send one worker before their "
        "replies are read, as jax.jit dispatches a step and returns: such a run returns its "
        "DeviceValues once its request is sent, the worker's reply is read by the next call "
        "to that worker (or by the pool's manager thread), and an error of that run is "
        "raised where its values are next used (a call taking them, fetch, np.asarray), "
        "not by the call that made them. 0 waits for every reply, as a run that returns "
        "arrays always does.",
    ),
)

OPTIONS: Mapping[str, PoolOption] = {option.name: option for option in POOL_OPTIONS}
"""The options by name."""


def check_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """Each option's value checked by its own check, in the signature's order: the first bad
    one raises. `given` holds every option (a Pool's parameters)."""
    unknown = set(given) - set(OPTIONS)
    if unknown:
        raise TypeError(f"Pool() got unexpected options {sorted(unknown)}")
    return {option.name: option.checked(given[option.name]) for option in POOL_OPTIONS}


def document(options: tuple[PoolOption, ...] = POOL_OPTIONS, width: int = 88) -> str:
    """The options section of Pool's docstring: each option's signature entry and meaning."""
    header = (
        "Options, each checked here, before any worker starts (a bad one raises TypeError "
        "or ValueError naming it, and starts nothing):"
    )
    lines = [textwrap.fill(header, width), ""]
    for option in options:
        lines.append(f"{option.name}: {option.annotation} = {option.shown()}")
        lines.append(
            textwrap.fill(option.doc, width, initial_indent="    ", subsequent_indent="    ")
        )
    return "\n".join(lines)


def signature_text(name: str = "Pool", options: tuple[PoolOption, ...] = POOL_OPTIONS) -> str:
    """The call with every option at its default, as docs/pool.md states it."""
    positional = [f"{o.name}={o.shown()}" for o in options if o.positional]
    keywords = [f"{o.name}={o.shown()}" for o in options if not o.positional]
    return f"{name}({', '.join([*positional, '*', *keywords])})"
