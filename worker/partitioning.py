"""What a program over several devices (SPMD) needs beyond its StableHLO: the Partitioning record.

A jax.jit with shardings over a Mesh, or a shard_map, lowers to one program
that XLA partitions over num_replicas x num_partitions devices. To compile it
the options must say so (worker.identity.options.spmd_compile_options); to
run it on global arrays, as jax.jit takes and returns them, each input is cut
into one block per device and each output put together from its devices'
blocks. The parent (with JAX) works the blocks out once, as JAX's
``Sharding.devices_indices_map`` gives them, and records them here, so that
no process without JAX parses a sharding: per input and output, for each
device of the program in device-assignment order, the block's start and stop
on each axis. A replicated block is on several devices; the first of them
(first_copies) is the one an output is copied from, once.

The record travels in LoweredProgram, ProgramSpec, cache entries, manifests
and bundles as JSON (to_json, from_json), with a format number; a record
without one (an old manifest, bundle or entry) is a program of one device.
Records come from files others may write, so from_json checks every field,
and the native module checks the blocks against the arrays again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from worker.identity.options import compile_options, spmd_compile_options

PARTITIONING_FORMAT = 1
"""Bumped whenever the meaning of the record's fields changes; other formats are refused."""

Block = tuple[tuple[int, int], ...]
"""One device's block of an array: (start, stop) on each axis."""


class ArraySharding(NamedTuple):
    """How one global input or output of a program is split over the program's devices."""

    shape: tuple[int, ...]
    """The global array's shape."""

    blocks: tuple[Block, ...]
    """Each device's block (device-assignment order): (start, stop) per axis."""

    spec: str = ""
    """The sharding as the parent's JAX wrote it (its PartitionSpec), for people."""

    def block_shape(self, device: int) -> tuple[int, ...]:
        """The shape of one device's block."""
        return tuple(stop - start for start, stop in self.blocks[device])

    def first_copies(self) -> tuple[int, ...]:
        """The devices that hold the first copy of each distinct block, in device order (a
        replicated output is copied from these only)."""
        seen: set[Block] = set()
        first = []
        for device, block in enumerate(self.blocks):
            if block not in seen:
                seen.add(block)
                first.append(device)
        return tuple(first)

    @property
    def replicated(self) -> bool:
        """Whether every device holds the whole array."""
        whole = tuple((0, n) for n in self.shape)
        return all(block == whole for block in self.blocks)

    def to_json(self) -> dict[str, Any]:
        """The sharding as JSON-ready data."""
        return {
            "shape": list(self.shape),
            "blocks": [[list(axis) for axis in block] for block in self.blocks],
            "spec": self.spec,
        }

    @classmethod
    def from_json(cls, data: Any, devices: int, what: str) -> ArraySharding:
        """Reads what to_json wrote; raises ValueError naming `what` for anything else."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{what} is not a sharding record")
        shape = _ints(data.get("shape"), f"{what}'s shape")
        raw = data.get("blocks")
        if not isinstance(raw, list) or len(raw) != devices:
            raise ValueError(f"{what} needs one block per device ({devices})")
        blocks = []
        for block in raw:
            if not isinstance(block, list) or len(block) != len(shape):
                raise ValueError(f"{what} has a block of another rank than its shape {shape}")
            axes = []
            for axis, (pair, size) in enumerate(zip(block, shape, strict=True)):
                start, stop = _ints(pair, f"{what}'s block on axis {axis}", length=2)
                if not 0 <= start <= stop <= size:
                    raise ValueError(f"{what} has a block outside its shape {shape}")
                axes.append((start, stop))
            blocks.append(tuple(axes))
        spec = data.get("spec", "")
        return cls(shape, tuple(blocks), spec if isinstance(spec, str) else "")


class Partitioning(NamedTuple):
    """What a program over several devices needs to compile and run (see the module)."""

    num_replicas: int
    """Replicas of the program (jax.jit: 1)."""

    num_partitions: int
    """Partitions of the program: the devices of its mesh."""

    device_ids: tuple[int, ...]
    """The devices it is compiled for, in device-assignment order (replica by replica)."""

    mesh: tuple[tuple[str, int], ...]
    """The mesh's axes, name and size, for people ("data=2 x model=4")."""

    shardy: bool
    """Whether the program is in Shardy's form, which XLA is told to partition with."""

    inputs: tuple[ArraySharding, ...]
    """How each input is split, in the program's input order."""

    outputs: tuple[ArraySharding, ...]
    """How each output is put together, in the program's output order."""

    @property
    def devices(self) -> int:
        """How many devices the program runs on."""
        return self.num_replicas * self.num_partitions

    def compile_options(self) -> bytes:
        """The serialized CompileOptionsProto the program compiles with (part of its key)."""
        return spmd_compile_options(
            self.num_replicas, self.num_partitions, self.device_ids, self.shardy
        )

    @property
    def mesh_text(self) -> str:
        """The mesh for people: "mesh data=2 x model=2"."""
        return "mesh " + (" x ".join(f"{name}={size}" for name, size in self.mesh) or "()")

    def describe(self) -> str:
        """For people: "4 devices (mesh data=2 x model=2)"."""
        return f"{self.devices} device{'' if self.devices == 1 else 's'} ({self.mesh_text})"

    def to_json(self) -> dict[str, Any]:
        """The record as JSON-ready data."""
        return {
            "format": PARTITIONING_FORMAT,
            "replicas": self.num_replicas,
            "partitions": self.num_partitions,
            "device_ids": list(self.device_ids),
            "mesh": [[name, size] for name, size in self.mesh],
            "shardy": self.shardy,
            "inputs": [a.to_json() for a in self.inputs],
            "outputs": [a.to_json() for a in self.outputs],
        }

    @classmethod
    def from_json(cls, data: Any) -> Partitioning:
        """Reads what to_json wrote; raises ValueError saying what is wrong with anything else
        (another format among them: made by another pjrt-pool)."""
        if not isinstance(data, Mapping):
            raise ValueError("a partitioning record must be a JSON object")
        if data.get("format") != PARTITIONING_FORMAT:
            raise ValueError(
                f"the partitioning record has format {data.get('format')!r}, and this pjrt-pool "
                f"reads format {PARTITIONING_FORMAT}: use the pjrt-pool that wrote it"
            )
        replicas, partitions = _ints([data.get("replicas"), data.get("partitions")], "counts", 2)
        ids = _ints(data.get("device_ids"), "device_ids")
        if replicas < 1 or partitions < 1 or len(ids) != replicas * partitions:
            raise ValueError(
                f"the partitioning record's {replicas} replicas x {partitions} partitions do not "
                f"match its {len(ids)} device ids"
            )
        mesh = data.get("mesh")
        if not isinstance(mesh, list) or not all(
            isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) for a in mesh
        ):
            raise ValueError("the partitioning record's mesh must be a list of [name, size]")
        shardy = data.get("shardy")
        if not isinstance(shardy, bool):
            raise ValueError("the partitioning record's shardy must be true or false")
        devices = len(ids)
        return cls(
            replicas,
            partitions,
            ids,
            tuple((name, _ints([size], f"mesh axis {name}", 1)[0]) for name, size in mesh),
            shardy,
            _arrays(data.get("inputs"), devices, "input"),
            _arrays(data.get("outputs"), devices, "output"),
        )

    def check_types(self, inputs: Sequence[Any] | None, outputs: Sequence[Any]) -> None:
        """Raises ValueError when the record's shapes are not those of the program's inputs
        and outputs (ArrayTypes; inputs None: unknown)."""
        pairs = [("output", self.outputs, outputs)]
        if inputs is not None:
            pairs.append(("input", self.inputs, inputs))
        for what, shardings, types in pairs:
            shapes = [tuple(t.shape) for t in types]
            if [s.shape for s in shardings] != shapes:
                raise ValueError(
                    f"the partitioning record's {what} shapes "
                    f"{[s.shape for s in shardings]} are not the program's {shapes}"
                )


def _ints(value: Any, what: str, length: int | None = None) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ValueError(f"{what} must be a list of non-negative integers, not {value!r}")
    if length is not None and len(value) != length:
        raise ValueError(f"{what} must have {length} entries, not {len(value)}")
    return tuple(value)


def _arrays(value: Any, devices: int, what: str) -> tuple[ArraySharding, ...]:
    if not isinstance(value, list):
        raise ValueError(f"the partitioning record's {what}s must be a list")
    return tuple(
        ArraySharding.from_json(item, devices, f"{what} {index}")
        for index, item in enumerate(value)
    )


def partitioning_from_json(data: Any) -> Partitioning | None:
    """A record's partitioning field: None (absent, as records before partitionings have it:
    a program of one device) or the record; raises ValueError for a bad one."""
    return None if data is None else Partitioning.from_json(data)


class _WithOptions(Protocol):
    """What compile_options_for reads of a program (a LoweredProgram)."""

    @property
    def compile_options(self) -> bytes | None: ...

    @property
    def partitioning(self) -> Partitioning | None: ...


def compile_options_for(program: _WithOptions, given: bytes | None = None) -> bytes:
    """The serialized compile options of a program: those given, else those it was lowered
    with (jax.jit's, LoweredProgram.compile_options), else derived from its partitioning
    (a program of one device: the default options, worker.identity.options)."""
    if given is not None:
        return given
    if program.compile_options is not None:
        return program.compile_options
    partitioning = program.partitioning
    return compile_options() if partitioning is None else partitioning.compile_options()


def devices_needed(partitioning: Partitioning | None) -> int:
    """How many devices a program needs (1 without a partitioning)."""
    return 1 if partitioning is None else partitioning.devices
