"""A program's types as a manifest or an index says them, against its entry's own.

An entry's metadata records the input and output types it was compiled
for, under its digests (and signature): that record is the truth. A
manifest or bundle index names the same types beside the key, unprotected
by the entry's digests; edited by hand or left stale, an ``int32`` where
the program takes ``float32`` (the same size) would run the program on
reinterpreted bytes. So every program is compared with its entry before a
bundle is written, and whenever a bundle's entry is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.records import ArrayType, ProgramSpec


def _types(value: Any) -> tuple[ArrayType, ...] | None:
    return None if value is None else tuple(map(ArrayType.from_json, value))


def _say(types: tuple[ArrayType, ...] | None) -> str:
    return "unknown" if types is None else "(" + ", ".join(map(str, types)) + ")"


def recorded_types(
    metadata: Mapping[str, Any],
) -> tuple[tuple[ArrayType, ...] | None, tuple[ArrayType, ...]]:
    """Returns the (input types, output types) an entry's metadata records.

    Raises ValueError when the metadata does not record them, or not as
    ArrayType records.
    """
    if "output_types" not in metadata:
        raise ValueError("the entry does not record its program's types")
    try:
        inputs, outputs = _types(metadata.get("input_types")), _types(metadata["output_types"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"the entry's recorded types are malformed ({error!r:.120})") from None
    if outputs is None:
        raise ValueError("the entry does not record its program's output types")
    return inputs, outputs


def type_mismatch(spec: ProgramSpec, metadata: Mapping[str, Any]) -> str | None:
    """Says how a spec's types differ from those its entry records; None when they agree."""
    try:
        inputs, outputs = recorded_types(metadata)
    except ValueError as error:
        return str(error)
    differences = []
    if spec.input_types != inputs:
        differences.append(
            f"inputs {_say(spec.input_types)}, its entry was compiled for {_say(inputs)}"
        )
    if spec.output_types != outputs:
        differences.append(f"outputs {_say(spec.output_types)}, its entry returns {_say(outputs)}")
    if spec.output_bytes != tuple(t.nbytes for t in outputs):
        differences.append(
            f"output sizes {list(spec.output_bytes)}, its entry's outputs take "
            f"{[t.nbytes for t in outputs]} bytes"
        )
    return "; ".join(differences) or None
