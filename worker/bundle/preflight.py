"""Will each program load here? Judged from key parts, without deserializing anything.

A program loads when an entry for it was built for this process's
environment (its key parts but the program's own equal this process's:
plugin build, host CPU features, XLA flags, PJRT_NPROC, ...) and that entry
is intact (its digests and, with a secret, its signature check out). For a
program that would miss, each entry found for it says how its environment
differs, as explain_key would mark it ("plugin.sha256: built with ..., here
..."), with the CPU flags this host lacks when the entry recorded its
builder's.

The same judgement picks the entry a bundle loads (loading.py), so that the
preflight and the run cannot disagree.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, NamedTuple

from worker.bundle.index import Index, Program
from worker.bundle.reader import Bundle
from worker.cache.entry import CorruptEntryError, UnreadableEntryError
from worker.errors import BundleError
from worker.identity.keys import PROGRAM_PARTS, differing_parts, foreign_parts, key_of
from worker.identity.target import describe_part

if TYPE_CHECKING:
    from worker.cache.entry import Entry
    from worker.cache.remote import RemoteCache
    from worker.cache.store import DiskCache
    from worker.partitioning import Partitioning
    from worker.records import ProgramSpec


class Status(enum.Enum):
    """What loading a program here would do."""

    LOADS = "loads"
    WOULD_MISS = "would miss"


class Elsewhere(NamedTuple):
    """An entry for the program that was built for another environment."""

    key: str
    differences: tuple[str, ...]
    """One line per key part that differs from this process's."""


class Verdict(NamedTuple):
    """Whether one program would load here, and if not, why."""

    name: str
    status: Status
    key: str
    """The key this process loads the program by (or, for a miss, would need)."""
    reason: str = ""
    """For a miss: why, in a few words; for a load from a remote tier: which."""
    elsewhere: tuple[Elsewhere, ...] = ()
    """For a miss: the entries for the program built elsewhere, and how they differ."""

    @property
    def loads(self) -> bool:
        """Whether the program would load."""
        return self.status is Status.LOADS

    def describe(self) -> str:
        """Says the verdict in lines for people (the first one: name, status, key)."""
        head = f"{self.name}: {self.status.value}"
        if self.reason:
            head += f" ({self.reason})"
        lines = [head]
        for other in self.elsewhere:
            lines.append(f"  entry {other.key} was built elsewhere:")
            lines.extend(f"    {line}" for line in other.differences)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """Returns the verdict as JSON-ready data."""
        return {
            "name": self.name,
            "status": self.status.value,
            "key": self.key,
            "reason": self.reason,
            "elsewhere": [
                {"key": other.key, "differences": list(other.differences)}
                for other in self.elsewhere
            ],
        }


def parts_here(parts: dict[str, Any], here: dict[str, Any]) -> dict[str, Any]:
    """Returns the key parts the program of an entry has on this process's plugin and host."""
    own = {name: parts[name] for name in PROGRAM_PARTS if name in parts}
    return {**here, **own}


def key_here(parts: dict[str, Any], here: dict[str, Any]) -> str:
    """Returns the key the program of an entry has on this process's plugin and host."""
    return key_of(parts_here(parts, here))


def judge(index: Index, program: Program, here: dict[str, Any]) -> Verdict:
    """Picks the program's entry built for this environment, from the index alone.

    The verdict's key is that entry's; a miss names the key this process
    would need and how each entry differs. Nothing is read but the index.
    A program over more devices than `here` has (a TPU topology's, whose key
    parts count them) would miss, the reason naming its mesh and both counts.
    """
    partitioning = program.spec(program.keys[0]).partitioning
    short = too_few_devices_here(partitioning, here)
    if short is not None:
        needed = key_here(index.parts_of(program.keys[0]), here)
        return Verdict(program.name, Status.WOULD_MISS, needed, short)
    elsewhere = []
    for key in program.keys:
        parts = index.parts_of(key)
        if not foreign_parts(parts, here):
            return Verdict(program.name, Status.LOADS, key, _over(partitioning))
        environment = index.environments[index.entries[key].environment]
        flags = None if environment.cpu_flags is None else list(environment.cpu_flags)
        elsewhere.append(Elsewhere(key, tuple(differing_parts(parts, here, flags))))
    needed = key_here(index.parts_of(program.keys[0]), here)
    count = len(program.keys)
    reason = "its entry was not built here" if count == 1 else f"none of its {count} entries was"
    reason += "" if count == 1 else " built here"
    return Verdict(program.name, Status.WOULD_MISS, needed, reason, tuple(elsewhere))


def too_few_devices_here(partitioning: Partitioning | None, here: dict[str, Any]) -> str | None:
    """Why a program over more devices than `here` counts cannot run there, or None (it fits,
    or the key parts count no devices: a CPU or GPU process takes the devices it needs, and a
    pool worker says when it has too few)."""
    topology = here.get("topology")
    available = topology.get("devices") if isinstance(topology, dict) else None
    if partitioning is None or not isinstance(available, int):
        return None
    if partitioning.devices <= available:
        return None
    return (
        f"it needs {partitioning.devices} devices ({partitioning.mesh_text}) and "
        f"{topology.get('name') or describe_part(topology)} has {available}"
    )


def _over(partitioning: Partitioning | None, reason: str = "") -> str:
    """A load's reason, naming the devices and mesh of a program over several."""
    said = [] if partitioning is None else [f"over {partitioning.describe()}"]
    return ", ".join(said + ([reason] if reason else []))


def check_bundle(bundle: Bundle, here: dict[str, Any], platform: str) -> list[Verdict]:
    """Judges every program of a bundle for this process; verifies each entry that would load.

    Programs for another platform than the plugin `here` describes would
    miss: a process holds one plugin (check them with that platform's).
    """
    verdicts = []
    for program in bundle.index.programs.values():
        if program.platform != platform:
            needed = program.keys[0]
            reason = f"a {program.platform} program, and this check loaded the {platform} plugin"
            verdicts.append(Verdict(program.name, Status.WOULD_MISS, needed, reason))
            continue
        verdict = judge(bundle.index, program, here)
        if verdict.loads:
            try:
                bundle.entry(verdict.key)
            except BundleError as error:
                verdict = Verdict(program.name, Status.WOULD_MISS, verdict.key, str(error))
        verdicts.append(verdict)
    return verdicts


def check_cached(
    specs: list[ProgramSpec],
    cache: DiskCache,
    here: dict[str, Any],
    platform: str,
    remote: RemoteCache | None = None,
) -> list[Verdict]:
    """Judges each program of a manifest by the entry its key names in a cache (or a remote).

    An entry loads when it is intact (read whole and verified, as a load
    reads it) and was built for this process; one built elsewhere says how
    it differs, and whether the cache (or the remote) holds the program built
    here under another key (the manifest was then written on another
    machine). With a remote tier, a key the cache lacks is fetched from it
    as a load would fetch it (verified as a remote hit is, published
    nowhere), and the remote's other builds of a program found built
    elsewhere are named with how they differ (RemoteCache.built_elsewhere,
    as a never-compile refusal names them).
    """
    verdicts = []
    for spec in specs:
        if spec.platform != platform:
            reason = f"a {spec.platform} program, and this check loaded the {platform} plugin"
            verdicts.append(Verdict(spec.name, Status.WOULD_MISS, spec.key, reason))
            continue
        short = too_few_devices_here(spec.partitioning, here)
        if short is not None:
            verdicts.append(Verdict(spec.name, Status.WOULD_MISS, spec.key, short))
            continue
        try:
            found = cache.read(spec.key, touch=False)
        except CorruptEntryError as error:
            verdicts.append(Verdict(spec.name, Status.WOULD_MISS, spec.key, f"damaged: {error}"))
            continue
        except UnreadableEntryError as error:
            verdicts.append(Verdict(spec.name, Status.WOULD_MISS, spec.key, str(error)))
            continue
        entry = None if found is None else found[0]
        where = ""  # for an entry the remote holds: says so
        if entry is None and remote is not None:
            fetched = remote.fetch(spec.key, cache.max_size)
            if fetched is not None:
                entry, where = fetched[1], f"from the remote {remote.location.shown}"
        if entry is None:
            reason = _not_found(cache, remote, spec.key)
            verdicts.append(Verdict(spec.name, Status.WOULD_MISS, spec.key, reason))
            continue
        if not foreign_parts(entry.parts, here):
            verdicts.append(
                Verdict(spec.name, Status.LOADS, spec.key, _over(spec.partitioning, where))
            )
            continue
        verdicts.append(_built_elsewhere(spec, entry, cache, remote, here))
    return verdicts


def _not_found(cache: DiskCache, remote: RemoteCache | None, key: str) -> str:
    """Why a key's entry was found neither in the cache nor in the remote."""
    reason = f"not in the cache {cache.directory}"
    if remote is None:
        return reason
    reason += f" nor in the remote {remote.location.shown}"
    if remote.was_refused(key):
        return reason + " (the remote's entry was refused: see the warning)"
    if remote.state == "off":
        return reason + " (the remote could not be read: see the warning)"
    return reason


def _built_elsewhere(
    spec: ProgramSpec,
    entry: Entry,
    cache: DiskCache,
    remote: RemoteCache | None,
    here: dict[str, Any],
) -> Verdict:
    """The verdict for a manifest's entry built for another environment than this process's."""
    needed = key_here(entry.parts, here)
    reason = "its entry was built elsewhere"
    holder = None
    if cache.path_of(needed).is_file():
        holder = "the cache"
    elif remote is not None and remote.fetch(needed, cache.max_size) is not None:
        holder = f"the remote {remote.location.shown}"
    if holder is not None:
        reason += (
            f"; {holder} holds it built here as {needed}: the manifest was written on "
            "another machine, warm here for one with this host's keys"
        )
    flags = entry.metadata.get("cpu_flags")
    lines = differing_parts(entry.parts, here, flags if isinstance(flags, list) else None)
    elsewhere = [Elsewhere(spec.key, tuple(lines))]
    if remote is not None:
        for other, differences in remote.built_elsewhere(needed, parts_here(entry.parts, here)):
            if other != spec.key:
                elsewhere.append(Elsewhere(other, tuple(differences)))
    return Verdict(spec.name, Status.WOULD_MISS, needed, reason, tuple(elsewhere))
