"""The TPU generations: what each is called and how its chips lie. A new one is a row here.

A TPU cache key names the topology compiled for ("v5e:2x2", target.py), so
the generations sit at the floor of keys; the tpu platform reads them from
here (worker/plugin/platforms/tpu.py, through worker.plugin.libtpu, this
host's chips, and worker.plugin.topology, topology names), and nothing else
holds a table of them. Each row says a generation's names as libtpu takes
them in a topology name, the device kind libtpu reports of its chips, the
prefixes of Cloud TPU's accelerator types (TPU_ACCELERATOR_TYPE,
"v5litepod-4") that name it, how many axes its topology names give, and how
many chips of a slice Cloud TPU puts on one host.
"""

from __future__ import annotations

from typing import NamedTuple


class TpuGeneration(NamedTuple):
    """One TPU generation (see the module)."""

    names: tuple[str, ...]
    """The generation as libtpu takes it in a topology name ("v5e" in "v5e:2x2"); a name
    pjrt-pool writes is the first."""

    device_kind: str
    """What libtpu reports as its devices' kind ("TPU v5 lite")."""

    accelerator_types: tuple[str, ...]
    """The prefixes of Cloud TPU accelerator types that name it ("v5litepod" of
    "v5litepod-4")."""

    axes: int
    """The axes of its topology names: 3 (v4:2x2x1) or 2 (v5e:2x2)."""

    host_chips: int = 0
    """The chips of a slice that Cloud TPU puts on one host (8: v5litepod-8, v6e-8), where a
    topology of at most that many is one host of exactly its own chips; 0 where libtpu's
    default host bounds hold."""


GENERATIONS = (
    TpuGeneration(("v2",), "TPU v2", ("v2",), axes=2),
    TpuGeneration(("v3",), "TPU v3", ("v3",), axes=2),
    TpuGeneration(("v4",), "TPU v4", ("v4",), axes=3),
    TpuGeneration(("v5p",), "TPU v5", ("v5p",), axes=3),
    TpuGeneration(
        ("v5e", "v5litepod"), "TPU v5 lite", ("v5litepod", "v5lite", "v5e"), axes=2, host_chips=8
    ),
    TpuGeneration(("v6e",), "TPU v6 lite", ("v6e",), axes=2, host_chips=8),
)
"""Every TPU generation pjrt-pool knows by name."""


def generation_of_kind(kind: object) -> TpuGeneration | None:
    """The generation whose devices libtpu reports as `kind`, or None."""
    return next((g for g in GENERATIONS if g.device_kind == kind), None)


def generation_named(name: str) -> TpuGeneration | None:
    """The generation a topology name's generation part names (any case), or None."""
    return next((g for g in GENERATIONS if name.lower() in g.names), None)


def generation_of_accelerator(prefix: str) -> TpuGeneration | None:
    """The generation an accelerator type's prefix names ("v5litepod"), or None."""
    return next((g for g in GENERATIONS if prefix in g.accelerator_types), None)
