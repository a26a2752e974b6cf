"""``pjrt-pool bundle create | merge | import | check``: warmed programs in one file.

create writes one bundle (an uncompressed tar: worker.bundle) of the
programs of one or more manifests and their cache entries; merge writes one
of several bundles, entries of a program built in different environments
side by side; import checks a whole bundle and then publishes its entries
into a cache (and, with --manifest, writes a manifest of this host's keys
for Pools); check says for each program of a bundle, or of a manifest and
its cache (and, with --remote or PJRT_POOL_CACHE_REMOTE, its remote tier),
whether it would load here, and for a miss how the entries found differ,
without deserializing anything. Exit status: 0 when everything was
done (check: every program would load), 1 when a program would miss or a
bundle was refused, 2 for usage errors.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from pool.cli.main import CommandError, ExitCode, UsageError
from pool.cli.options import (
    add_command,
    add_pool_option,
    add_remote_option,
    add_topology_options,
    open_remote_option,
    topology_option,
)
from pool.cli.paths import (
    checked_cache_dir,
    checked_manifest_cache_dir,
    input_file,
    manifest_or_bundle_file,
    output_file,
)
from pool.manifest import Manifest, ManifestError, is_bundle, load_manifest
from worker.bundle.importing import check_for_import, import_bundle
from worker.bundle.index import Index
from worker.bundle.preflight import Verdict, check_bundle, check_cached, judge
from worker.bundle.reader import Bundle
from worker.bundle.urls import shown
from worker.bundle.writer import create_bundle, merge_bundles
from worker.cache.entry import CorruptEntryError
from worker.cache.location import format_size
from worker.cache.store import DiskCache
from worker.compile.target import describe_environment, needs_topology_here, target_for
from worker.errors import (
    BundleError,
    PjrtError,
    PlatformMismatchError,
    PluginLoadError,
    PluginNotFoundError,
    TopologyError,
)
from worker.identity.target import runtime_key_parts
from worker.plugin.runtime import get_runtime
from worker.plugin.topology import TopologySpec, parse_topology
from worker.words import agreeing, counted

# The writer is imported by the commands that write bundles: with it comes
# tarfile (and the compression modules it imports, ~15 ms), which neither
# bundle check, the preflight a serving host runs before traffic, nor an
# import needs.


_BUNDLE_EXIT = (
    "exit status: 0 when everything was done (check: every program would load); 1 when a "
    "program would miss, a bundle was refused (damaged, or changed after it was made), an "
    "entry could not be read or stored, or an import's manifest leaves out programs not built "
    "for this host; 2 for usage and environment errors (a missing input, a manifest that is not "
    "one, a partial manifest without --allow-partial, a cache directory that cannot be used, no "
    "plugin for the platform)."
)


def register(subparsers: Any) -> None:
    """Adds the ``bundle`` command and its subcommands."""
    bundle = add_command(
        subparsers,
        "bundle",
        _name_a_command,
        "ship warmed programs as one verified file, and check it on the target",
        "Ships warmed programs as one verified file, to any host: create bundles the programs "
        "of manifests with their cache entries, merge puts several bundles in one, check says "
        "whether each program would load here, import puts a bundle's entries in a cache. "
        "pjrt-pool run runs a program straight from a bundle.",
        epilog=_BUNDLE_EXIT,
    )
    commands = bundle.add_subparsers(title="bundle commands", metavar="COMMAND")
    _register_create(commands)
    _register_merge(commands)
    _register_import(commands)
    _register_check(commands)


def _register_create(commands: Any) -> None:
    create = add_command(
        commands,
        "create",
        _create,
        "bundle the programs of manifests",
        "Writes one bundle (an uncompressed tar, the same bytes for the same inputs) of the "
        "programs of one or more manifests and their cache entries, each checked as it is "
        "read. A partial manifest, of a warm that did not warm every program (interrupted, or "
        "programs failed), is refused unless --allow-partial.",
        epilog=_BUNDLE_EXIT,
    )
    create.add_argument(
        "manifests",
        metavar="MANIFEST",
        nargs="+",
        help="a manifest of warmed programs (pjrt-pool warm --manifest); one or more",
    )
    create.add_argument("-o", "--output", metavar="FILE", required=True, help="the bundle to write")
    add_pool_option(create, "cache_dir", "the cache the entries are in", default="each manifest's")
    add_remote_option(create, "read the entries the cache lacks from this remote tier, verified")
    create.add_argument(
        "--allow-partial",
        action="store_true",
        help="bundle the programs of a partial manifest (a warm that did not warm every program "
        "wrote it: interrupted, or programs failed; it names only the programs warmed)",
    )


def _register_merge(commands: Any) -> None:
    merge = add_command(
        commands,
        "merge",
        _merge,
        "one bundle of several (for a mixed fleet)",
        "Writes one bundle of several: the entries of a program built in different environments "
        "(CPU generations, plugin builds, XLA flags) side by side, for a mixed fleet; a loader "
        "picks the entry built for its own.",
        epilog=_BUNDLE_EXIT,
    )
    merge.add_argument(
        "bundles", metavar="BUNDLE", nargs="+", help="a bundle, or its URL; one or more"
    )
    merge.add_argument("-o", "--output", metavar="FILE", required=True, help="the bundle to write")


def _register_import(commands: Any) -> None:
    importing = add_command(
        commands,
        "import",
        _import,
        "check a bundle, then put it in a cache",
        "Checks a whole bundle (every member's digests and signature, its key, its size against "
        "the cache's bound) and then publishes its entries into a cache, as compiling would. "
        "With --manifest, also writes the manifest of the entries built for this host, to run "
        "them from that cache.",
        epilog=_BUNDLE_EXIT,
    )
    importing.add_argument("bundle", metavar="FILE", help="a bundle, or its URL")
    add_pool_option(importing, "cache_dir", "the cache to import into, made if missing")
    importing.add_argument(
        "--manifest",
        metavar="FILE",
        help="also write a manifest of the entries built for this host",
    )


def _register_check(commands: Any) -> None:
    check = add_command(
        commands,
        "check",
        _check,
        "will each program load here? (exit 0 only if all would)",
        "Says for each program of a bundle, or of a manifest and its cache (and remote tier), "
        "whether it would load on this machine, and for a miss which key parts differ. Loads "
        "the plugin, deserializes nothing.",
        epilog=_BUNDLE_EXIT,
    )
    check.add_argument("file", metavar="FILE", help="a bundle (or its URL), or a manifest")
    add_pool_option(check, "cache_dir", "for a manifest: its cache", default="the manifest's")
    add_remote_option(
        check, "for a manifest: the remote cache tier, asked for what its cache lacks"
    )
    add_pool_option(check, "platform", "the plugin to check with", default="the programs'")
    add_topology_options(
        check,
        "judge for a host of this TPU topology, with this machine's plugin build, opening no "
        "device (default: this host's devices; on a machine without a TPU, each topology the "
        "entries were built for)",
    )
    check.add_argument("--json", action="store_true", help="print the verdicts as JSON")


def _name_a_command(_args: argparse.Namespace) -> int:
    raise UsageError("name a bundle command: create, merge, import or check")


def _output(path: str, inputs: list[str], flag: str = "-o") -> Path:
    output = Path(path)
    if output.is_dir():
        raise UsageError(f"{flag} {path} is a directory; name the file to write")
    output_file(output, flag)
    for item in inputs:
        input_file(item, "the input")
    if not output.parent.is_dir():
        raise UsageError(f"-o {path}: the directory {output.parent} does not exist")
    if any(output.resolve() == Path(item).resolve() for item in inputs):
        raise UsageError(f"-o {path} is one of the inputs; write the bundle elsewhere")
    return output


def _describe(output: Path, index: Index) -> str:
    with open(output, "rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    return (
        f"bundle {output}: {counted(len(index.programs), 'program')}, "
        f"{counted(len(index.entries), 'entry')} built in "
        f"{counted(len(index.environments), 'environment')}, "
        f"{format_size(output.stat().st_size)}, sha256 {digest}"
    )


def _refuse_partial(path: str, manifest: Manifest, allowed: bool) -> str | None:
    """What to say of a partial manifest (its warm did not warm every program): None for a
    complete one; UsageError for a partial one unless allowed."""
    if not manifest.partial:
        return None
    warmed = counted(len(manifest.names), "program")
    missing = manifest.missing
    left_out = (
        f" ({'; '.join(f'{name}: {why}' for name, why in list(missing.items())[:3])}"
        + (f"; and {len(missing) - 3} more" if len(missing) > 3 else "")
        + ")"
        if missing
        else ""
    )
    if not allowed:
        raise UsageError(
            f"{path} is a partial manifest: the warm that wrote it did not warm every program "
            f"(it was interrupted, or programs failed{left_out}), and it names only the "
            f"{warmed} warmed; warm the spec again to complete it, or pass --allow-partial to "
            "bundle these programs alone"
        )
    return f"partial: {path} names only the {warmed} warmed (its warm did not warm the rest)"


def _create(args: argparse.Namespace) -> int:
    output = _output(args.output, args.manifests)
    remote = open_remote_option(args.remote)  # UsageError for a URL or setting it cannot use
    programs = []
    notes: list[str] = []  # of partial manifests, said with the bundle
    caches: dict[str | None, DiskCache] = {}
    for path in args.manifests:
        if is_bundle(path):
            raise UsageError(
                f"{shown(path)} is a bundle; bundle create takes manifests (merge bundles)"
            )
        try:
            manifest = load_manifest(path, args.cache_dir)
        except ManifestError as error:
            raise UsageError(str(error)) from None
        notes += filter(None, [_refuse_partial(path, manifest, args.allow_partial)])
        cache = caches.get(manifest.cache_dir)
        if cache is None:
            checked_manifest_cache_dir(manifest.cache_dir, args.cache_dir, path)
            try:
                cache = caches[manifest.cache_dir] = DiskCache(manifest.cache_dir, create=False)
            except ValueError as error:  # a bad signing setting
                raise CommandError(str(error)) from error
        if not cache.usable and remote is None:
            raise UsageError(
                f"{path}: its cache {cache.directory} does not exist; pass the cache the "
                "programs were warmed into (--cache-dir)"
            )
        programs += [(spec, cache, f" (from {path})") for spec in manifest.specs.values()]
    try:
        index = create_bundle(output, programs, remote=remote)
    except (BundleError, ValueError, OSError) as error:
        raise CommandError(str(error)) from error
    print(_describe(output, index))
    for note in notes:
        print(f"  {note}")
    return ExitCode.OK


def _merge(args: argparse.Namespace) -> int:
    output = _output(args.output, args.bundles)
    try:
        index = merge_bundles(output, args.bundles)
    except (BundleError, ValueError, OSError) as error:
        raise CommandError(str(error)) from error
    print(_describe(output, index))
    return ExitCode.OK


def _here(
    platform: str, cache: DiskCache | None, topology: TopologySpec | None = None
) -> dict[str, Any]:
    """Loads the plugin (nothing else) and returns this process's key parts: on its device,
    or (a topology given) for that topology without a device."""
    try:
        runtime = get_runtime(platform, deviceless=topology is not None)
        return runtime_key_parts(runtime, cache, target=target_for(runtime, topology))
    except (PluginNotFoundError, PluginLoadError, PlatformMismatchError, PjrtError) as error:
        raise UsageError(f"platform {platform}: {error}") from None
    except TopologyError as error:
        raise UsageError(str(error)) from None


class _Judged(NamedTuple):
    """The key parts a check judges by, and what they stand for (for people)."""

    parts: dict[str, Any]
    what: str


def _judged_for(
    platform: str,
    cache: DiskCache | None,
    given: TopologySpec | None,
    built_for: Callable[[], list[Any]],
) -> list[_Judged]:
    """What to judge a bundle's or manifest's programs against: this host's device; or a
    topology given; or, on a platform whose executables are tied to a topology and no such
    device is here, each topology the entries were built for (their key parts' topology,
    built_for), judged without a device with this host's plugin build."""
    if given is not None:
        return [_Judged(_here(platform, cache, given), f"for a host of {given}")]
    if not needs_topology_here(platform):
        return [_Judged(_here(platform, cache), "here")]
    names = sorted({p["name"] for p in built_for() if isinstance(p, dict) and p.get("name")})
    if not names:
        raise UsageError(
            f"no {platform} device is attached here and the entries name no topology: give "
            "--topology NAME to judge them for a host of that topology"
        )
    return [
        _Judged(
            _here(platform, cache, parse_topology(name)),
            f"for a host of {name} (no {platform} device here: judged with this host's plugin "
            "build, without a device)",
        )
        for name in names
    ]


def _import(args: argparse.Namespace) -> int:
    input_file(args.bundle, "the bundle")
    if args.manifest:
        _output(args.manifest, [args.bundle], "--manifest")
    checked_cache_dir(args.cache_dir, creatable=True)  # exit 2 before the bundle is read
    try:
        existing = DiskCache(args.cache_dir, create=False)
        if not existing.usable:
            # No cache there yet: the bundle is checked before one is made, so that a
            # refused bundle leaves no empty cache behind.
            with Bundle(args.bundle, existing.signer) as bundle:
                check_for_import(bundle, existing.max_size)
            checked_cache_dir(args.cache_dir, create=True)  # made, or exit 2 saying why not
        cache = DiskCache(args.cache_dir)
        result = import_bundle(args.bundle, cache)
    except (BundleError, ValueError) as error:
        raise CommandError(str(error)) from error
    print(
        f"imported {counted(result.imported, 'entry')} ({format_size(result.bytes)}) into "
        f"{cache.directory}; {result.present} {agreeing(result.present, 'was', 'were')} there "
        "already" + (f"; {result.not_stored} could not be stored" if result.not_stored else "")
    )
    if result.not_stored:
        return ExitCode.PROBLEMS
    if not args.manifest:
        return ExitCode.OK
    with Bundle(args.bundle, cache.signer) as bundle:
        programs = list(bundle.index.programs.values())
        platform = programs[0].platform
        here = _here(platform, cache)
        verdicts = [judge(bundle.index, program, here) for program in programs]
    specs = [
        program.spec(verdict.key)
        for program, verdict in zip(programs, verdicts, strict=True)
        if verdict.loads
    ]
    Manifest(specs, str(cache.directory), platform).write(args.manifest)
    print(f"manifest: {args.manifest} ({len(specs)} of {counted(len(programs), 'program')})")
    for verdict in verdicts:
        if not verdict.loads:
            print(verdict.describe())
    return ExitCode.OK if len(specs) == len(programs) else ExitCode.PROBLEMS


def _check(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    manifest_or_bundle_file(args.file)
    try:
        if is_bundle(args.file):
            if args.cache_dir is not None or args.remote is not None:
                option = "--cache-dir" if args.cache_dir is not None else "--remote"
                raise UsageError(f"{option} is for a manifest; a bundle carries its entries")
            with Bundle(args.file) as bundle:
                bundle.archive.check_headers()  # a URL's: what opening a file checks
                bundle.check_digests()  # every entry, those built elsewhere too: the whole file
                programs = list(bundle.index.programs.values())
                platform = args.platform or (programs[0].platform if programs else "cpu")
                environments = bundle.index.environments.values()
                judged = _judged_for(
                    platform,
                    None,
                    topology_option(args),
                    lambda: [environment.parts.get("topology") for environment in environments],
                )
                checks = [(j, check_bundle(bundle, j.parts, platform)) for j in judged]
        else:
            manifest = load_manifest(args.file, args.cache_dir)
            remote = open_remote_option(args.remote)
            checked_manifest_cache_dir(manifest.cache_dir, args.cache_dir, args.file)
            cache = DiskCache(manifest.cache_dir, create=False)
            specs = list(manifest.specs.values())
            platform = args.platform or (specs[0].platform if specs else "cpu")
            usable = cache if cache.usable else None
            judged = _judged_for(
                platform,
                usable,
                topology_option(args),
                lambda: [_entry_topology(cache, spec.key) for spec in specs],
            )
            checks = [(j, check_cached(specs, cache, j.parts, platform, remote)) for j in judged]
    except ManifestError as error:
        raise UsageError(str(error)) from None
    except (BundleError, ValueError) as error:
        raise CommandError(str(error)) from error
    seconds = time.perf_counter() - started
    _report(args, checks, seconds)
    fine = all(verdict.loads for _, verdicts in checks for verdict in verdicts)
    return ExitCode.OK if fine else ExitCode.PROBLEMS


def _entry_topology(cache: DiskCache, key: str) -> Any:
    """The topology key part of a cached entry, or None (no entry, or none it can read)."""
    try:
        fields = cache.read_header(key).fields
    except (OSError, CorruptEntryError):
        return None
    parts = fields.get("parts")
    return parts.get("topology") if isinstance(parts, dict) else None


def _report(
    args: argparse.Namespace, checks: list[tuple[_Judged, list[Verdict]]], seconds: float
) -> None:
    if args.json:
        documents = [_check_json(args, judged, verdicts, seconds) for judged, verdicts in checks]
        print(json.dumps(documents[0] if len(documents) == 1 else documents, indent=2))
        return
    for judged, verdicts in checks:
        if len(checks) > 1 or judged.what != "here":
            print(f"-- {judged.what}: {describe_environment(judged.parts)}")
        for verdict in verdicts:
            print(verdict.describe())
        loads = sum(verdict.loads for verdict in verdicts)
        print(
            f"{loads} of {counted(len(verdicts), 'program')} would load {judged.what}, "
            f"{len(verdicts) - loads} would miss ({seconds * 1000:.0f} ms)"
        )


def _check_json(
    args: argparse.Namespace, judged: _Judged, verdicts: list[Verdict], seconds: float
) -> dict[str, Any]:
    loads = sum(verdict.loads for verdict in verdicts)
    return {
        "file": shown(args.file),
        "judged": judged.what,
        "environment": describe_environment(judged.parts),
        "ok": loads == len(verdicts),
        "loads": loads,
        "would_miss": len(verdicts) - loads,
        "seconds": round(seconds, 6),
        "programs": [verdict.to_json() for verdict in verdicts],
    }
