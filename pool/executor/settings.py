"""Checking what a Pool is given: its constructor's settings and per-call timeouts.

Everything is checked before any worker starts or any task is queued. A
value of the wrong kind raises TypeError, one out of range ValueError; both
name the argument, say what it must be and show what it was. PoolSettings
holds the checked settings of one pool.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import cloudpickle

from pool.executor.preload import preload_programs
from pool.executor.roles import Role, WorkerPlan, plan_workers
from pool.remote_option import check_remote, open_for_workers
from worker.cache import open_cache
from worker.compile.never_compile import never_compile_on
from worker.partitioning import Partitioning
from worker.plugin.devices import more_per_worker, too_few_devices
from worker.plugin.runtime import default_platform
from worker.plugin.topology import TopologySpec, parse_topology


@dataclass(frozen=True)
class PoolSettings:
    """A Pool's constructor arguments, checked (see Pool for what each means)."""

    workers: int
    platform: str | None
    cache_dir: str | None
    task_timeout: float | None  # None: no bound
    start_timeout: float | None  # None: no bound
    max_loaded: int
    max_crashes: int
    zero_copy: bool
    stop_grace: float
    segment_cache_bytes: int
    segment_fds: int
    initializer: bytes  # the initializer and its arguments, cloudpickled (b"" for none)
    never_compile: bool
    preload: tuple[tuple[str, str], ...] = ()  # (cache key, name) each worker loads as it starts
    prime: bool = False  # whether each worker primes what it preloads
    # The workers' PJRT_POOL_CACHE_REMOTE; None: the environment's; False: none (removed).
    remote: str | Literal[False] | None = None
    # Each worker slot's role, topology and own environment (pool.executor.roles).
    plan: tuple[WorkerPlan, ...] = ()
    topology: TopologySpec | None = None  # the pool compiles for it without a device
    devices_per_worker: int = 1  # the devices each worker's client holds (worker.plugin.devices)

    @property
    def runners(self) -> int:
        """How many workers run programs (those of the plan that do not only compile)."""
        return sum(plan.role is not Role.COMPILE for plan in self.plan)

    @property
    def runs(self) -> bool:
        """Whether some worker runs programs (a pool given a topology only compiles)."""
        return self.runners > 0

    @property
    def compiles_apart(self) -> bool:
        """Whether compiles go to other workers than runs (a TPU host's pool)."""
        roles = {plan.role for plan in self.plan}
        return Role.COMPILE in roles and Role.DEVICE in roles

    @classmethod
    def check(
        cls,
        workers: Any,
        *,
        platform: Any,
        cache_dir: Any,
        task_timeout: Any,
        start_timeout: Any,
        initializer: Callable[..., Any] | None,
        initargs: Sequence[Any],
        max_loaded: Any,
        max_crashes: Any,
        zero_copy: Any,
        stop_grace: Any,
        segment_cache_bytes: Any,
        segment_fds: Any,
        never_compile: bool | None,
        preload: Any = None,
        preload_names: Any = None,
        prime: Any = False,
        remote: Any = None,
        topology: Any = None,
        run_workers: Any = None,
        devices_per_worker: Any = 1,
    ) -> PoolSettings:
        """Checks every setting, in the order Pool takes them; raises for the first bad one.

        The cache directory is opened too (made if missing): one that others
        could write fails here (UntrustedCacheError), not in every task, and one
        that cannot be made or written is warned of here, once, where the
        caller sees it (the workers' own output is kept for crash reports). So
        is the remote tier (pool.remote_option.open_for_workers: a URL or
        setting it cannot use is a ValueError, its store's client missing a
        MissingExtraError, and records the workers would publish unsigned a
        warning), and what preload names: a manifest that does not read, or
        a name not in it, raises ManifestError; a bundle is imported into the
        cache directory here (pool.executor.preload). So is the topology's name, and where the
        workers go (pool.executor.roles): a pool for TPU on a machine without
        one, and given no topology, is a ValueError.
        """
        devices = check_count(
            devices_per_worker, "devices_per_worker", 1, "devices each worker holds"
        )
        platform, target, plan = _checked_plan(workers, platform, topology, run_workers, devices)
        directory = check_directory(cache_dir, "cache_dir")
        task_limit = finite(check_timeout(task_timeout, "task_timeout"))
        start_limit = finite(check_timeout(start_timeout, "start_timeout"))
        loaded = check_count(max_loaded, "max_loaded", 1, "executables each worker keeps loaded")
        crashes = check_count(
            max_crashes, "max_crashes", 1, "worker crashes that quarantine a program"
        )
        zero_copy = check_flag(zero_copy, "zero_copy")
        grace = check_grace(stop_grace, "stop_grace")
        cache_bytes = check_count(
            segment_cache_bytes, "segment_cache_bytes", 0, "bytes of shared memory kept for reuse"
        )
        fds = check_count(segment_fds, "segment_fds", 0, "descriptors kept for shared memory")
        pickled = pickle_initializer(initializer, check_initargs(initargs))
        prime = check_flag(prime, "prime")
        remote_url = check_remote(remote)
        open_for_workers(remote_url)
        open_cache(directory)  # its workers' cache: untrusted raises, unusable warns once, here
        programs = preload_programs(preload, preload_names, directory)
        return cls(
            workers=len(plan),
            platform=platform,
            cache_dir=directory,
            task_timeout=task_limit,
            start_timeout=start_limit,
            max_loaded=loaded,
            max_crashes=crashes,
            zero_copy=zero_copy,
            stop_grace=grace,
            segment_cache_bytes=cache_bytes,
            segment_fds=fds,
            initializer=pickled,
            never_compile=never_compile_on(never_compile),
            preload=programs,
            prime=prime,
            remote=remote_url,
            plan=plan,
            topology=target,
            devices_per_worker=devices,
        )


def _checked_plan(
    workers: Any, platform: Any, topology: Any, run_workers: Any, devices: int = 1
) -> tuple[str | None, TopologySpec | None, tuple[WorkerPlan, ...]]:
    """The platform, the topology and the worker slots (pool.executor.roles), checked in that
    order, as PoolSettings.check takes them."""
    count = None if workers is None else check_count(workers, "workers", 1, "worker processes")
    platform = check_platform(platform)
    target = None if topology is None else parse_topology(topology)
    runners = (
        None
        if run_workers is None
        else check_count(run_workers, "run_workers", 0, "workers that run programs")
    )
    plan = plan_workers(count, platform or default_platform(), target, runners, devices)
    return platform, target, plan


def check_devices(
    partitioning: Partitioning | None, devices_per_worker: int, topology: Any = None
) -> None:
    """Refuses a program over more devices than a pool's worker holds (a DeviceCountError
    naming both counts and devices_per_worker), before any worker is claimed. A pool given a
    topology leaves it to its workers, which know how many chips the topology has."""
    if partitioning is None or topology is not None:
        return
    if partitioning.devices > devices_per_worker:
        raise too_few_devices(
            partitioning.devices,
            devices_per_worker,
            partitioning.mesh_text,
            "each worker of this pool holds",
            more_per_worker(partitioning.devices),
        )


def check_timeout(value: Any, what: str = "timeout") -> float | None:
    """Returns a timeout in seconds: None for None, math.inf for no limit; refuses the rest.

    A timeout is a positive number of seconds; inf means no limit. NaN, zero,
    negative numbers, booleans and strings raise before any work starts.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{what} must be a number of seconds (or None), not {type(value).__name__} {value!r}"
        )
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(
            f"{what} must be a positive number of seconds (inf: no limit), not {value!r}"
        )
    return seconds


def finite(seconds: float | None) -> float | None:
    """A checked timeout as a bound: None when there is none."""
    return None if seconds is None or math.isinf(seconds) else seconds


def check_count(value: Any, what: str, minimum: int, meaning: str) -> int:
    """Returns an int of at least `minimum`; `meaning` says what it counts, for the error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int ({meaning}), not {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be at least {minimum} ({meaning}), not {value!r}")
    return int(value)


def check_grace(value: Any, what: str) -> float:
    """Returns a finite number of seconds of at least zero (how long to wait before escalating)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__} {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} must be a finite number of seconds, 0 or more, not {value!r}")
    return seconds


def check_flag(value: Any, what: str) -> bool:
    """Returns a bool; refuses anything else (a string "False" would be true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, not {type(value).__name__} {value!r}")
    return value


def check_platform(value: Any) -> str | None:
    """Returns a platform's name (as in PJRT_POOL_PLUGIN_<PLATFORM>), or None for the default."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError(
            f"platform must be a platform's name such as 'cpu' or 'cuda' (or None for the "
            f"default), not {type(value).__name__} {value!r}"
        )
    return value


def check_directory(value: Any, what: str) -> str | None:
    """Returns a directory's path as a str (from a str or os.PathLike of one), or None."""
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path:
        raise TypeError(
            f"{what} must be a directory's path (str or pathlib.Path) or None, "
            f"not {type(value).__name__} {value!r}"
        )
    return path


def check_initargs(value: Any) -> tuple[Any, ...]:
    """Returns the initializer's arguments as a tuple (from a tuple or list)."""
    if not isinstance(value, (tuple, list)):
        raise TypeError(
            f"initargs must be a tuple or list of the initializer's arguments, "
            f"not {type(value).__name__} {value!r}"
        )
    return tuple(value)


def pickle_initializer(initializer: Any, initargs: tuple[Any, ...]) -> bytes:
    """Returns the initializer and its arguments as cloudpickle bytes (b"" for none)."""
    if initializer is None:
        return b""
    if not callable(initializer):
        raise TypeError(f"initializer must be callable, not {type(initializer).__name__}")
    try:
        return cloudpickle.dumps((initializer, tuple(initargs)))
    except Exception as error:  # what pickling raises varies with what it met
        raise TypeError(
            "initializer and initargs go to each worker with cloudpickle, which "
            f"cannot pickle them: {type(error).__name__}: {error}"
        ) from error
