"""What each worker of a pool is for: compiling, running on a device, or both.

On a CPU or a GPU every worker loads the plugin on the process's device and
both compiles and runs (Role.ANY). A TPU host differs (docs/facts.md, "TPU"):
one process at a time may hold a chip, libtpu's host lock keeps a second from
even loading it, and compiles are long and multithreaded. So a pool there is two kinds of worker::

    compile workers (Role.COMPILE)   libtpu loaded without the host's lock, no
                                     client, no chip: compile for the host's
                                     topology (worker.compile.target) and
                                     publish to the shared disk cache
    device workers (Role.DEVICE)     one per chip, each holding its chip: load
                                     from the cache and run

Compiles (submit_compile, compile_many, warm, and the compile a new program
needs before its first run) go to compile workers; runs go to device workers,
which find the executable in the cache (the key is the same on both sides).
The pool's start waits for the compile workers only (start_awaits), so
compile_many starts at once, and runs wait in the queue until a device
worker is ready. A device worker opening its chip slows the compiles beside it
(docs/facts.md, "TPU"), so by default (DeviceStart.WHEN_NEEDED)
the device workers start when first needed (deferred_roles; WorkerStarts
starts them): at the first task only they take (a run, even one whose
program is still compiling, a put, a fetch), or once the compile workers
have had nothing queued or running for a moment: compile_many from a fresh
pool runs alone, and a pool given a run, or left idle, opens its chip at
once. DeviceStart.AT_ONCE starts them with the compile workers. A device
worker that ends is replaced at once, whatever is compiling.
Each worker finds its role in its environment (ROLE_ENV), for an initializer
that does different work in each.
A pool given a topology is all compile workers: it never touches a device, so
it runs beside the process that holds the chip, or on a machine without one.

    Pool(n, platform="tpu") on a host with k chips: n compile workers (default
    a third of the cores, at least 2: DEFAULT_COMPILE_SHARE) and k device workers
    (devices_per_worker=k: one device worker holding every chip, the compile
    workers compiling for them all)
    Pool(n, topology="v5e:2x2"): n compile workers, no device worker
    Pool(n, run_workers=r) elsewhere: n compile workers and r workers that run
    (each on its process's device, loading what the compile workers put in
    the cache), so that runs never wait behind long compiles
    Pool(n) elsewhere: n workers that do both
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from pool.executor.options import DeviceStart
from pool.executor.tasks import Kind
from worker.errors import DeviceUnavailableError
from worker.plugin.devices import DEVICES_ENV
from worker.plugin.platforms.platform import DeviceAccess, Platform
from worker.plugin.platforms.registry import platform_named
from worker.plugin.topology import TopologySpec

DEFAULT_COMPILE_SHARE = 3
"""A TPU pool's default compile workers: the cores divided by this, and at least 2. Each XLA
TPU compile is multithreaded itself, and more compile processes than about a third of the
cores make every compile slower (docs/facts.md, "TPU"; benchmarks/bench_tpu_compile.py)."""

MIN_COMPILE_WORKERS = 2

ROLE_ENV = "PJRT_POOL_WORKER_ROLE"
"""The environment variable that tells a worker its role (Role's value: "compile and run",
"compile" or "device")."""


class Role(enum.Enum):
    """What a worker is for (see the module)."""

    ANY = "compile and run"
    COMPILE = "compile"
    DEVICE = "device"

    def takes(self, kind: Kind) -> bool:
        """Whether a worker of this role takes tasks of a kind."""
        if self is Role.ANY:
            return True
        return (kind is Kind.COMPILE) == (self is Role.COMPILE)


@dataclass(frozen=True)
class WorkerPlan:
    """One worker slot of a pool: its role, what it compiles for, and its own environment."""

    role: Role = Role.ANY
    topology: TopologySpec | None = None
    """A compile worker's topology (compiled for without a device); None: its device."""
    environment: tuple[tuple[str, str], ...] = ()
    """Variables set for this worker alone (a device worker's chip, on a host of several)."""


def start_awaits(plan: tuple[WorkerPlan, ...], preloads: bool) -> frozenset[Role]:
    """The roles whose workers a pool's start waits for: every one, but the device workers of
    a pool with compile workers (they start beside them, and runs wait for them in the
    queue), unless the pool preloads programs, which its constructor promises loaded."""
    roles = {worker.role for worker in plan}
    if Role.COMPILE in roles and not preloads:
        roles.discard(Role.DEVICE)
    return frozenset(roles)


def deferred_roles(
    plan: tuple[WorkerPlan, ...], preloads: bool, device_start: DeviceStart
) -> frozenset[Role]:
    """The roles whose workers a pool starts only when first needed (see the module): those
    its start does not wait for (the device workers of a pool with compile workers that
    preloads nothing), with DeviceStart.WHEN_NEEDED; none with DeviceStart.AT_ONCE."""
    if device_start is not DeviceStart.WHEN_NEEDED:
        return frozenset()
    return frozenset(worker.role for worker in plan) - start_awaits(plan, preloads)


def default_compile_workers() -> int:
    """A TPU pool's compile workers when none are asked for (see DEFAULT_COMPILE_SHARE)."""
    return max(MIN_COMPILE_WORKERS, (os.cpu_count() or 1) // DEFAULT_COMPILE_SHARE)


def given(facts: Platform, devices: int, first: int = 0) -> tuple[tuple[str, str], ...]:
    """A worker's own variables that give it `devices` devices from device `first`
    (Platform.device_settings), and tell it its count (worker.plugin.devices.DEVICES_ENV),
    which a program over more is then refused by. Raises ValueError for a share the platform
    cannot give one process."""
    settings = facts.device_settings(devices, first=first)
    return (*settings.environment.items(), (DEVICES_ENV, str(devices)))


def plan_workers(
    workers: int | None,
    platform: str | None,
    topology: TopologySpec | None,
    run_workers: int | None = None,
    devices: int = 1,
) -> tuple[WorkerPlan, ...]:
    """The pool's worker slots (see the module), each worker that runs holding `devices`
    devices (a compile worker for a topology none); raises DeviceUnavailableError for a TPU
    pool that can neither find a chip nor was given a topology, and ValueError for run
    workers a pool given a topology cannot have, or more than a TPU host's chips, or a share
    of a host's devices the platform cannot give one process."""
    cores = os.cpu_count() or 1
    if topology is not None:
        if run_workers:
            raise ValueError(
                "a pool given a topology compiles for it without a device: it has no run "
                f"workers (run_workers={run_workers})"
            )
        return (WorkerPlan(Role.COMPILE, topology),) * (workers or default_compile_workers())
    facts = platform_named(platform or "")
    if facts.device_access is not DeviceAccess.EXCLUSIVE:
        # Every worker opens the same devices, as each opens the first one by default (and
        # with one device, as a worker always did: whatever devices its process sees).
        told = given(facts, devices) if devices > 1 else ((DEVICES_ENV, "1"),)
        if not run_workers:
            return (WorkerPlan(Role.ANY, None, told),) * (workers or cores)
        compilers = workers or max(1, cores - run_workers)
        return (WorkerPlan(Role.COMPILE, None, told),) * compilers + (
            WorkerPlan(Role.DEVICE, None, told),
        ) * run_workers
    chips = facts.attached_devices() or 0
    if chips == 0:
        raise DeviceUnavailableError(
            f"no {facts.name.upper()} is attached to this machine, so a pool for platform "
            f"{facts.name!r} has nothing to run on: give it a topology "
            "(Pool(topology='v5e:1x1')) to compile for one without it, and run where the chip is"
        )
    if run_workers is not None and run_workers > chips // devices:
        raise ValueError(
            f"run_workers={run_workers}, but this host has {chips} {facts.name.upper()} chip(s), "
            f"and one process at a time may hold a chip: give at most one run worker per "
            f"{devices} chip(s)"
        )
    held = chips // devices if run_workers is None else run_workers
    # Compile workers compile for what one device worker holds: the key is the same there.
    host = facts.host_topology(devices)
    role = Role.DEVICE if host is not None else Role.ANY
    runners = tuple(
        WorkerPlan(role, None, given(facts, devices, first=i * devices)) for i in range(held)
    )
    if host is None:
        return runners  # no name for the host's topology: each chip's worker compiles itself
    compilers = workers or default_compile_workers()
    return (WorkerPlan(Role.COMPILE, host),) * compilers + runners
