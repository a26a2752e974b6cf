"""``pjrt-pool cache explain SPEC_OR_MANIFEST [NAME ...]``: why a program would miss the cache.

For each program (every one, or those named), says whether it would hit the
cache (and the remote tier, with --remote or PJRT_POOL_CACHE_REMOTE) here,
and for a miss the nearest entries and exactly which key parts differ:
plugin build and platform version, host CPU features, topology, compile
options, XLA flags, the program's text. A warm spec's programs (spec.py or
module:function, as ``pjrt-pool warm`` takes it) are lowered here and keyed
as compiling them here would key them; a manifest's programs are known by
the entries it names, and a manifest written on another machine says so. On
a platform whose executables are tied to a topology (TPU), --topology names
the host to explain for (needed where no such device is attached). Only a
spec imports JAX (to lower).

worker.compile.explain_miss finds the entries and their differing parts.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, NamedTuple

from pool.cli import interrupts
from pool.cli.jax_cache_options import add_jax_cache_options, check_jax_version, jax_cache_option
from pool.cli.main import ExitCode, UsageError
from pool.cli.options import (
    add_command,
    add_pool_option,
    add_remote_option,
    add_topology_options,
    open_remote_option,
    paragraph,
    topology_option,
)
from pool.cli.paths import checked_cache_dir, checked_manifest_cache_dir
from worker.bundle.preflight import parts_here
from worker.cache import DiskCache
from worker.cache.blobs import BlobStore
from worker.cache.entry import CorruptEntryError
from worker.compile.explain_miss import (
    Explanation,
    Likeness,
    Related,
    explain,
    related_entries,
    where_held,
)
from worker.compile.target import needs_topology_here, target_for
from worker.errors import (
    PjrtError,
    PlatformMismatchError,
    PluginLoadError,
    PluginNotFoundError,
    TopologyError,
)
from worker.identity.keys import IDENTITY_PARTS, differing_parts, key_of
from worker.identity.target import runtime_key_parts
from worker.partitioning import compile_options_for
from worker.plugin.runtime import default_platform, get_runtime
from worker.plugin.topology import TopologySpec
from worker.records import types_to_json


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    """Adds explain to the ``cache`` command's subcommands."""
    explain_ = add_command(
        commands,
        "explain",
        _checked(_explain),
        "why a program would miss the cache: its nearest entries, the key parts that differ",
        paragraph(__doc__, 1),
        epilog="exit status: 0 when every program would load from the cache (or the remote "
        "tier); 1 when any would miss; 2 for usage and environment errors.",
        parents=(common,),
    )
    explain_.add_argument(
        "file",
        metavar="SPEC_OR_MANIFEST",
        help="a warm spec (spec.py or module:function, as pjrt-pool warm takes it) or a manifest",
    )
    explain_.add_argument("names", metavar="NAME", nargs="*", help="programs (default: all)")
    add_pool_option(explain_, "platform", "a spec's platform, for programs that name none")
    add_topology_options(explain_, "explain for a host of this topology")
    add_remote_option(explain_, "also look in this remote cache tier")
    explain_.add_argument(
        "--all", action="store_true", help="show every entry found near a program, not 3"
    )
    add_jax_cache_options(
        explain_,
        "with a spec: explain each program's entry of JAX's persistent cache",
        "the JAX cache directory the target's script reads (a hit: the entry is there, or in "
        "the cache or remote tier)",
    )


def _checked(command: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return int(command(args))
        except ValueError as error:  # a setting the cache cannot use (signing, sharing)
            raise UsageError(str(error)) from error

    return run


def _is_spec(text: str) -> bool:
    """Whether FILE names a warm spec rather than a manifest (which is a JSON file)."""
    return text.endswith(".py") or (":" in text and not text.endswith(".json"))


class _Here:
    """This host's side of the keys, per platform: the plugin loaded once, for the device
    here or for the --topology given."""

    def __init__(self, cache: DiskCache, topology: TopologySpec | None) -> None:
        self.cache = cache
        self.topology = topology
        self._runtimes: dict[str, Any] = {}

    def parts(self, platform: str, text: str = "", options: bytes | None = None) -> dict[str, Any]:
        """A program's key parts here (without text: where it is built, alone)."""
        if self.topology is None and needs_topology_here(platform):
            raise UsageError(
                f"no {platform} device is attached here: give --topology NAME, the topology of "
                "the host to explain for (v5e:1x1, ...)"
            )
        try:
            runtime = self._runtimes.get(platform)
            if runtime is None:
                runtime = get_runtime(platform, deviceless=self.topology is not None)
                self._runtimes[platform] = runtime
            target = target_for(runtime, self.topology)
            usable = self.cache if self.cache.usable else None
            return runtime_key_parts(runtime, usable, text, options, target)
        except (PluginNotFoundError, PluginLoadError, PlatformMismatchError, PjrtError) as error:
            raise UsageError(f"platform {platform}: {error}") from None
        except TopologyError as error:
            raise UsageError(str(error)) from None


def _chosen(available: list[str], names: list[str], what: str) -> list[str]:
    missing = [name for name in names if name not in available]
    if missing:
        raise UsageError(
            f"{what} has no program named {', '.join(map(repr, missing))}; it has: "
            + ", ".join(available[:20])
            + (" ..." if len(available) > 20 else "")
        )
    return names or available


def _explain_spec(args: argparse.Namespace, remote: Any) -> list[Any]:
    from pool.warm.spec_file import SpecError, load_spec  # only for a spec

    checked_cache_dir(args.cache_dir)
    try:
        spec = load_spec(args.file)
    except SpecError as error:
        raise UsageError(str(error)) from None
    programs = {program.name: program for program in spec.programs}
    if args.jax_cache is not None:
        return _explain_for_jax(args, programs, remote)
    here = _Here(DiskCache(args.cache_dir, create=False), topology_option(args))
    found = []
    for name in _chosen(list(programs), args.names, f"the spec {args.file}"):
        program = programs[name]
        platform = program.platform or args.platform or default_platform()
        lowered, _ = _lowered(name, program, platform)
        options = compile_options_for(lowered, program.compile_options)  # as warm does
        parts = here.parts(platform, lowered.text, options)
        like = Likeness(name, types_to_json(lowered.input_types))
        found.append(explain(here.cache, parts, name, like, remote))
    return found


class JaxExplained(NamedTuple):
    """Whether JAX's cache would hit a spec's program on the target, and if not, why
    (pool.jax_cache.explain: the parts of JAX's key that differ from the nearest entry's)."""

    name: str
    key: str
    """JAX's key on the target."""
    hit: str
    """Where its entry is; "" for a miss."""
    why: str
    """For a miss, what differs (in words)."""

    def describe(self, shown: int = 3) -> str:
        """Says it in lines for people."""
        if self.hit:
            return f"{self.name}: would hit (JAX key {self.key} is in {self.hit})"
        return f"{self.name}: would miss (JAX key {self.key})\n  {self.why}"

    def to_json(self) -> dict[str, Any]:
        """Returns the explanation as JSON-ready data."""
        return {"name": self.name, "jax_key": self.key, "hit": self.hit, "why": self.why}


def _explain_for_jax(
    args: argparse.Namespace, programs: dict[str, Any], remote: Any
) -> list[JaxExplained]:
    """Each program's JAX key on the target --jax-cache and its options name, looked for in
    DIR, the disk cache and the remote tier; a miss explained against the entries filed for
    JAX in the disk cache (those pjrt-pool made, which record their key's parts)."""
    from pool.jax_cache.backing import known_entries, parts_of
    from pool.jax_cache.entries import entry_file
    from pool.jax_cache.explain import explain as explain_jax_miss

    check_jax_version()
    destination = jax_cache_option(args)
    assert destination is not None
    target = destination.target
    cache = DiskCache(args.cache_dir, create=False)
    found = []
    for name in _chosen(list(programs), args.names, f"the spec {args.file}"):
        _, jax = _lowered(name, programs[name], target.platform, target)
        assert jax is not None
        directory = destination.directory
        if directory is not None and entry_file(directory, jax.key).exists():
            found.append(JaxExplained(name, jax.key, f"the JAX cache {directory}", ""))
        elif where := where_held(cache, remote, key_of(parts_of(jax.key))):
            found.append(JaxExplained(name, jax.key, where, ""))
        else:
            store = BlobStore(cache, None)  # the entries pjrt-pool filed for JAX, with parts
            why = explain_jax_miss(jax.key, dict(jax.parts), known_entries(store))
            found.append(JaxExplained(name, jax.key, "", str(why)))
    return found


def _lowered(name: str, program: Any, platform: str, jax_target: Any = None) -> Any:
    """lower_warm_program's (lowered, jax) for a spec's program; one that does not lower is
    the user's to fix (UsageError, with its own error)."""
    from pool.warm.lowerer import lower_warm_program  # imports JAX: only for a spec

    try:
        return lower_warm_program(program, platform, jax_target)
    except Exception as error:
        raise UsageError(f"{name}: lowering failed: {type(error).__name__}: {error}") from None


def _entry_parts(cache: DiskCache, remote: Any, key: str) -> dict[str, Any] | None:
    """The key parts of the entry a manifest names: from the cache, else the remote."""
    try:
        parts = cache.read_header(key).fields.get("parts")
        return parts if isinstance(parts, dict) else None
    except (OSError, CorruptEntryError):
        pass
    fetched = None if remote is None else remote.fetch(key, cache.max_size)
    return None if fetched is None else dict(fetched[1].parts)


def _explain_manifest(args: argparse.Namespace, remote: Any) -> list[Explanation]:
    from pool.manifest import ManifestError, is_bundle, load_manifest

    if is_bundle(args.file):
        raise UsageError(f"{args.file} is a bundle: pjrt-pool bundle check says what it holds")
    try:
        manifest = load_manifest(args.file, args.cache_dir)
    except ManifestError as error:
        raise UsageError(str(error)) from None
    checked_manifest_cache_dir(manifest.cache_dir, args.cache_dir, args.file)
    here = _Here(DiskCache(manifest.cache_dir, create=False), topology_option(args))
    found = []
    for name in _chosen(list(manifest.specs), args.names, f"the manifest {args.file}"):
        spec = manifest.specs[name]
        identity = here.parts(spec.platform)
        like = Likeness(name, types_to_json(spec.input_types), types_to_json(spec.output_types))
        parts = _entry_parts(here.cache, remote, spec.key)
        if parts is None:
            related = related_entries(here.cache, identity, like, IDENTITY_PARTS)
            note = (
                f"the manifest names entry {spec.key}, which is in neither the cache nor the "
                "remote, and a manifest holds no program text: which part of the key differs "
                "cannot be said"
            )
            if related:
                note += f"; entries of a program named {name!r}, by where they were built:"
            found.append(Explanation(name, spec.key, "", tuple(related), note))
            continue
        explained = explain(here.cache, parts_here(parts, identity), name, like, remote)
        if explained.key == spec.key:
            found.append(explained)
            continue
        # Written on another machine: its entry is the first to say how it differs.
        note = f"the manifest names an entry built elsewhere; here the key is {explained.key}"
        if explained.hit:
            note += f", in {explained.hit}: write the manifest here (pjrt-pool warm --manifest)"
        own = Related(spec.key, name, True, tuple(differing_parts(parts, identity)))
        others = [r for r in explained.related if r.key != spec.key]
        found.append(Explanation(name, spec.key, "", (own, *others), note))
    return found


def _explain(args: argparse.Namespace) -> int:
    if args.jax_cache is not None and not _is_spec(args.file):
        raise UsageError(
            "--jax-cache explains a warm spec's programs (JAX's key needs the function): give "
            "the spec pjrt-pool warm --jax-cache was given, not a manifest"
        )
    remote = open_remote_option(args.remote)
    explaining = _explain_spec if _is_spec(args.file) else _explain_manifest
    with interrupts.at_once():  # it reads, imports JAX and lowers: nothing held to undo
        explanations = explaining(args, remote)
    if args.json:
        document = {
            "file": args.file,
            "programs": [e.to_json() for e in explanations],
            "hits": sum(bool(e.hit) for e in explanations),
            "misses": sum(not e.hit for e in explanations),
        }
        print(json.dumps(document, indent=2))
    else:
        for explanation in explanations:
            print(explanation.describe(shown=len(explanation.related) if args.all else 3))
        hits = sum(bool(e.hit) for e in explanations)
        print(f"{hits} of {len(explanations)} programs would hit, {len(explanations) - hits} miss")
    return ExitCode.OK if all(e.hit for e in explanations) else ExitCode.PROBLEMS
