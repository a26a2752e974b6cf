"""Topologies: the devices a program is compiled for, named without holding them.

A plugin that implements ``PJRT_TopologyDescription_Create`` and ``PJRT_Compile``
(libtpu does) compiles for a named topology on a machine with no such device,
beside a process that holds the chip, or in CI: that is a deviceless compile,
whose executable loads on a client whose devices form the same topology.

A TopologySpec names one as libtpu takes it, ``GENERATION:AxB[xC]`` (``v5e:1x1``,
``v5e:2x2``, ``v6e:2x4``, ``v4:2x2x1``), with the plugin's create options.
libtpu lays a topology over hosts of ``chips_per_host_bounds`` chips (2x2x1 by
default) and refuses one that does not divide evenly ("Topology layout
v5e:1x1 is not divisible by the given (or default) chips_per_host_bounds
2x2x1"), so parse_topology derives the bounds a name needs: a topology that
fills no whole default host, and a slice that Cloud TPU VMs put on one host
(a v5e or v6e of at most 8 chips: v5litepod-8, v6e-8; TpuGeneration.host_chips
in worker.identity.tpu_generations), is one host of exactly its own chips.
Options given explicitly win over derived ones.

What a compile for a topology puts in a cache key is the plugin's serialized
topology, with its name, chips and kind read off the devices:
worker.identity.target.topology_part.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from worker.identity.tpu_generations import generation_named

OptionValue = str | int | float | bool | tuple[int, ...]
"""A create option's value, as PJRT_NamedValue carries it."""

_NAME = re.compile(r"^(?P<generation>[A-Za-z0-9_ ]+)[=_:](?P<layout>[0-9]+(?:x[0-9]+){1,2})$")

_DEFAULT_HOST = (2, 2, 1)
"""libtpu's chips_per_host_bounds when none is given."""

HOST_BOUNDS = "chips_per_host_bounds"
"""libtpu's create option: the chips of one host along each axis."""


class TopologySpec(NamedTuple):
    """A topology to compile for, named as the plugin takes it, with its create options."""

    name: str
    """The topology's name, for libtpu GENERATION:AxB[xC] such as "v5e:2x2"."""

    options: tuple[tuple[str, OptionValue], ...] = ()
    """The plugin's create options, sorted by name (derived and given)."""

    def create_options(self) -> dict[str, Any]:
        """The create options as the native Topology.create takes them."""
        return {name: _json_value(value) for name, value in self.options}

    def __str__(self) -> str:
        if not self.options:
            return self.name
        shown = ", ".join(
            f"{name}={','.join(map(str, value)) if isinstance(value, tuple) else value}"
            for name, value in self.options
        )
        return f"{self.name} ({shown})"

    def to_json(self) -> dict[str, Any]:
        """The spec as JSON-ready data (for the wire to a worker)."""
        return {"name": self.name, "options": [[name, _json_value(v)] for name, v in self.options]}

    @classmethod
    def from_json(cls, data: Any) -> TopologySpec:
        """A spec from to_json's data; raises ValueError for anything else."""
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise ValueError(f"not a topology: {data!r}")
        options = data.get("options", [])
        if not isinstance(options, list) or not all(
            isinstance(o, list) and len(o) == 2 and isinstance(o[0], str) for o in options
        ):
            raise ValueError(f"not topology options: {options!r}")
        return parse_topology(data["name"], {name: value for name, value in options})


def _json_value(value: OptionValue) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _option_value(name: str, value: Any) -> OptionValue:
    """A create option's value as a hashable OptionValue; refuses other kinds."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise TypeError(
        f"topology option {name}={value!r}: a value must be a str, int, float, bool or a "
        "list of ints"
    )


def layout_of(name: str) -> tuple[str, tuple[int, int, int]]:
    """A topology name's generation and chip layout padded to three axes ("v5e:2x2" ->
    ("v5e", (2, 2, 1))); raises ValueError for a name libtpu would not take."""
    match = _NAME.match(name.strip())
    if match is None:
        raise ValueError(
            f"{name!r} is not a topology name: name one as GENERATION:AxB or GENERATION:AxBxC, "
            "for example v5e:1x1, v5e:2x2, v6e:2x4 or v4:2x2x1"
        )
    dims = [int(d) for d in match.group("layout").split("x")]
    if any(d < 1 for d in dims):
        raise ValueError(f"{name!r}: every axis of a topology needs at least one chip")
    padded = [*dims, 1, 1][:3]
    return match.group("generation"), (padded[0], padded[1], padded[2])


def derived_options(name: str) -> dict[str, OptionValue]:
    """The create options a topology name needs that libtpu does not derive itself."""
    generation, dims = layout_of(name)
    chips = dims[0] * dims[1] * dims[2]
    fills_hosts = all(d % h == 0 for d, h in zip(dims, _DEFAULT_HOST, strict=True))
    known = generation_named(generation)
    one_host = known is not None and chips <= known.host_chips
    if not fills_hosts or one_host:
        return {HOST_BOUNDS: dims}
    return {}


def parse_topology(
    value: str | TopologySpec, options: Mapping[str, Any] | None = None
) -> TopologySpec:
    """Returns the TopologySpec of a name (or a spec), with the options it needs.

    options are create options that override the derived ones (see the
    module), for example {"chips_per_host_bounds": [2, 2, 1]}. Raises
    ValueError for a name that is not a topology name and TypeError for an
    option of another kind than PJRT_NamedValue carries.
    """
    if isinstance(value, TopologySpec):
        merged: dict[str, Any] = dict(value.options)
        name = value.name
    elif isinstance(value, str):
        name = value.strip()
        merged = dict(derived_options(name))
    else:
        raise TypeError(f"a topology is a name such as 'v5e:1x1' or a TopologySpec, not {value!r}")
    layout_of(name)
    for option, given in (options or {}).items():
        merged[option] = _option_value(option, given)
    return TopologySpec(name, tuple(sorted(merged.items())))
