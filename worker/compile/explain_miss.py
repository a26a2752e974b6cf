"""Why a program would miss the cache: the entries nearest to it, and the key parts that differ.

A program hits when an entry has its key, the digest of all its key parts
(worker.identity.keys): the program's text and compile options, and where it
is built (platform, plugin build and platform version, host CPU features,
topology, XLA flags, client options). A miss means one of them differs from
every entry's. The entries nearest to the program are those of the same
program (text and compile options) under another key, built elsewhere, then
those of a program of the same name (Likeness: the name its caller gave it,
a warm spec's or a manifest's, which an entry records as given_name: the
program lowered from other text, or compiled with other options), those of
its argument types first; each says exactly which parts differ, as
differing_parts words them ("environment.xla_flags: built with [...], here
[...]"), fewest first. Entries of other programs are never near, however
alike their types or their modules' names (every lambda's is jit__lambda).
Only entry headers are read, never payloads, at most SCANNED_ENTRIES of
them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from worker.cache.entry import CorruptEntryError
from worker.cache.store import DiskCache
from worker.identity.keys import IDENTITY_PARTS, PROGRAM_PARTS, differing_parts, key_of

if TYPE_CHECKING:
    from worker.cache.remote import RemoteCache

SCANNED_ENTRIES = 20_000
"""At most this many entry headers are read to find a program's nearest entries."""

ALL_PARTS = (*PROGRAM_PARTS, *IDENTITY_PARTS)
"""Every part of a key, as differing_parts compares them."""


class Related(NamedTuple):
    """An entry near a program: of the same program built elsewhere, or of a program of the
    same name."""

    key: str
    name: str
    """The name the entry's program was given (else lowered under; "" when it has none)."""
    same_program: bool
    """Whether it holds the same program (text and compile options), built elsewhere."""
    differences: tuple[str, ...]
    """One line per key part that differs from the program's here."""
    where: str = "cache"
    """"cache", or "remote" for an entry of the remote tier."""


class Likeness(NamedTuple):
    """What else makes an entry near a program than being the same program: the name its
    caller gives it (a spec's, a manifest's: an entry's given_name), and among entries of
    that name, its types (as an entry's metadata writes them)."""

    name: str | None = None
    input_types: list[Any] | None = None
    output_types: list[Any] | None = None

    def of(self, metadata: dict[str, Any]) -> int:
        """How alike an entry is, from its metadata: 0 not at all (another program's, or
        one of no name given); more is nearer."""
        if self.name is None or metadata.get("given_name") != self.name:
            return 0
        types = [
            (given, metadata.get(field))
            for given, field in (
                (self.input_types, "input_types"),
                (self.output_types, "output_types"),
            )
            if given is not None
        ]
        return 1 + (bool(types) and all(given == theirs for given, theirs in types))


NOTHING_ALIKE = Likeness()
"""Only the same program is near."""


def related_entries(
    cache: DiskCache,
    parts: dict[str, Any],
    like: Likeness = NOTHING_ALIKE,
    sections: tuple[str, ...] = ALL_PARTS,
) -> list[Related]:
    """The cache's entries of the program `parts` describe under another key, and those
    alike (like: same name, same types); each with the parts (of `sections`) in which it
    differs, nearest first: the same program, then the most alike, then fewer differences."""
    if not cache.usable:
        return []
    wanted = key_of(parts)
    found = []
    for item in cache.list_entries()[-SCANNED_ENTRIES:]:
        if item.key == wanted:
            continue
        try:
            fields = cache.read_header(item.key).fields
        except (OSError, CorruptEntryError):
            continue
        theirs, metadata = fields.get("parts"), fields.get("metadata")
        if item.key != fields.get("key") or not isinstance(theirs, dict):
            continue
        metadata = metadata if isinstance(metadata, dict) else {}
        # The same text: its compile options may differ (they are then among the lines).
        same = theirs.get(PROGRAM_PARTS[0]) == parts.get(PROGRAM_PARTS[0])
        alike = like.of(metadata)
        if not same and not alike:
            continue
        flags = metadata.get("cpu_flags")
        lines = differing_parts(theirs, parts, flags if isinstance(flags, list) else None, sections)
        called = metadata.get("given_name", metadata.get("name"))
        called = called if isinstance(called, str) else ""
        found.append((not same, -alike, len(lines), Related(item.key, called, same, tuple(lines))))
    return [entry for *_, entry in sorted(found, key=lambda f: (*f[:3], f[3].key))]


class Explanation(NamedTuple):
    """Whether a program would hit the cache (or its remote tier), and if not, why."""

    name: str
    key: str
    """The key the program has here."""
    hit: str
    """Where its entry is ("the cache DIR", "the remote URL"); "" for a miss."""
    related: tuple[Related, ...]
    """For a miss: the entries nearest to the program, nearest first."""
    note: str = ""
    """What else there is to say (a manifest written on another machine, ...)."""

    def describe(self, shown: int = 3) -> str:
        """Says it in lines for people: the verdict, then the nearest `shown` entries."""
        if self.hit:
            return f"{self.name}: would hit ({self.key} is in {self.hit})"
        lines = [f"{self.name}: would miss ({self.key})"]
        if self.note:
            lines.append(f"  {self.note}")
        if not self.related:
            lines.append(
                f"  no entry of this program, nor of a program named {self.name!r}, was found: "
                "it was never compiled into this cache"
            )
            return "\n".join(lines)
        lines.append("  nearest entries:")
        for entry in self.related[:shown]:
            kind = "same program" if entry.same_program else f"a program named {entry.name!r}"
            place = " in the remote" if entry.where == "remote" else ""
            count = len(entry.differences)
            if not count:
                lines.append(
                    f"  entry {entry.key}{place} ({kind}): no part of its key that could be "
                    "compared differs"
                )
                continue
            lines.append(f"  entry {entry.key}{place} ({kind}), {count} part(s) differ:")
            lines.extend(f"    {line}" for line in entry.differences)
        if len(self.related) > shown:
            lines.append(f"  ... and {len(self.related) - shown} more (--all shows them)")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """Returns the explanation as JSON-ready data (every related entry)."""
        return {
            "name": self.name,
            "key": self.key,
            "hit": self.hit,
            "note": self.note,
            "nearest": [
                {
                    "key": entry.key,
                    "name": entry.name,
                    "same_program": entry.same_program,
                    "where": entry.where,
                    "differences": list(entry.differences),
                }
                for entry in self.related
            ],
        }


def where_held(cache: DiskCache, remote: RemoteCache | None, key: str) -> str:
    """Where the entry of a key would load from: "the cache DIR", else "the remote URL" (read
    to check it, not kept), else "" (a damaged entry misses: the nearest entries say the
    rest)."""
    if cache.usable and cache.path_of(key).is_file():
        try:
            cache.read_header(key)
            return f"the cache {cache.directory}"
        except (OSError, CorruptEntryError):
            pass
    if remote is not None and remote.fetch(key, cache.max_size) is not None:
        return f"the remote {remote.location.shown}"
    return ""


def explain(
    cache: DiskCache,
    parts: dict[str, Any],
    name: str,
    like: Likeness = NOTHING_ALIKE,
    remote: RemoteCache | None = None,
) -> Explanation:
    """Whether the program `parts` describe (called `name` in the report) would hit the cache
    (or the remote tier, which is asked for what the cache lacks), and for a miss its nearest
    entries in both."""
    key = key_of(parts)
    hit = where_held(cache, remote, key)
    if hit:
        return Explanation(name, key, hit, ())
    related = related_entries(cache, parts, like)
    if remote is not None:
        related += [
            Related(other, "", True, tuple(lines), "remote")
            for other, lines in remote.built_elsewhere(key, parts)
        ]
    return Explanation(name, key, "", tuple(related))
