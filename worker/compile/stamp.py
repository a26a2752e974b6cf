"""Stamps that older versions appended to serialized executables, read and removed.

A plugin does not always refuse an executable serialized by another build:
the 0.81 CPU plugin loads one from the 0.115 plugin and runs it, silently
returning zeros (docs/facts.md, "CPU plugins"). pjrt-pool 0.1 before the TPU work appended a
record naming the plugin (library SHA-256, API version) and, on CPU, the
host's CPU features to the bytes Executable.serialize returned, as an extra
length-delimited protobuf field with a field number XLA does not use.

libtpu refuses such bytes ("TpuExecutable proto deserialization failed:
found leftover bytes after parsing all submessages"), so executables are now
serialized and stored exactly as the plugin gives them, and what ties them to
a plugin build and host lives beside them: in a cache entry's key parts
(which hash to its key, under its digest and MAC) and a bundle's index, both
checked before anything loads. Bytes stamped by an older version, in an
existing cache or bundle, are still checked against this process and loaded
without the stamp (split_stamp, check_stamp).
"""

from __future__ import annotations

import json
from typing import Any

from worker.errors import PjrtPoolError
from worker.identity.options import read_varint, varint

STAMP_FIELD = 536_870_000
"""Protobuf field number of the stamp (near the top of the 29-bit range)."""

_STAMP_TAG_WIRE_TYPE = 2  # length-delimited


class ForeignExecutableError(PjrtPoolError, ValueError):
    """A serialized executable was made by another plugin build or for another host."""


def stamp(serialized: bytes, identity: dict[str, Any]) -> bytes:
    """Returns serialized bytes with an identity record appended, as older versions wrote."""
    record = json.dumps({"pjrt_pool": 1, **identity}, sort_keys=True).encode()
    tag = varint((STAMP_FIELD << 3) | _STAMP_TAG_WIRE_TYPE)
    return serialized + tag + varint(len(record)) + record


def split_stamp(serialized: bytes | memoryview) -> tuple[memoryview, dict[str, Any] | None]:
    """Returns (the plugin's own bytes, the identity record) of possibly stamped bytes.

    Unstamped bytes, and bytes that are not a protobuf message, come back
    whole with None. Only a stamp that ends the bytes, as stamp() wrote it,
    is split off. A plugin's bytes are one message; jaxlib's client's are a
    header (its length, as a varint, then it) and then one message, which a
    stamp would end as well.
    """
    data = memoryview(serialized)
    found = _stamp_after(data, 0)
    if found is None:
        try:
            length, begin = read_varint(data, 0)
        except ValueError:
            return data, None
        found = _stamp_after(data, begin + length) if begin + length < len(data) else None
    if found is None:
        return data, None
    start, record = found
    return data[:start], record


def _stamp_after(data: memoryview, begin: int) -> tuple[int, dict[str, Any]] | None:
    """Where a stamp ending data begins, and its record, reading a message from `begin`; None
    when data holds no message there or no stamp ends it."""
    offset = begin
    found: tuple[int, Any] | None = None
    try:
        while offset < len(data):
            start = offset
            tag, offset = read_varint(data, offset)
            field, wire_type = tag >> 3, tag & 7
            if wire_type == 0:
                _, offset = read_varint(data, offset)
            elif wire_type == 1:
                offset += 8
            elif wire_type == 5:
                offset += 4
            elif wire_type == 2:
                length, offset = read_varint(data, offset)
                if field == STAMP_FIELD:
                    found = (start, json.loads(bytes(data[offset : offset + length])))
                offset += length
            else:
                return None  # groups or garbage: not a message this module wrote to
    except ValueError:
        return None
    if found is None or not isinstance(found[1], dict) or offset != len(data):
        return None
    start, record = found
    return (start, record) if _ends_at(data, start) else None


def _ends_at(data: memoryview, start: int) -> bool:
    """Whether the field that begins at `start` is the last one (where stamp() puts it)."""
    _, offset = read_varint(data, start)
    length, offset = read_varint(data, offset)
    return offset + length == len(data)


def read_stamp(serialized: bytes | memoryview) -> dict[str, Any] | None:
    """Returns the identity record of stamped bytes, or None (unstamped or not protobuf)."""
    return split_stamp(serialized)[1]


def check_stamp(serialized: bytes | memoryview, identity: dict[str, Any]) -> memoryview:
    """Returns the plugin's own bytes; raises ForeignExecutableError if a stamp names another
    plugin build or host."""
    plugin_bytes, found = split_stamp(serialized)
    if found is None:
        return plugin_bytes
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
    return plugin_bytes
