"""Where a run's arrays lie (Where: PLACE or VALUE), and the PlacedRun frame that names them.

Both sides': the parent (pool/executor) writes Wheres and PlacedRuns, a pool
worker (worker/serve, and native/hot_loop.cc, which reads the same layout)
reads them; worker.wire.protocol sends and receives the frame (placed_frame,
decode_placed) as its format PLACED_RUN. A PlacedRun is the hot path of
every run of a program the worker has loaded but those the arena's hot slots
take (see worker.wire.protocol's docstring).
"""

from __future__ import annotations

import enum
import functools
import itertools
import struct
from typing import NamedTuple


class WhereKind(enum.IntEnum):
    """What a Where names (an int on the wire, as native/hot_loop.cc's Where::Kind)."""

    PLACE = 0
    """An array in shared memory, at (segment id, byte offset); segment 0 is the worker's
    arena."""
    VALUE = 1
    """A value the worker keeps, by id (offset 0)."""


PLACE = WhereKind.PLACE
"""A Where's kind: an array in shared memory (WhereKind.PLACE)."""

VALUE = WhereKind.VALUE
"""A Where's kind: a value the worker keeps (WhereKind.VALUE)."""

Where = tuple[WhereKind, int, int]
"""Where one array of a run comes from or goes to: (PLACE, segment, offset) or (VALUE, id, 0)."""


class PlacedRun(NamedTuple):
    """Run the program in a slot on inputs and outputs where each Where says (see the module
    docstring), after mapping `segments` ((id, size), one descriptor each, sent with the
    frame in order), dropping the values `drops` and unmapping the segments `forgets`."""

    task_id: int
    slot: int
    zero_copy: bool
    sources: tuple[Where, ...]
    destinations: tuple[Where, ...]
    segments: tuple[tuple[int, int], ...] = ()
    drops: tuple[int, ...] = ()
    forgets: tuple[int, ...] = ()


PLACED_RUN_FORMAT = 3
"""The frame format of a PlacedRun (worker.wire.protocol.Format.PLACED_RUN)."""

_FRAME_HEADER = struct.calcsize("<IBB")  # worker.wire.protocol's frame header: length, nfds, format
# The frame header and PlacedRun's head: task id, slot, zero copy, and the counts of sources,
# destinations, segments, drops and forgets (native/hot_loop.cc reads the same layout).
_PLACED_HEAD = struct.Struct("<IBBqiBxHHHHH")
_WHERE = struct.Struct("<qqq")
_PAIR = struct.Struct("<qq")
PLACED_HEAD_LENGTH = _PLACED_HEAD.size - _FRAME_HEADER
"""The fewest payload bytes of a PlacedRun's frame: its head."""
MAX_PLACED_LENGTH = 1 << 20
"""The most payload bytes of a PlacedRun's frame (native/hot_loop.cc's kMaxPlacedPayload)."""


@functools.lru_cache(maxsize=256)
def _frame_struct(wheres: int, pairs: int, ids: int) -> struct.Struct:
    """The struct of a whole PlacedRun frame with these counts: its head, then every Where,
    segment pair and id as int64s (little-endian, unpadded: the head's and the parts' packs
    laid end to end), packed in one call."""
    return struct.Struct(f"{_PLACED_HEAD.format}{3 * wheres + 2 * pairs + ids}q")


def placed_frame(message: PlacedRun, nfds: int) -> bytes:
    """A PlacedRun's frame: its head, then each Where, segment, drop and forget."""
    if nfds != len(message.segments):
        raise ValueError(f"{len(message.segments)} new segments but {nfds} descriptors")
    sources, destinations, segments = message.sources, message.destinations, message.segments
    drops, forgets = message.drops, message.forgets
    counts = (len(sources), len(destinations), len(segments), len(drops), len(forgets))
    frame = _frame_struct(counts[0] + counts[1], counts[2], counts[3] + counts[4])
    length = frame.size - _FRAME_HEADER
    if length > MAX_PLACED_LENGTH or max(counts) > 0xFFFF:
        raise ValueError(
            f"a placed run's frame of {length} bytes is past its bounds (1 MiB, 65535 of each "
            "part): a request brings a worker at most a few thousand drops and forgets"
        )
    return frame.pack(
        length,
        nfds,
        PLACED_RUN_FORMAT,
        message.task_id,
        message.slot,
        message.zero_copy,
        *counts,
        *itertools.chain.from_iterable(sources),
        *itertools.chain.from_iterable(destinations),
        *itertools.chain.from_iterable(segments),
        *drops,
        *forgets,
    )


def decode_placed(payload: bytes) -> PlacedRun:
    """The PlacedRun a placed frame's payload holds (the parent never receives one: for
    tests, and for a worker that reads one in Python)."""
    head = bytes(_FRAME_HEADER) + payload  # offsets as in the frame
    task_id, slot, zero_copy, *counts = _PLACED_HEAD.unpack_from(head)[3:]
    sources, destinations, segments, drops, forgets = counts
    at = _PLACED_HEAD.size

    def take(unit: struct.Struct, count: int) -> tuple[tuple[int, ...], ...]:
        nonlocal at
        items = tuple(unit.unpack_from(head, at + i * unit.size) for i in range(count))
        at += count * unit.size
        return items

    def wheres(count: int) -> tuple[Where, ...]:
        return tuple((WhereKind(kind), i, offset) for kind, i, offset in take(_WHERE, count))

    read = (wheres(sources), wheres(destinations), take(_PAIR, segments))
    ids = struct.unpack_from(f"<{drops + forgets}q", head, at)
    found = (*read, ids[:drops], ids[drops:])
    return PlacedRun(task_id, slot, bool(zero_copy), *found)  # type: ignore[arg-type]
