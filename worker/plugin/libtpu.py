"""What libtpu needs around it: its environment, the chips of this host, and its lock.

What libtpu does around it (docs/facts.md, "TPU"), on a TPU VM and on
machines without a chip:

- libtpu takes ``/tmp/libtpu_lockfile`` in ``PJRT_Plugin_Initialize`` in every
  process, chip or no chip, so a second process on the host fails to load it
  ("The TPU is already in use by process with pid N"). A process that only
  compiles sets ``ALLOW_MULTIPLE_LIBTPU_LOAD=true`` and never takes the lock,
  nor opens a chip (compile_only_environment).
- Where no TPU is attached, libtpu polls the GCE metadata server for its
  topology (about 30 s per key, then errors) unless ``TPU_SKIP_MDS_QUERY`` is
  set, and logs a screenful about the worker hostnames and the accelerator
  type it could not find; compile-only processes set all three there. libtpu
  reads them only as it initializes, and the accelerator type changes
  nothing a deviceless compile makes: it only names the host's default
  topology.
- The chip itself stays exclusive: a second opener gets "open(/dev/vfio/N): 16:
  Device or resource busy"; a killed holder frees it, and the next process had
  it 7-12 s after its start.

Everything here runs in worker-side processes and never imports JAX.
"""

from __future__ import annotations

import glob
import os
import re

from worker.identity.tpu_generations import generation_of_accelerator
from worker.plugin.topology import TopologySpec, parse_topology

ALLOW_MULTIPLE_LOAD_ENV = "ALLOW_MULTIPLE_LIBTPU_LOAD"
SKIP_METADATA_ENV = "TPU_SKIP_MDS_QUERY"
INIT_ARGS_ENV = "LIBTPU_INIT_ARGS"
"""libtpu's flags (as XLA_FLAGS for other plugins): part of the code-generation environment."""
ACCELERATOR_TYPE_ENV = "TPU_ACCELERATOR_TYPE"
WORKER_HOSTNAMES_ENV = "TPU_WORKER_HOSTNAMES"
VISIBLE_CHIPS_ENV = "TPU_VISIBLE_CHIPS"

_CHIP_DEVICES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
"""Where a TPU VM shows its chips: /dev/accelN (v4 and earlier), /dev/vfio/N (v5e and later)."""

_LAYOUTS_2D = {1: "1x1", 2: "1x2", 4: "2x2", 8: "2x4"}
_LAYOUTS_3D = {1: "1x1x1", 2: "1x1x2", 4: "2x2x1", 8: "2x2x2"}

_HOLDER = re.compile(r"in use by process with pid (\d+)")


def attached_chips() -> int:
    """The number of TPU chips this host shows (0 on a machine without any).

    TPU_VISIBLE_CHIPS, when set, limits them, as it limits libtpu.
    """
    found = {path for pattern in _CHIP_DEVICES for path in glob.glob(pattern)}
    visible = os.environ.get(VISIBLE_CHIPS_ENV, "").strip()
    if found and visible:
        return len([chip for chip in visible.split(",") if chip.strip()])
    return len(found)


def compile_only_environment() -> dict[str, str]:
    """The variables a process that only compiles for TPU sets before libtpu loads.

    ALLOW_MULTIPLE_LIBTPU_LOAD=true always (so that the host's lock stays
    free for the process that holds the chip); where no TPU is attached,
    TPU_SKIP_MDS_QUERY=1 and a worker hostname and accelerator type that keep
    libtpu from polling and logging (see the module). A variable the user
    set is left as it is.
    """
    wanted = {ALLOW_MULTIPLE_LOAD_ENV: "true"}
    if attached_chips() == 0:
        wanted[SKIP_METADATA_ENV] = "1"
        wanted[WORKER_HOSTNAMES_ENV] = "localhost"
        wanted[ACCELERATOR_TYPE_ENV] = "v5litepod-4"
    return {name: value for name, value in wanted.items() if name not in os.environ}


def host_topology(chips: int | None = None) -> TopologySpec | None:
    """The topology of this TPU host's chips (or of `chips` of them), or None off a TPU host.

    The generation comes from TPU_ACCELERATOR_TYPE ("v5litepod-4" -> v5e, by
    worker.identity.tpu_generations; a "vN" it does not know, as itself), the
    layout from the number of chips: 1x1, 1x2, 2x2 or 2x4 (1x1x1 ... 2x2x2
    for generations of three axes, v4 and v5p). None when either is unknown;
    a device worker then reports its client's own topology, which is exact.
    """
    count = attached_chips() if chips is None else chips
    accelerator = os.environ.get(ACCELERATOR_TYPE_ENV, "").strip().lower()
    prefix = accelerator.split("-", 1)[0]
    known = generation_of_accelerator(prefix)
    if known is not None:
        generation, axes = known.names[0], known.axes
    else:
        generation, axes = (prefix if re.fullmatch(r"v[0-9]+", prefix) else ""), 2
    if count == 0 or not generation:
        return None
    layouts = _LAYOUTS_3D if axes == 3 else _LAYOUTS_2D
    layout = layouts.get(count)
    return None if layout is None else parse_topology(f"{generation}:{layout}")


def lock_holder(message: str) -> int | None:
    """The pid libtpu names as the holder of the host's TPU, from its error message."""
    match = _HOLDER.search(message)
    return int(match.group(1)) if match else None
