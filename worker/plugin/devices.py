"""How many devices a process's client holds, and the refusal of a program that needs more.

A program over several devices (worker.partitioning) runs on a client that
holds that many. How a process is given k devices is each platform's
(Platform.device_settings in worker/plugin/platforms: the CPU's client
create option cpu_device_count, a TPU host's chips, a GPU's visible
devices). A pool also tells each worker its count through DEVICES_ENV,
which fixes it: a program needing more is refused before it compiles
(DeviceCountError), naming both counts and the setting, rather than
growing behind the parent's back. A process of its own (compile_program,
Executable.run) has as many as its platform gives, and on a platform whose
client takes its devices as create options (the CPU), a client of more is
made when a program needs them (worker.plugin.runtime.Runtime.client_for).
Runs in any process that holds a plugin; never imports JAX.
"""

from __future__ import annotations

import os

from worker.errors import DeviceCountError

DEVICES_ENV = "PJRT_POOL_DEVICES"
"""The devices a pool worker's client holds (the pool's devices_per_worker): set by the pool."""

SETTING = "devices_per_worker"
"""The Pool's setting that gives each worker more devices (named in refusals)."""


def fixed_devices() -> int | None:
    """The devices this process's client is given (DEVICES_ENV, set for pool workers), or None
    where nothing fixed them. Raises ValueError for a value that is not a positive count."""
    value = os.environ.get(DEVICES_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{DEVICES_ENV} must be a positive number of devices, not {value!r}")
    return int(value)


def too_few_devices(
    needed: int, available: int, mesh: str, where: str, hint: str
) -> DeviceCountError:
    """The refusal of a program that needs `needed` devices (over `mesh`, described) where
    `available` are (`where` says whose: "each worker of this pool holds"), with what gives
    more (`hint`)."""
    return DeviceCountError(
        f"the program needs {needed} devices ({mesh}) but {where} {available}: {hint}",
        needed,
        available,
    )


def more_per_worker(needed: int) -> str:
    """What gives a pool's workers `needed` devices each."""
    return (
        f"give each worker {needed} (Pool(..., {SETTING}={needed}); "
        f"pjrt-pool warm --devices-per-worker {needed})"
    )
