"""The records that travel between the parent, workers and the disk cache.

They hold plain data only (bytes, strings, numpy dtypes, tuples), so that
both sides can build them without JAX and send them over a pipe or store them
as JSON.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from worker.dtypes import code_of_dtype, dtype_by_name
from worker.identity.keys import InvalidKeyError, check_key
from worker.partitioning import Partitioning, partitioning_from_json
from worker.untrusted import parse_json


class ArrayType(NamedTuple):
    """The element type and shape of an argument or result of a program."""

    dtype: np.dtype
    """Type of the elements, one of the dtypes that the runtime supports."""

    shape: tuple[int, ...]
    """Length of each axis, empty for a scalar."""

    @property
    def size(self) -> int:
        """Returns the number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Returns the size of the array in bytes."""
        return self.size * np.dtype(self.dtype).itemsize

    @classmethod
    def of(cls, dtype: Any, shape: Sequence[int]) -> ArrayType:
        """Returns an ArrayType with a canonical numpy dtype and an int tuple shape.

        Raises TypeError for a dtype the runtime does not support and
        ValueError for a negative or non-integer axis length.
        """
        canonical = np.dtype(dtype)
        code_of_dtype(canonical)  # raises TypeError naming the supported dtypes
        axes = tuple(shape)
        if not all(isinstance(n, (int, np.integer)) and n >= 0 for n in axes):
            raise ValueError(f"a shape needs non-negative integer axis lengths, not {axes!r}")
        return cls(canonical, tuple(int(n) for n in axes))

    def to_json(self) -> dict[str, Any]:
        """Returns the type as a JSON-ready dict: {"dtype": name, "shape": [...]}."""
        return {"dtype": np.dtype(self.dtype).name, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ArrayType:
        """Reads what to_json wrote."""
        return cls.of(dtype_by_name(data["dtype"]), data["shape"])

    def __str__(self) -> str:
        return f"{np.dtype(self.dtype).name}[{','.join(map(str, self.shape))}]"


def types_to_json(types: Sequence[ArrayType] | None) -> list[dict[str, Any]] | None:
    """ArrayTypes as JSON-ready dicts (None stays None: unknown types)."""
    return None if types is None else [t.to_json() for t in types]


class LoweredProgram(NamedTuple):
    """A program as StableHLO."""

    code: bytes
    """Portable StableHLO bytecode, which the PJRT plugin compiles."""

    text: str
    """The module as text, from which the executable cache key is computed."""

    input_types: tuple[ArrayType, ...] | None = None
    """The type of each argument, or None when it is not known."""

    platform: str | None = None
    """The platform that the program was lowered for, or None when it is not known."""

    partitioning: Partitioning | None = None
    """For a program over several devices (a jax.jit with shardings over a Mesh, a
    shard_map): its devices and how each input and output is split over them (see
    worker.partitioning); None for a program of one device."""

    compile_options: bytes | None = None
    """The serialized CompileOptionsProto that jax.jit compiles the program with (lower
    records it), which compile_program uses unless given others; None: the default
    ones (worker.partitioning.compile_options_for)."""

    @property
    def name(self) -> str:
        """The module's symbol name (for example "jit_f"), for messages and reports."""
        head = self.text[: self.text.find("{")] if "{" in self.text else self.text[:200]
        for word in head.split():
            if word.startswith("@"):
                return word[1:]
        return "module"


def check_program(program: Any, caller: str) -> LoweredProgram:
    """Returns program if it is a LoweredProgram; else raises TypeError naming the caller."""
    if not isinstance(program, LoweredProgram):
        raise TypeError(
            f"{caller} takes a LoweredProgram (from pool.lower), not {type(program).__name__}"
        )
    return program


class DigestedProgram(LoweredProgram):
    """A LoweredProgram that remembers the SHA-256 of its text once computed (lower() makes these).

    A Pool identifies a program by that digest on every call, and a module
    with large constants has a text of hundreds of MB, whose hash costs more
    than running the program. The digest (and the name) live on the object, so they go
    when the program does; a program made with _replace is a new object and
    computes its own. It travels to workers as a plain LoweredProgram.
    """

    @functools.cached_property
    def text_sha256(self) -> str:
        """The hex SHA-256 of the text (UTF-8), computed on first use."""
        return hashlib.sha256(self.text.encode()).hexdigest()

    @functools.cached_property
    def name(self) -> str:
        """LoweredProgram.name, read from the text once (a task of the program names it)."""
        return LoweredProgram.name.fget(self)  # type: ignore[attr-defined]

    def __reduce__(self) -> tuple[Any, ...]:
        return (LoweredProgram, tuple(self))


class JaxCompile(NamedTuple):
    """What compiling a program for JAX's own persistent cache takes besides the program
    (pool.jax_cache): the key JAX files it under, and what its value is made for. The
    program (a LoweredProgram) is the module and compile options JAX itself compiles."""

    key: str
    """JAX's key: the module's name, a dash and 64 hex digits."""

    parts: tuple[tuple[str, str], ...]
    """Each part of JAX's key and its digest, which the entry records (to explain misses)."""

    topology: dict[str, Any] | None
    """For a TPU, the topology compiled for (TopologySpec.to_json); None for the CPU."""

    devices: int
    """The devices the program runs on (for the CPU: its client's count)."""

    compression: str
    """How the reading JAX compresses values ("zlib" or "zstandard")."""

    target: str
    """The target for people ("tpu v5e:1x1", "cpu, 1 device"), which the entry records."""


class CompileStatistics(NamedTuple):
    """Time and counts of compiling programs."""

    compile_seconds: float = 0.0
    """Seconds spent compiling StableHLO with the PJRT plugin."""

    load_seconds: float = 0.0
    """Seconds spent reading executables from the disk cache."""

    compiled: int = 0
    """Programs compiled."""

    loaded: int = 0
    """Programs whose executables came from the disk cache."""

    def add(self, other: CompileStatistics) -> CompileStatistics:
        """Returns the sum of two statistics."""
        return CompileStatistics(*(a + b for a, b in zip(self, other, strict=True)))

    def __str__(self) -> str:
        return (
            f"{self.compiled} compiled in {self.compile_seconds:.3f} s, "
            f"{self.loaded} loaded from the disk cache in {self.load_seconds:.3f} s"
        )


class ProgramSpec(NamedTuple):
    """The JSON-serializable record of a compiled program.

    It is what other processes and extension modules need to find a program's
    executable in the disk cache and call it: the cache key, the platform it
    was compiled for, and the types and byte sizes of its inputs and outputs.
    """

    name: str
    """A name for the program, chosen by whoever compiled it."""

    platform: str
    """The platform the executable was compiled for ("cpu", "cuda", ...)."""

    key: str
    """The disk cache key of the executable (hex digest)."""

    input_types: tuple[ArrayType, ...] | None
    """The type of each argument, or None when it is not known."""

    output_types: tuple[ArrayType, ...]
    """The type of each output."""

    output_bytes: tuple[int, ...]
    """The size in bytes of each output."""

    partitioning: Partitioning | None = None
    """For a program over several devices, its devices and how its global inputs and
    outputs are split over them (worker.partitioning); None for one device."""

    @classmethod
    def from_executable(cls, name: str, executable: Any) -> ProgramSpec:
        """Describes an Executable that compile_program returned (it carries its key)."""
        if getattr(executable, "key", None) is None:
            raise ValueError(
                "the executable has no cache key: make it with compile_program, "
                "not Executable.compile"
            )
        return cls(
            name=name,
            platform=executable.platform,
            key=executable.key,
            input_types=executable.input_types,
            output_types=executable.output_types,
            output_bytes=executable.output_bytes,
            partitioning=executable.partitioning,
        )

    def to_json(self) -> dict[str, Any]:
        """Returns the spec as a JSON-ready dict (a program of one device has no
        "partitioning", as specs written before partitionings have none)."""
        data = {
            "name": self.name,
            "platform": self.platform,
            "key": self.key,
            "input_types": types_to_json(self.input_types),
            "output_types": types_to_json(self.output_types),
            "output_bytes": list(self.output_bytes),
        }
        if self.partitioning is not None:
            data["partitioning"] = self.partitioning.to_json()
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProgramSpec:
        """Reads what to_json wrote; raises ValueError naming a missing or bad field.

        The key must be a cache key (64 lowercase hex digits): it becomes a
        file name in the cache, so anything else, a path for one, raises
        InvalidKeyError (a ValueError) here, before it is used.
        """
        try:
            inputs = data["input_types"]
            name = data["name"]
            return cls(
                name=str(name),
                platform=str(data["platform"]),
                key=check_key(data["key"], f"the key of program {str(name)[:80]!r}"),
                input_types=None if inputs is None else tuple(map(ArrayType.from_json, inputs)),
                output_types=tuple(map(ArrayType.from_json, data["output_types"])),
                output_bytes=tuple(int(n) for n in data["output_bytes"]),
                partitioning=partitioning_from_json(data.get("partitioning")),
            )
        except InvalidKeyError:
            raise
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a ProgramSpec record: {error!r}") from error

    def dumps(self) -> str:
        """Returns the spec as a JSON string."""
        return json.dumps(self.to_json(), sort_keys=True)

    @classmethod
    def loads(cls, text: str) -> ProgramSpec:
        """Reads what dumps wrote."""
        return cls.from_json(parse_json(text))
