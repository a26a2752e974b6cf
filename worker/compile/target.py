"""What a compile is for: this process's device, or a topology without a device.

compile_program compiles for a Target and loads cache entries through it, so
that one protocol (cache, lock, remote tier) serves both:

    DeviceTarget     the client's first device (opened on first use): compiles
                     with PJRT_Client_Compile, loads by deserializing onto it
    TopologyTarget   a named topology (worker.plugin.topology): compiles with
                     PJRT_Compile and no client, opens no device, and "loads" an
                     entry by keeping its bytes (TopologyExecutable: it cannot run)

A target says what it puts into a cache key (worker.identity.target: the
plugin's platform version and device kind and, on platforms whose
executables are tied to a topology (TPU), the topology's key part). A device
target and a topology target whose devices match give the same key, so an
entry compiled on either side loads on the other (docs/facts.md, "TPU").
What a target compiles or loads is made knowing the key and the argument
types it is for (worker.compile.executable.compile_executable).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from worker.compile.executable import (
    Executable,
    TopologyExecutable,
    compile_executable,
    deserialize_executable,
)
from worker.errors import PjrtError
from worker.identity.keys import PlatformPart
from worker.identity.target import describe_part, device_fields, topology_fields
from worker.plugin.devices import too_few_devices
from worker.plugin.kernels import ensure_kernels_for, explain_missing_handler
from worker.plugin.platforms.registry import platform_named
from worker.plugin.topology import TopologySpec, parse_topology

if TYPE_CHECKING:
    from worker.partitioning import Partitioning
    from worker.plugin.runtime import Runtime
    from worker.records import ArrayType

    InputTypes = tuple[ArrayType, ...] | None
    OutputTypes = tuple[ArrayType, ...] | None


class MadeFor(NamedTuple):
    """What a target's executable is made for, whether compiled or loaded: the cache key it is
    known by, the argument types it takes (None: not known) and the devices of its
    partitioning (None: one). Every executable records them (worker.compile.executable)."""

    key: str
    input_types: InputTypes
    partitioning: Partitioning | None = None


class DeviceTarget:
    """The device of this process's client (what compile_program compiled for until topologies)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    @property
    def topology(self) -> str | None:
        """None: compiled on the device itself."""
        return None

    def key_fields(self) -> dict[str, Any]:
        """The key parts that say what this target is (worker.identity.target.device_fields)."""
        return device_fields(self.runtime)

    def check_devices(self, partitioning: Partitioning | None) -> None:
        """Raises DeviceCountError, before anything compiles, when the program needs more
        devices than a client here can hold (worker.plugin.runtime.Runtime.client_for)."""
        if partitioning is not None:
            self.runtime.client_for(partitioning.devices, partitioning.mesh_text)

    def compile(self, code: bytes, options: bytes, made_for: MadeFor) -> Executable:
        """Compiles on the client an executable for made_for."""
        return compile_executable(code, options, **made_for._asdict())

    def load(self, payload: bytes, output_types: OutputTypes, made_for: MadeFor) -> Executable:
        """Deserializes an entry's bytes onto the client (the plugin checks them)."""
        return deserialize_executable(payload, **made_for._asdict())


class TopologyTarget:
    """A topology compiled for without its devices (see the module)."""

    def __init__(self, runtime: Runtime, spec: TopologySpec) -> None:
        self.runtime = runtime
        self.spec = spec
        self.native = runtime.topology(spec)

    @property
    def topology(self) -> str:
        """The topology's name, as given."""
        return self.spec.name

    def key_fields(self) -> dict[str, Any]:
        """The key parts that say what this target is (worker.identity.target.topology_fields)."""
        return topology_fields(self.native)

    def check_devices(self, partitioning: Partitioning | None) -> None:
        """Raises DeviceCountError, before anything compiles, when the program needs more
        devices than the topology has."""
        chips = len(self.native.devices)
        if partitioning is not None and partitioning.devices > chips:
            raise too_few_devices(
                partitioning.devices,
                chips,
                partitioning.mesh_text,
                f"the topology {self.spec.name} has",
                f"compile it for a topology of {partitioning.devices} devices",
            )

    def compile(self, code: bytes, options: bytes, made_for: MadeFor) -> Executable:
        """Compiles for the topology with no client (PJRT_Compile)."""
        ensure_kernels_for(self.runtime, code)
        try:
            native = self.native.compile(code, options)
        except PjrtError as error:
            raise explain_missing_handler(error, self.runtime) from None
        return TopologyExecutable.compiled(
            self.runtime,
            self.spec.name,
            native,
            **made_for._asdict(),
        )

    def load(self, payload: bytes, output_types: OutputTypes, made_for: MadeFor) -> Executable:
        """Keeps an entry's bytes: nothing here can load them, and the key vouches for them.

        Raises ValueError when the entry did not record its output types.
        """
        if output_types is None:
            raise ValueError("the entry records no output types")
        key, input_types, partitioning = made_for
        return TopologyExecutable(
            self.runtime, self.spec.name, output_types, payload, input_types, key, partitioning
        )


Target = DeviceTarget | TopologyTarget
"""What compile_program compiles for."""


def target_for(runtime: Runtime, topology: str | TopologySpec | None) -> Target:
    """The target of a compile: the topology named, else the runtime's device."""
    if topology is None:
        return DeviceTarget(runtime)
    return TopologyTarget(runtime, parse_topology(topology))


def needs_topology_here(platform: str) -> bool:
    """Whether this host has no device of a platform whose executables are tied to a
    topology: what would load here can then only be judged for a topology named."""
    facts = platform_named(platform)
    return PlatformPart.TOPOLOGY in facts.platform_parts and facts.attached_devices() == 0


def describe_environment(parts: dict[str, Any]) -> str:
    """Key parts' environment for people: the platform, its plugin build and, for a topology's
    platform, the topology ("tpu, TFRT TPU v5 lite ..., plugin sha256 ff7fdcc8...")."""
    plugin = parts.get("plugin") if isinstance(parts.get("plugin"), dict) else {}
    version = " ".join(str(plugin.get("platform_version", "")).split())
    said = [str(parts.get("platform")), version, f"plugin sha256 {str(plugin.get('sha256'))[:12]}"]
    if "topology" in parts:
        said.insert(1, describe_part(parts["topology"]))
    return ", ".join(part for part in said if part)
