"""A Pool's settings: its options (pool.executor.options) checked, and what follows from them.

Everything is checked before any worker starts or any task is queued: each
option by its own check, in the signature's order, then what takes several
together (where the workers go, the initializer with its arguments, the
cache directory's trust, what preload names). PoolSettings holds the result
for one pool: a field for each option the executor reads, named as the
option, with its checked value, and the values derived from several.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pool.executor.checks import finite, pickle_initializer
from pool.executor.copier import STREAM_BYTES
from pool.executor.options import MAX_DISPATCH_AHEAD, DeviceStart, check_options
from pool.executor.preload import preload_programs
from pool.executor.roles import Role, WorkerPlan, plan_workers
from pool.remote_option import open_for_workers
from worker.cache import DiskCache
from worker.cache.location import resolve_cache_dir
from worker.partitioning import Partitioning
from worker.plugin.devices import more_per_worker, too_few_devices
from worker.plugin.platforms.registry import platform_named
from worker.plugin.runtime import default_platform
from worker.plugin.topology import TopologySpec


@dataclass(frozen=True)
class PoolSettings:
    """A Pool's options, checked (see Pool for what each means), and what follows from them."""

    workers: int
    platform: str | None
    cache_dir: Path  # resolved once, here: the workers are given it (pool.executor.processes)
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
    # When the device workers of a pool with compile workers start (pool.executor.roles).
    device_start: DeviceStart = DeviceStart.WHEN_NEEDED
    # How many all-kept runs a caller may send one worker before their replies.
    dispatch_ahead: int = MAX_DISPATCH_AHEAD

    @property
    def input_stream_bytes(self) -> int:
        """From what size numpy inputs are copied into shared memory with streaming stores:
        the platform's own size (Platform.input_stream_bytes), else the copier's."""
        own = platform_named(self.platform or default_platform()).input_stream_bytes
        return STREAM_BYTES if own is None else own

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
    def check(cls, given: Mapping[str, Any]) -> PoolSettings:
        """Checks every option a Pool was given (all of them, by name); raises for the first bad
        one, in the order Pool takes them, then for what several make together.

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
        values = check_options(given)
        platform = values["platform"]
        plan = plan_workers(
            values["workers"],
            platform or default_platform(),
            values["topology"],
            values["run_workers"],
            values["devices_per_worker"],
        )
        # The one place the pool's cache directory is resolved: the parent and every
        # worker, the replacements too, use this directory (a relative one, or the
        # environment's default, cannot change under a pool that is running).
        directory = resolve_cache_dir(values["cache_dir"]).absolute()
        open_for_workers(values["remote"])
        # Its workers' cache: untrusted raises, unusable warns, here. Closed at once: the
        # pool's workers hold it, this process keeps no descriptor per pool made.
        DiskCache(directory).close()
        derived: dict[str, Any] = {
            "cache_dir": directory,
            "workers": len(plan),
            "plan": plan,
            "task_timeout": finite(values["task_timeout"]),
            "start_timeout": finite(values["start_timeout"]),
            "initializer": pickle_initializer(values["initializer"], values["initargs"]),
            "preload": preload_programs(values["preload"], values["preload_names"], directory),
        }
        # Every other field is an option's checked value, under its name.
        plain = {field.name for field in dataclasses.fields(cls)} - set(derived)
        return cls(**derived, **{name: values[name] for name in plain})


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
