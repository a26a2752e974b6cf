"""A bundle's index: its programs, its entries and the environment each entry was built for.

index.json (canonical JSON: sorted keys, no timestamps)::

    {"format": 1, "kind": "pjrt-pool bundle",
     "programs": [{"name", "platform", "input_types", "output_types", "output_bytes",
                   ["partitioning",] "entries": [KEY, ...]}, ...],   in manifest order
     "entries": {KEY: {"environment", "program_sha256", "options", "size",
                       "sha256"}},                             the member entries/KEY.pjx
     "environments": {ID: {"parts": {...}, "cpu_flags": [...]}},
     "compile_options": {OPTIONS_ID: HEX}}

Compile options are held once and named by the start of their SHA-256 (OPTIONS_ID):
a program lowered from JAX carries jax.jit's, about a kilobyte, which most entries of a
bundle share; written into each entry they made the index of a few hundred programs
megabytes that every reader at a URL fetches first. An entry of an index written before
the table holds its options itself ("compile_options": HEX), and is read as such.

An environment is an entry's key parts without the program's own two
(program_sha256, compile_options): the platform, plugin build (SHA-256, API
and platform version, device kind), host (CPU features), client options and
code-generation environment (XLA flags as the plugin saw them, PJRT_NPROC),
exactly as the cache key records them; ID is the start of its SHA-256.
cpu_flags, when the entries recorded them, are the builder's CPU flags, so
that a miss can say which ones a host lacks. So each entry's key can be
recomputed from the index alone (and is, when the index is read), and a
loader picks the entry whose environment is its own without reading any
entry.

A program over several devices has its "partitioning" (worker.partitioning: the
mesh, the device assignment, each array's blocks); a program of one device has
none, as every program of a bundle made before partitionings.

With a signing secret, index.mac holds the HMAC-SHA256 of index.json; the
index holds each member's SHA-256, so the MAC covers the whole bundle.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from worker.cache.entry import ENTRY_SUFFIX
from worker.cache.signing import Signer
from worker.errors import BundleError
from worker.identity.keys import (
    PROGRAM_PARTS,
    InvalidKeyError,
    check_key,
    is_key,
    key_of,
    options_id,
)
from worker.records import ProgramSpec
from worker.untrusted import parse_json

if TYPE_CHECKING:
    from worker.bundle.container import Member

INDEX_FORMAT = 1
INDEX_NAME = "index.json"
MAC_NAME = "index.mac"
ENTRIES_DIR = "entries/"
KIND = "pjrt-pool bundle"
MAX_INDEX_SIZE = 64 << 20
MAX_MAC_SIZE = 4096
"""index.mac holds a MAC and a key id as JSON: about 120 bytes."""
MAX_NAME_LENGTH = 1024
_HEX = frozenset("0123456789abcdef")


def member_name(key: str) -> str:
    """Returns the archive member that holds a key's entry."""
    return f"{ENTRIES_DIR}{key}{ENTRY_SUFFIX}"


def check_member_name(name: str, where: str) -> str | None:
    """Returns the key a member holds (None for the index's own members); refuses other names.

    A bundle holds index.json, index.mac and entries/<key>.pjx, nothing else:
    an absolute name, one with "..", or any other file is refused before
    anything is read from the bundle, let alone written.
    """
    if name in (INDEX_NAME, MAC_NAME):
        return None
    if name.startswith(ENTRIES_DIR) and name.endswith(ENTRY_SUFFIX):
        key = name[len(ENTRIES_DIR) : -len(ENTRY_SUFFIX)]
        if is_key(key):
            return key
    parts = name.split("/")
    if name.startswith("/") or ".." in parts:
        raise BundleError(f"{where}: member {name!r} is a path outside the bundle")
    raise BundleError(
        f"{where}: member {name!r} is not part of a pjrt-pool bundle (it holds {INDEX_NAME}, "
        f"{MAC_NAME} and {ENTRIES_DIR}<key>{ENTRY_SUFFIX} only)"
    )


def environment_id(parts: dict[str, Any]) -> str:
    """Names an environment (an entry's parts without the program's): 16 hex digits."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def split_parts(parts: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits an entry's key parts into (the program's, the environment's)."""
    program = {name: parts.get(name) for name in PROGRAM_PARTS}
    environment = {name: value for name, value in parts.items() if name not in PROGRAM_PARTS}
    return program, environment


class Environment(NamedTuple):
    """Where an entry was built: the key parts that are not the program's."""

    id: str
    parts: dict[str, Any]
    cpu_flags: tuple[str, ...] | None = None
    """The builder's CPU flags, when its entries recorded them (for messages only)."""

    def to_json(self) -> dict[str, Any]:
        """Returns the environment as index.json holds it."""
        record: dict[str, Any] = {"parts": self.parts}
        if self.cpu_flags is not None:
            record["cpu_flags"] = list(self.cpu_flags)
        return record


class IndexEntry(NamedTuple):
    """One cache entry in the bundle: where it was built, its size and digest."""

    key: str
    environment: str
    program_sha256: str
    compile_options: str
    size: int
    sha256: str

    @property
    def member(self) -> str:
        """The archive member that holds it."""
        return member_name(self.key)

    def to_json(self) -> dict[str, Any]:
        """Returns the entry as index.json holds it (without its key; its options by id)."""
        return {
            "environment": self.environment,
            "program_sha256": self.program_sha256,
            "options": options_id(self.compile_options),
            "size": self.size,
            "sha256": self.sha256,
        }


class Program(NamedTuple):
    """A program of the bundle: its signature, and its entries (one per environment)."""

    name: str
    platform: str
    spec_json: dict[str, Any]
    """Its ProgramSpec fields but the key (the same for every entry)."""
    keys: tuple[str, ...]

    def spec(self, key: str) -> ProgramSpec:
        """Returns the ProgramSpec of one of its entries."""
        return ProgramSpec.from_json({**self.spec_json, "key": key})

    def to_json(self) -> dict[str, Any]:
        """Returns the program as index.json holds it."""
        return {**self.spec_json, "entries": list(self.keys)}


class Index:
    """A bundle's programs, entries and environments (see the module docstring)."""

    def __init__(
        self,
        programs: dict[str, Program],
        entries: dict[str, IndexEntry],
        environments: dict[str, Environment],
        where: str = "the bundle",
    ) -> None:
        self.programs = programs
        """By name, in manifest order."""
        self.entries = entries
        """By key."""
        self.environments = environments
        """By environment id."""
        self.where = where
        self._checked: set[str] = set()

    def parts_of(self, key: str) -> dict[str, Any]:
        """Returns the full key parts of an entry, rebuilt from the index.

        The first time, they are checked to hash to the key (raising
        BundleError for an index changed by hand): only the entries a process
        uses, so that opening a bundle of hundreds of programs to run one
        costs one check, not hundreds.
        """
        entry = self.entries[key]
        parts = {
            **self.environments[entry.environment].parts,
            "program_sha256": entry.program_sha256,
            "compile_options": entry.compile_options,
        }
        if key not in self._checked:
            if key_of(parts) != key:
                raise BundleError(
                    f"{self.where}: entry {key}'s key does not match the key parts the index "
                    "gives for it (the index was changed)"
                )
            self._checked.add(key)
        return parts

    def encode(self) -> bytes:
        """Returns index.json's bytes: canonical, so the same index gives the same bytes."""
        document = {
            "format": INDEX_FORMAT,
            "kind": KIND,
            "programs": [program.to_json() for program in self.programs.values()],
            "entries": {key: entry.to_json() for key, entry in self.entries.items()},
            "environments": {eid: env.to_json() for eid, env in self.environments.items()},
            "compile_options": {
                options_id(entry.compile_options): entry.compile_options
                for entry in self.entries.values()
            },
        }
        return json.dumps(document, sort_keys=True, indent=1).encode() + b"\n"

    @classmethod
    def decode(cls, data: bytes, where: str) -> Index:
        """Reads and checks index.json; raises BundleError naming what is wrong."""
        try:
            document = parse_json(data)
        except ValueError as error:  # not JSON, or nested deeper than any index
            raise BundleError(f"{where}: {INDEX_NAME} is not JSON ({error})") from None
        if not isinstance(document, dict) or document.get("kind") != KIND:
            raise BundleError(f"{where}: {INDEX_NAME} is not a pjrt-pool bundle index")
        if document.get("format") != INDEX_FORMAT:
            raise BundleError(
                f"{where}: bundle format {document.get('format')!r}, this pjrt-pool reads "
                f"format {INDEX_FORMAT}: make the bundle with this version"
            )
        try:
            return _decode(document, where)
        except BundleError:
            raise
        except KeyError as error:
            raise BundleError(f"{where}: {INDEX_NAME} lacks the field {error}") from None
        except (InvalidKeyError, TypeError, ValueError) as error:
            raise BundleError(f"{where}: {INDEX_NAME} is malformed: {error}") from None


def _hex(value: Any, length: int | None, what: str) -> str:
    if (
        not isinstance(value, str)
        or (length is not None and len(value) != length)
        or not _HEX.issuperset(value)
    ):
        raise ValueError(f"{what} is not {length or 'some'} hexadecimal digits: {value!r:.80}")
    return value


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} is not a byte count: {value!r:.80}")
    return value


def _name(value: Any, what: str) -> str:
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= MAX_NAME_LENGTH
        or not value.isprintable()
    ):
        raise ValueError(f"{what} is not a printable name of at most {MAX_NAME_LENGTH} characters")
    return value


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not a JSON object")
    return value


def _decode(document: dict[str, Any], where: str) -> Index:
    environments: dict[str, Environment] = {}
    for eid, record in _mapping(document["environments"], "environments").items():
        record = _mapping(record, f"environment {eid}")
        parts = _mapping(record["parts"], f"environment {eid}'s parts")
        if environment_id(parts) != eid:
            raise ValueError(f"environment {eid!r:.40} is not named after its parts")
        flags = record.get("cpu_flags")
        if flags is not None and not (
            isinstance(flags, list) and all(isinstance(f, str) and len(f) < 64 for f in flags)
        ):
            raise ValueError(f"environment {eid}'s cpu_flags is not a list of flag names")
        environments[eid] = Environment(eid, parts, None if flags is None else tuple(flags))
    options: dict[str, str] = {}
    for oid, value in _mapping(document.get("compile_options", {}), "compile_options").items():
        if options_id(_hex(value, None, f"compile options {oid!r:.40}")) != oid:
            raise ValueError(f"compile options {oid!r:.40} are not named after their bytes")
        options[oid] = value
    entries: dict[str, IndexEntry] = {}
    for key, record in _mapping(document["entries"], "entries").items():
        check_key(key, f"{where}: an entry's key")
        record = _mapping(record, f"entry {key}")
        if "options" in record:
            if record["options"] not in options:
                raise ValueError(
                    f"entry {key} names compile options {record['options']!r:.40}, not listed"
                )
            held = options[record["options"]]
        else:  # an index written before the table
            held = _hex(record["compile_options"], None, f"entry {key}'s options")
        entry = IndexEntry(
            key=key,
            environment=record["environment"],
            program_sha256=_hex(record["program_sha256"], 64, f"entry {key}'s program_sha256"),
            compile_options=held,
            size=_count(record["size"], f"entry {key}'s size"),
            sha256=_hex(record["sha256"], 64, f"entry {key}'s sha256"),
        )
        if entry.environment not in environments:
            raise ValueError(f"entry {key} names environment {entry.environment!r:.40}, not listed")
        entries[key] = entry
    index = Index({}, entries, environments, where)
    programs = document["programs"]
    if not isinstance(programs, list):
        raise ValueError("programs is not a list")
    used: set[str] = set()
    for record in programs:
        program = _program(_mapping(record, "a program"))
        if program.name in index.programs:
            raise ValueError(f"program {program.name!r} is listed twice")
        unknown = [key for key in program.keys if key not in entries]
        if unknown:
            raise ValueError(f"program {program.name!r} names entry {unknown[0]}, not listed")
        if len(set(program.keys)) != len(program.keys):
            raise ValueError(f"program {program.name!r} names an entry twice")
        used.update(program.keys)
        index.programs[program.name] = program
    orphans = sorted(set(entries) - used)
    if orphans:
        raise ValueError(f"entry {orphans[0]} belongs to no program")
    return index


def _program(record: dict[str, Any]) -> Program:
    name = _name(record["name"], "a program's name")
    keys = record["entries"]
    if not isinstance(keys, list) or not keys:
        raise ValueError(f"program {name!r} has no entries")
    for key in keys:
        check_key(key, f"an entry of program {name!r}")
    fields = {field: record[field] for field in ProgramSpec._fields if field not in _OPTIONAL}
    fields.update({field: record[field] for field in _OPTIONAL if record.get(field) is not None})
    spec = ProgramSpec.from_json({**fields, "key": keys[0]})  # checks the types
    return Program(name, spec.platform, fields, tuple(keys))


_OPTIONAL = ("key", "partitioning")
"""ProgramSpec fields a program's record may lack: its key (each entry has its own), and the
partitioning of a program of one device (and of every program of an older bundle)."""


def _spec_json(spec: ProgramSpec) -> dict[str, Any]:
    """A program's spec as the index holds it: ProgramSpec.to_json without its key, which
    differs per environment (each entry records its own) while the signature does not."""
    fields = spec.to_json()
    del fields["key"]
    return fields


def signature(index_bytes: bytes, signer: Signer) -> bytes:
    """Returns index.mac's bytes for an index: its HMAC-SHA256 and the secret's key id."""
    mac = signer.sign(index_bytes).hex()
    return json.dumps({"hmac_sha256": mac, "key_id": signer.key_id}, sort_keys=True).encode()


def check_signature(
    index_bytes: bytes, mac_bytes: bytes | None, signer: Signer, where: str
) -> None:
    """Raises BundleError unless index.mac holds the index's MAC under signer's secret."""
    if mac_bytes is None:
        raise BundleError(
            f"{where} is not signed, and this process checks signatures (secret from "
            f"{signer.source}): make the bundle with the same secret set"
        )
    try:
        record = parse_json(mac_bytes)
        mac = bytes.fromhex(record["hmac_sha256"])
        key_id = record.get("key_id")
    except (ValueError, KeyError, TypeError):
        raise BundleError(f"{where}: {MAC_NAME} is malformed") from None
    if not signer.verify(index_bytes, mac):
        why = (
            f"it was signed with another secret (key id {key_id}, this process's is "
            f"{signer.key_id})"
            if key_id != signer.key_id
            else f"its {INDEX_NAME} was changed after signing"
        )
        raise BundleError(f"{where}: the bundle's signature does not match: {why}")


def open_index(
    members: Mapping[str, Member],
    read: Callable[[Member], bytes],
    signer: Signer | None,
    where: str,
) -> tuple[bytes, Index]:
    """Reads index.json and returns its bytes and its Index: sizes first, then the MAC, then JSON.

    members are the archive's by name and read(member) returns a member's
    bytes. index.json and index.mac are read only if of a size they may be,
    and with a signer the index's MAC is checked over its raw bytes before
    anything parses them. One path for a file and a URL (reader.py, and
    remote.py, whose layout the index gives). Raises BundleError.
    """
    member = members.get(INDEX_NAME)
    if member is None:
        raise BundleError(f"{where} has no {INDEX_NAME}: it is not a pjrt-pool bundle")
    if member.size > MAX_INDEX_SIZE:
        raise BundleError(
            f"{where}: its {INDEX_NAME} is {member.size} bytes, more than a bundle index may be "
            f"({MAX_INDEX_SIZE})"
        )
    mac = members.get(MAC_NAME)
    if signer is not None and mac is not None and mac.size > MAX_MAC_SIZE:
        raise BundleError(f"{where}: its {MAC_NAME} is {mac.size} bytes: not ours")
    index_bytes = read(member)
    if signer is not None:
        check_signature(index_bytes, None if mac is None else read(mac), signer, where)
    return index_bytes, Index.decode(index_bytes, where)


class IndexBuilder:
    """Collects programs and their entries into an Index, refusing conflicts."""

    def __init__(self) -> None:
        self.index = Index({}, {}, {})
        self._where: dict[str, str] = {}
        """Where each entry came from, by key (for messages)."""

    def add(
        self,
        spec: ProgramSpec,
        parts: dict[str, Any],
        size: int,
        sha256: str,
        cpu_flags: Iterable[str] | None = None,
        where: str = "",
    ) -> bool:
        """Adds one entry of a program; returns whether the entry is new to the bundle.

        Raises BundleError when a program of the same name has another
        signature (its types differ), or another entry built for the same
        environment (another program, or other compile options): names must
        mean one program, and a loader serves one entry per environment.
        """
        program_parts, env_parts = split_parts(parts)
        eid = environment_id(env_parts)
        flags = None if cpu_flags is None else tuple(cpu_flags)
        known = self.index.environments.get(eid)
        if known is None or (known.cpu_flags is None and flags is not None):
            self.index.environments[eid] = Environment(eid, env_parts, flags)
        fields = _spec_json(spec)
        program = self.index.programs.get(spec.name)
        if program is not None and program.spec_json != fields:
            raise BundleError(
                f"program {spec.name!r}{where} has another signature than the program of that "
                f"name already in the bundle ({_signature(fields)} vs "
                f"{_signature(program.spec_json)}): give one of them another name"
            )
        for other in () if program is None else program.keys:
            known_entry = self.index.entries[other]
            if other != spec.key and known_entry.environment == eid:
                what = (
                    f"program_sha256 {program_parts['program_sha256'][:16]}... vs "
                    f"{known_entry.program_sha256[:16]}..."
                    if program_parts["program_sha256"] != known_entry.program_sha256
                    else "the same program with other compile options"
                )
                raise BundleError(
                    f"program {spec.name!r}{where} and program {spec.name!r}"
                    f"{self._where[other]} are different programs built for one environment "
                    f"({what}), and a loader would serve only one: give one of them another "
                    "name, or leave the one that is out of date out"
                )
        new = spec.key not in self.index.entries
        if new:
            self._where[spec.key] = where
            self.index.entries[spec.key] = IndexEntry(
                key=spec.key,
                environment=eid,
                program_sha256=program_parts["program_sha256"],
                compile_options=program_parts["compile_options"],
                size=size,
                sha256=sha256,
            )
        keys = program.keys if program is not None else ()
        if spec.key not in keys:
            self.index.programs[spec.name] = Program(
                spec.name, spec.platform, fields, (*keys, spec.key)
            )
        return new


def _signature(fields: dict[str, Any]) -> str:
    spec = ProgramSpec.from_json({**fields, "key": "0" * 64})
    inputs = ", ".join(map(str, spec.input_types or ()))
    return f"({inputs}) -> ({', '.join(map(str, spec.output_types))})"
