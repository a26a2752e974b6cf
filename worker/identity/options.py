"""The compile options part of a key: the serialized options a program compiles with.

A program of one device compiles with the default options (one replica, one
partition). A program over several devices (SPMD: a jax.jit with shardings
over a Mesh, a shard_map) compiles with options derived from it, as
``jax.jit(...).lower().compile()`` derives them (jax._src.compiler.
get_compile_options): its replicas and partitions, SPMD partitioning, the
Shardy partitioner when the program is in Shardy's form, its device
assignment, and no sharding propagation to parameters or outputs (the
program's boundaries are all annotated). spmd_compile_options encodes those
fields of XLA's CompileOptionsProto itself (xla/pjrt/proto/compile_options.proto,
xla/xla_data.proto's DeviceAssignmentProto), byte for byte as jaxlib
serializes them, since no process here may import JAX; the options are part
of the cache key, so the same program for 4 and for 8 devices, or for two
device assignments, has two keys.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any


@functools.cache
def compile_options() -> bytes:
    """Returns the serialized CompileOptionsProto for one replica and one partition."""
    # executable_build_options (field 3) { num_replicas (4): 1, num_partitions (5): 1 }
    return bytes.fromhex("1a0420012801")


def checked_compile_options(options: Any) -> bytes | None:
    """Returns compile options as given (None: the default ones); refuses what is not bytes."""
    if options is None or isinstance(options, bytes):
        return options
    raise TypeError("compile_options must be bytes (a serialized CompileOptionsProto)")


def options_or_default(options: bytes | None) -> bytes:
    """The serialized compile options to use: the given ones, else the default."""
    return compile_options() if options is None else options


# Field numbers of xla.ExecutableBuildOptionsProto (CompileOptionsProto's field 3).
_BUILD_OPTIONS = 3
_DEBUG_OPTIONS = 3
_NUM_REPLICAS = 4
_NUM_PARTITIONS = 5
_USE_SPMD_PARTITIONING = 6
_DEVICE_ASSIGNMENT = 9
_PROPAGATE_TO_OUTPUT = 12
_PROPAGATE_TO_PARAMETERS = 18
_USE_SHARDY = 19
# xla.DeviceAssignmentProto: replica_count, computation_count, and per computation
# (partition) its ComputationDevice { repeated int64 replica_device_ids = 1 (packed) }.
_REPLICA_COUNT = 1
_COMPUTATION_COUNT = 2
_COMPUTATION_DEVICES = 3
_REPLICA_DEVICE_IDS = 1

_VARINT = 0
_LENGTH = 2


def varint(value: int) -> bytes:
    """A protobuf varint (a negative int64 as protobuf writes it: ten bytes)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _number(field: int, value: int) -> bytes:
    return varint(field << 3 | _VARINT) + varint(value)


def _message(field: int, payload: bytes) -> bytes:
    return varint(field << 3 | _LENGTH) + varint(len(payload)) + payload


def spmd_compile_options(
    num_replicas: int, num_partitions: int, device_ids: Sequence[int], shardy: bool
) -> bytes:
    """Returns the serialized CompileOptionsProto of a program over several devices.

    device_ids are the devices of its device assignment, replica by replica
    and, within one, partition by partition (num_replicas x num_partitions of
    them: the order of the mesh's devices). shardy says whether the program
    is in Shardy's form (sdy dialect), which XLA must then be told to
    partition with. Raises ValueError for counts that do not fit the ids.
    """
    if num_replicas < 1 or num_partitions < 1 or len(device_ids) != num_replicas * num_partitions:
        raise ValueError(
            f"{num_replicas} replicas x {num_partitions} partitions need as many device ids, "
            f"not {len(device_ids)}"
        )
    ids = [int(i) for i in device_ids]
    computations = b"".join(
        _message(
            _COMPUTATION_DEVICES,
            _message(
                _REPLICA_DEVICE_IDS,
                b"".join(varint(ids[r * num_partitions + p]) for r in range(num_replicas)),
            ),
        )
        for p in range(num_partitions)
    )
    assignment = (
        _number(_REPLICA_COUNT, num_replicas)
        + _number(_COMPUTATION_COUNT, num_partitions)
        + computations
    )
    build = (
        _number(_NUM_REPLICAS, num_replicas)
        + _number(_NUM_PARTITIONS, num_partitions)
        + _number(_USE_SPMD_PARTITIONING, 1)
        + _message(_DEVICE_ASSIGNMENT, assignment)
        + _message(_PROPAGATE_TO_OUTPUT, b"\x00")
        + _message(_PROPAGATE_TO_PARAMETERS, b"\x00")
        + (_number(_USE_SHARDY, 1) if shardy else b"")
    )
    return _message(_BUILD_OPTIONS, build)


def read_varint(data: bytes | memoryview, index: int) -> tuple[int, int]:
    """The protobuf varint at data[index:] and the index after it; raises ValueError if cut
    short."""
    value = shift = 0
    while True:
        if index >= len(data) or shift > 63:
            raise ValueError("a truncated varint")
        byte = data[index]
        index += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, index


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """A serialized message's fields, in order: (number, value) for varints and length-
    delimited fields (what these options use); raises ValueError for anything else."""
    found: list[tuple[int, int | bytes]] = []
    index = 0
    while index < len(data):
        tag, index = read_varint(data, index)
        number, kind = tag >> 3, tag & 7
        if kind == _VARINT:
            value, index = read_varint(data, index)
            found.append((number, value))
        elif kind == _LENGTH:
            size, index = read_varint(data, index)
            if index + size > len(data):
                raise ValueError("a truncated field")
            found.append((number, data[index : index + size]))
            index += size
        else:
            raise ValueError(f"a field of wire type {kind}")
    return found


def _packed(data: bytes) -> list[int]:
    """The values of a packed repeated varint field."""
    values, index = [], 0
    while index < len(data):
        value, index = read_varint(data, index)
        values.append(value)
    return values


def assignment_device_ids(serialized: bytes) -> list[int]:
    """The device ids of a serialized DeviceAssignmentProto, replica by replica and, within one,
    partition by partition (the order spmd_compile_options writes them in). Raises ValueError
    for bytes that are not one."""
    fields = _fields(serialized)
    replicas = next((v for n, v in fields if n == _REPLICA_COUNT and isinstance(v, int)), 0)
    columns: list[list[int]] = []
    for number, value in fields:
        if number == _COMPUTATION_DEVICES and isinstance(value, bytes):
            column: list[int] = []
            for inner, ids in _fields(value):
                if inner == _REPLICA_DEVICE_IDS:
                    column.extend(_packed(ids) if isinstance(ids, bytes) else [ids])
            columns.append(column)
    return [column[r] for r in range(replicas) for column in columns if r < len(column)]


def _message_field(data: bytes, field: int) -> bytes | None:
    """The last length-delimited field of that number in a serialized message, or None
    (also for bytes that are no message, as far as _fields reads one)."""
    try:
        fields = _fields(data)
    except ValueError:
        return None
    found = [value for number, value in fields if number == field and isinstance(value, bytes)]
    return found[-1] if found else None


def debug_options_of(options: bytes) -> bytes | None:
    """The serialized XLA debug options serialized compile options carry
    (ExecutableBuildOptionsProto field 3), or None: JAX's always carry them, compile_options()
    does not, and XLA then compiles with every debug option at zero, which jaxlib's own
    client honours literally (worker.plugin.jaxlib_cpu puts jaxlib's defaults under them)."""
    build = _message_field(bytes(options), _BUILD_OPTIONS)
    return None if build is None else _message_field(build, _DEBUG_OPTIONS)


def with_debug_options(options: bytes, debug_options: bytes) -> bytes:
    """Serialized compile options with debug options under their own: a protobuf message read
    after another merges into it, so what `options` set of them wins, and nothing else
    changes (options without replicas stay without them)."""
    return _message(_BUILD_OPTIONS, _message(_DEBUG_OPTIONS, debug_options)) + bytes(options)
