"""``tpu``: libtpu, on Cloud TPU chips; what libtpu needs around it is worker.plugin.libtpu.

- Plugin: ``libtpu`` (``pjrt-pool[tpu]``, the libtpu of the installed jax).
- Generations (v2 ... v6e): one table, worker.identity.tpu_generations, at the floor
  of keys because a TPU key names its topology ("v5e:2x2"); a new generation is a row
  there, which this platform (its host's topology, topology names) reads.
- Compile-only processes load it without the host's lock and without polling
  for a topology (libtpu.compile_only_environment); a process that needs the
  chip where none is attached is told so at once, before libtpu polls a
  metadata server for minutes.
- Keys: LIBTPU_INIT_ARGS's code flags (libtpu's XLA_FLAGS) and the topology
  compiled for, the same whether compiled on the chips or for a named
  topology without them (worker.identity.target).
- Devices: one process at a time may hold a chip, so a pool has compile
  workers without chips and one device worker per chip, the parent's JAX
  keeps off the chips while lowering, and check-plugin computes JAX's side in
  a process of its own. A device worker is given its chip by
  TPU_VISIBLE_CHIPS (chosen among those this process sees) as a job of one
  process of one chip (TPU_CHIPS_PER_PROCESS_BOUNDS, TPU_PROCESS_BOUNDS), as
  JAX's multi-process TPU tests set them. Which k chips of a host form one
  process's block of chips is not known yet (docs/facts.md, "Blocks of
  chips"), so a worker has one chip or all of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType

from worker.errors import DeviceUnavailableError
from worker.identity.keys import PlatformPart
from worker.plugin import libtpu
from worker.plugin.platforms.platform import (
    NO_SETTINGS,
    NOTHING,
    DeviceAccess,
    DeviceSettings,
    Platform,
    PluginPackage,
    visible_devices,
)
from worker.plugin.topology import TopologySpec

CHIPS_PER_PROCESS_ENV = "TPU_CHIPS_PER_PROCESS_BOUNDS"
PROCESS_BOUNDS_ENV = "TPU_PROCESS_BOUNDS"


def chip_settings(
    count: int, first: int, attached: int, environ: Mapping[str, str]
) -> DeviceSettings:
    """The settings that give a process `count` chips from chip `first` of a host that shows
    `attached` (environ: this process's variables, whose TPU_VISIBLE_CHIPS, when set, lists
    them); raises ValueError for chips the host does not show, and for more than one chip
    but fewer than all (see the module)."""
    if attached and first + count > attached:
        raise ValueError(
            f"this host shows {attached} TPU chip(s): a worker cannot have {count} from chip "
            f"{first}"
        )
    if first == 0 and count >= attached:
        return NO_SETTINGS  # the whole host (or a host of one chip, or none): nothing to choose
    if count != 1:
        raise ValueError(
            f"a TPU worker has one chip or all {attached} of this host, not {count}: which "
            "chips of a host form one process's block is not known yet"
        )
    chip = visible_devices(libtpu.VISIBLE_CHIPS_ENV, 1, first, environ)
    environment = {
        libtpu.VISIBLE_CHIPS_ENV: chip,
        CHIPS_PER_PROCESS_ENV: "1,1,1",
        PROCESS_BOUNDS_ENV: "1,1,1",
    }
    return DeviceSettings(NOTHING, MappingProxyType(environment))


class Tpu(Platform):
    """libtpu (see the module)."""

    __slots__ = ()

    name = "tpu"
    jax_names = ("tpu",)
    packages = (PluginPackage("libtpu", "libtpu", "libtpu.so", "tpu", versioned_as_jax=False),)
    flag_variables = (libtpu.INIT_ARGS_ENV,)
    platform_parts = frozenset({PlatformPart.TOPOLOGY})
    device_access = DeviceAccess.EXCLUSIVE
    # The chip reads its inputs from host memory itself: a copy that left them in the
    # CPU's caches gains it nothing, and a streamed one is quicker (docs/facts.md,
    # "Inputs read by the chip").
    input_stream_bytes = 1 << 20

    def compile_only_environment(self) -> dict[str, str]:
        """libtpu without the host's lock or a metadata server (libtpu.compile_only_environment)."""
        return libtpu.compile_only_environment()

    def before_load(self, plugin_path: str, *, deviceless: bool) -> None:
        """Says at once that no chip is attached, where a process needs one: libtpu would
        poll a metadata server for minutes first."""
        if not deviceless and libtpu.attached_chips() == 0:
            error = self.unavailable(RuntimeError("no TPU chip in /dev"))
            assert error is not None
            raise error

    def unavailable(self, error: Exception) -> DeviceUnavailableError | None:
        """No chip here, or the chip held by another process (libtpu names it), else the
        default's reading."""
        message = str(error)
        if libtpu.attached_chips() == 0:
            # Whatever libtpu says then (no device, or its lock taken by a process
            # whose JAX loaded it): there is no chip here to run on.
            return DeviceUnavailableError(
                f"no {self.name} device is attached to this machine ({message}): compile for a "
                "topology without one (compile_program(..., topology='v5e:1x1'), "
                "Pool(topology=...), pjrt-pool warm --platform tpu --topology v5e:1x1) and run "
                "where the device is"
            )
        holder = libtpu.lock_holder(message)
        if holder is not None or "lockfile" in message:
            who = f"process {holder}" if holder is not None else "another process"
            return DeviceUnavailableError(
                f"the TPU of this host is held by {who} ({message}); one process at a time may "
                "hold a chip: end that process, or compile beside it without the chip "
                "(compile_program(..., topology=...), a Pool's compile workers)",
                holder=holder,
            )
        return super().unavailable(error)

    def attached_devices(self) -> int | None:
        """The chips this host shows (libtpu.attached_chips)."""
        return libtpu.attached_chips()

    def host_topology(self, devices: int) -> TopologySpec | None:
        """The topology of `devices` chips of this host (libtpu.host_topology)."""
        return libtpu.host_topology(chips=devices)

    def given_devices(self, count: int, first: int) -> DeviceSettings:
        """A chip of the host, or all of them (chip_settings)."""
        return chip_settings(count, first, libtpu.attached_chips(), os.environ)


PLATFORM = Tpu()
