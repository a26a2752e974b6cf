"""Stamping serialized executables with the plugin build and host that made them.

A plugin does not always refuse an executable serialized by another build:
measured here, the 0.81 CPU plugin loads one from the 0.115 plugin and runs
it, silently returning zeros. So Executable.serialize appends a record naming
the plugin (library SHA-256, API version) and, on CPU, the host's CPU
features, and Executable.deserialize refuses a stamp from another build or
host with a clear error.

The record is an extra length-delimited protobuf field with a field number
XLA does not use. Serialized executables are protobuf messages
(ExecutableAndOptionsProto), whose parsers skip unknown fields, so the
stamped bytes are still the plugin's serialized form and load in any PJRT
client; bytes without a stamp load unchecked.
"""

from __future__ import annotations

import json
from typing import Any

STAMP_FIELD = 536_870_000
"""Protobuf field number of the stamp (near the top of the 29-bit range)."""

_STAMP_TAG_WIRE_TYPE = 2  # length-delimited


class ForeignExecutableError(ValueError):
    """A serialized executable was made by another plugin build or for another host."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _read_varint(data: bytes | memoryview, offset: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if offset >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, offset
        shift += 7


def stamp(serialized: bytes, identity: dict[str, Any]) -> bytes:
    """Returns serialized bytes with an identity record appended."""
    record = json.dumps({"pjrt_pool": 1, **identity}, sort_keys=True).encode()
    tag = _varint((STAMP_FIELD << 3) | _STAMP_TAG_WIRE_TYPE)
    return serialized + tag + _varint(len(record)) + record


def read_stamp(serialized: bytes | memoryview) -> dict[str, Any] | None:
    """Returns the identity record of stamped bytes, or None (unstamped or not protobuf)."""
    data = memoryview(serialized)
    offset = 0
    found = None
    try:
        while offset < len(data):
            tag, offset = _read_varint(data, offset)
            field, wire_type = tag >> 3, tag & 7
            if wire_type == 0:
                _, offset = _read_varint(data, offset)
            elif wire_type == 1:
                offset += 8
            elif wire_type == 5:
                offset += 4
            elif wire_type == 2:
                length, offset = _read_varint(data, offset)
                if field == STAMP_FIELD:
                    found = json.loads(bytes(data[offset : offset + length]))
                offset += length
            else:
                return None  # groups or garbage: not a message this module wrote to
        if offset != len(data):
            return None
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def check_stamp(serialized: bytes | memoryview, identity: dict[str, Any]) -> None:
    """Raises ForeignExecutableError if the bytes are stamped by another plugin build or host."""
    found = read_stamp(serialized)
    if found is None:
        return
    differing = [name for name, value in identity.items() if name in found and found[name] != value]
    if differing:
        details = "; ".join(
            f"{name}: made with {found[name]!r}, this process has {identity[name]!r}"
            for name in differing
        )
        raise ForeignExecutableError(
            "this executable was serialized by another PJRT plugin build or for another "
            f"host ({details}); executables load only where they were compiled: compile "
            "the program again here"
        )
