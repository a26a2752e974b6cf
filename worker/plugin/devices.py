"""How a process is given k devices, per platform, and the refusal of a program that needs more.

A program over several devices (worker.partitioning) runs on a client that
holds that many. How a client gets them differs per platform, one small
function each:

    cpu     XLA's CPU plugin makes as many host devices as its client create option
            cpu_device_count says (measured on both CPU plugins): a pool worker's
            client gets the pool's devices_per_worker, a process of its own as many
            as its largest program needs (a new client, made when one needs more)
    tpu     libtpu's client holds the chips the process sees: a device worker given
            every chip of the host sees them all (no variable), one given one chip
            sees it alone (pool.executor.roles.device_environment)
    cuda    the plugin's client holds every GPU the process sees (CUDA_VISIBLE_DEVICES)
    rocm

A pool tells each worker its count through DEVICES_ENV, which fixes it: a
program needing more is refused before it compiles (DeviceCountError), naming
both counts and the setting, rather than growing behind the parent's back.
Runs in any process that holds a plugin; never imports JAX.
"""

from __future__ import annotations

import os
from typing import Any

from worker.errors import DeviceCountError

DEVICES_ENV = "PJRT_POOL_DEVICES"
"""The devices a pool worker's client holds (the pool's devices_per_worker): set by the pool."""

SETTING = "devices_per_worker"
"""The Pool's setting that gives each worker more devices (named in refusals)."""


def cpu_client_options(devices: int) -> dict[str, Any]:
    """The CPU plugin's create options for a client of `devices` host devices."""
    return {"cpu_device_count": devices}


_CLIENT_OPTIONS = {"cpu": cpu_client_options}
"""Per platform, the client create options that give a client k devices (none: the
platform's client holds what the process sees)."""

GROWING_PLATFORMS = frozenset(_CLIENT_OPTIONS)
"""Platforms whose process can open a client of more devices when a program needs them."""


def fixed_devices() -> int | None:
    """The devices this process's client is given (DEVICES_ENV, set for pool workers), or None
    where nothing fixed them. Raises ValueError for a value that is not a positive count."""
    value = os.environ.get(DEVICES_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{DEVICES_ENV} must be a positive number of devices, not {value!r}")
    return int(value)


def device_options(platform: str, devices: int | None) -> dict[str, Any]:
    """The create options that give a client of `platform` this many devices (None: the
    platform's default, one host device on CPU)."""
    options = _CLIENT_OPTIONS.get(platform)
    return {} if options is None or devices is None else options(devices)


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
