"""Keeping the parent's JAX off a device that a worker must hold.

Lowering traces with JAX, and JAX initializes its backends the first time
anything needs a device (jax.export asks for the default device even with
its platforms given). On a TPU host that opens the chip in the parent
(docs/facts.md, "JAX takes the chip"), and one process at a time may hold a
chip, so the pool's device worker could then never have it.

So lowering for a platform whose devices one process at a time may hold
(DeviceAccess.EXCLUSIVE in worker.plugin.platforms: "tpu") in a process whose
JAX has not initialized its backends yet, and whose platforms nobody chose
(no JAX_PLATFORMS, and jax_platforms unset or as JAX sets it itself when
imported on a Cloud TPU VM: "tpu,cpu"), first sets jax_platforms to "cpu":
that process's JAX then runs on the CPU, and the chip stays free for the
workers. A process that chose its platforms keeps them (and if it holds the
chip itself, the pool's device worker says that this process holds it).
"""

from __future__ import annotations

import os

import jax

from worker.log import get_logger
from worker.plugin.platforms.platform import DeviceAccess
from worker.plugin.platforms.registry import platform_named

logger = get_logger("pjrt_pool.lower")

JAX_CLOUD_TPU_DEFAULT = "tpu,cpu"
"""What JAX sets jax_platforms to, as it is imported on a Cloud TPU VM, when nobody set it
(jax/_src/cloud_tpu_init.py): not a choice of the process's."""


def _backends_initialized() -> bool:
    """Whether JAX has initialized its backends (private in JAX: assumed so if it moved)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True


def leave_devices_to_workers(platform: str) -> None:
    """Sets this process's JAX to the CPU before lowering for an exclusive platform (see the
    module), unless its backends are up or its platforms were chosen."""
    exclusive = platform_named(platform).device_access is DeviceAccess.EXCLUSIVE
    if not exclusive or os.environ.get("JAX_PLATFORMS"):
        return
    if jax.config.jax_platforms not in (None, "", JAX_CLOUD_TPU_DEFAULT):
        return
    if _backends_initialized():
        return
    jax.config.update("jax_platforms", "cpu")
    logger.info(
        "lowering for %r: this process's JAX is set to the CPU (jax_platforms='cpu') so that "
        "the %s device stays free for the pool's device workers; set JAX_PLATFORMS to choose "
        "otherwise",
        platform,
        platform,
    )
