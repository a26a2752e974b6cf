"""What a runtime and a compile's target put into a key, and the key parts of a program here.

A target (worker.compile.target) is what a compile is for: this process's
device, or a topology without its devices. Either says the plugin's platform
version and device kind and, on platforms whose executables are tied to a
topology (TPU), the topology's part (topology_part): the plugin's serialized
topology, which the PJRT C API says is "for use in cache keys". A client's
topology of its one chip serializes to exactly the bytes of a deviceless
``v5e:1x1`` made on a machine without one (docs/facts.md, "TPU"), so a
device target and a topology target whose devices match give the same key,
and an entry compiled on either side hits on the other. The part also says the
topology's name, the chips' bounds and their kind, all read off the devices
(so they are the same on both sides), for people reading a key or a miss,
and for ``pjrt-pool bundle check`` on a machine without the devices.

runtime_key_parts puts a runtime's plugin build, options and environment
together with a target's fields (keys.key_parts).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Protocol

from worker.identity.keys import PlatformPart, key_parts
from worker.identity.options import options_or_default
from worker.identity.tpu_generations import generation_of_kind


class Topology(Protocol):
    """What a key reads of a topology (the native module's Topology)."""

    @property
    def devices(self) -> list[dict[str, Any]]:
        """Each device's kind and attributes (its coords among them)."""

    @property
    def platform_version(self) -> str:
        """The plugin's platform version for the topology."""

    def serialize(self) -> bytes:
        """The plugin's serialized topology."""


class KeyTarget(Protocol):
    """What a key reads of a target (worker.compile.target)."""

    def key_fields(self) -> dict[str, Any]:
        """platform_version, device_kind and topology (None where the platform has none)."""


class KeyRuntime(Protocol):
    """What a key reads of a runtime (worker.plugin.runtime.Runtime)."""

    platform: str
    api_version: str
    client_options: dict[str, Any]
    codegen_environment: dict[str, Any]

    @property
    def platform_parts(self) -> frozenset[PlatformPart]:
        """The key parts the platform's executables have beside the common ones."""

    @property
    def client(self) -> Any:
        """The client: its platform_version and device_kind."""

    def device_topology(self) -> Topology:
        """The topology of the client's devices."""

    def plugin_sha256(self, memos: Callable[[], Any] | None = None) -> str:
        """The plugin library's SHA-256 (worker.plugin.build_identity)."""


class WithMemos(Protocol):
    """A cache whose plugins/ records keep a hashed plugin's digest (worker.cache.DiskCache)."""

    memos: Any


def device_fields(runtime: KeyRuntime) -> dict[str, Any]:
    """The key fields of a compile on the runtime's device (whose client this opens)."""
    client = runtime.client
    tied = PlatformPart.TOPOLOGY in runtime.platform_parts
    topology = topology_part(runtime.device_topology()) if tied else None
    return {
        "platform_version": client.platform_version,
        "device_kind": client.device_kind,
        "topology": topology,
    }


def topology_fields(topology: Topology) -> dict[str, Any]:
    """The key fields of a compile for a topology without its devices."""
    devices = topology.devices
    return {
        "platform_version": topology.platform_version,
        "device_kind": devices[0]["kind"] if devices else "",
        "topology": topology_part(topology),
    }


def runtime_key_parts(
    runtime: KeyRuntime,
    cache: WithMemos | None,
    text: str = "",
    options: bytes | None = None,
    target: KeyTarget | None = None,
) -> dict[str, Any]:
    """Returns the key parts of a program text on this process's plugin and host.

    With the default empty text, what is left describes the runtime alone
    (plugin build, options, host), to compare with an entry's parts. options
    are the serialized compile options (default: compile_options()). target
    is what the program is compiled for (worker.compile.target; default: the
    runtime's device, whose client this opens). The plugin's digest comes
    from its installed RECORD, or is hashed and memoized in the cache's
    plugins/ folder, or without a cache in the default cache directory's, if
    that exists (Runtime.plugin_sha256).
    """
    fields = device_fields(runtime) if target is None else target.key_fields()
    digest = (
        runtime.plugin_sha256(lambda: cache.memos) if cache is not None else runtime.plugin_sha256()
    )
    return key_parts(
        text=text,
        platform=runtime.platform,
        plugin_sha256=digest,
        api_version=runtime.api_version,
        platform_version=fields["platform_version"],
        device_kind=fields["device_kind"],
        compile_options=options_or_default(options),
        client_options=runtime.client_options,
        environment=runtime.codegen_environment,
        topology=fields["topology"],
        platform_parts=runtime.platform_parts,
    )


def topology_part(topology: Topology) -> dict[str, Any]:
    """What a compile for this topology puts in its cache key (see the module)."""
    devices = topology.devices
    kinds = sorted({d["kind"] for d in devices})
    return {
        "name": topology_name(devices),
        "chips": _bounds(devices),
        "device_kind": ", ".join(kinds),
        "devices": len(devices),
        "sha256": hashlib.sha256(topology.serialize()).hexdigest(),
    }


def describe_part(part: Any) -> str:
    """A topology key part for people: "v5e:2x2 (TPU v5 lite, 2x2x1 chips, 4 devices)"."""
    if not isinstance(part, dict):
        return "no topology"
    return (
        f"{part.get('name') or 'a topology'} ({part.get('device_kind')}, "
        f"{part.get('chips')} chips, {part.get('devices')} devices)"
    )


def topology_name(devices: list[dict[str, Any]]) -> str | None:
    """The name a topology of these devices has as libtpu takes it ("v5e:2x2"), or None when
    their kind or layout says none. The same devices give the same name, whether they are
    a deviceless topology's or a client's."""
    kinds = {d.get("kind") for d in devices}
    generation = generation_of_kind(kinds.pop()) if len(kinds) == 1 else None
    bounds = _bounds(devices)
    if generation is None or "x" not in bounds:
        return None
    axes = bounds.split("x")
    if generation.axes == 2 and len(axes) == 3 and axes[2] == "1":
        axes = axes[:2]
    return f"{generation.names[0]}:{'x'.join(axes)}"


def _bounds(devices: list[dict[str, Any]]) -> str:
    """The chips' bounding box along each axis ("2x2x1"), from the devices' coords."""
    coords = [d.get("attributes", {}).get("coords") for d in devices]
    if not coords or any(not isinstance(c, tuple) or not c for c in coords):
        return f"{len(devices)} devices"
    axes = len(coords[0])
    return "x".join(str(max(c[axis] for c in coords) + 1) for axis in range(axes))
