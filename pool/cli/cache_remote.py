"""``pjrt-pool cache push | pull | gc --remote URL``: the local cache and the remote tier.

push publishes local entries to the remote (create-only; records signed as
every publish signs them); pull fetches entries into the local cache, those
a manifest names (``--manifest``) or every key the remote lists a record of
for this process's signer; gc deletes remote records older than
``--older-than`` (and, with ``--max-size``, the oldest others until the blobs
the rest name fit), then the blobs no record names (worker.cache.remote.eviction),
``--dry-run`` to see what it would delete. ``--remote`` defaults to
PJRT_POOL_CACHE_REMOTE; ``--concurrency`` (default
PJRT_POOL_CACHE_REMOTE_CONCURRENCY, else 16) bounds the requests in flight.
Exit codes as for every cache command: 0 when every entry is where it was
to go, 1 when some are not (refused, missing, failed) or the remote failed,
2 for usage and environment errors. Nothing here imports JAX.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from pool.cli.main import CommandError, ExitCode, UsageError
from pool.cli.options import (
    add_command,
    add_remote_option,
    argument_type,
    open_remote_option,
    size_argument,
)
from pool.cli.paths import checked_cache_dir
from worker.cache import DiskCache, format_size
from worker.cache.remote import RemoteCache, TransferReport
from worker.cache.remote.eviction import DEFAULT_GRACE
from worker.cache.remote.objects import RemoteError
from worker.words import counted

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """Reads 90, 45s, 30m, 12h, 7d or 2w as seconds; raises ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if match is None:
        raise ValueError(f"{text!r} is not a duration: write for example 3600, 90m, 12h or 30d")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


_duration = argument_type(parse_duration)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number above 0")
    return value


def register(commands: Any, common: argparse.ArgumentParser, epilog: str) -> None:
    """Adds push, pull and gc to the ``cache`` command's subcommands: each takes the options
    of common, and its --help ends with epilog."""
    remote = argparse.ArgumentParser(add_help=False)
    add_remote_option(remote, "the remote cache")
    remote.add_argument(
        "--concurrency",
        type=_positive,
        metavar="N",
        help="requests in flight at once (default: $PJRT_POOL_CACHE_REMOTE_CONCURRENCY, else 16)",
    )

    def command(name: str, run: Any, *texts: str) -> argparse.ArgumentParser:
        return add_command(
            commands, name, _checked(run), *texts, epilog=epilog, parents=(common, remote)
        )

    push = command(
        "push",
        _push,
        "publish local entries to the remote cache",
        "Publishes every local entry (or a manifest's) to the remote, create-only: "
        "reports how many were written, repaired (there, but gone or damaged), were there "
        "already, or were refused.",
    )
    pull = command(
        "pull",
        _pull,
        "fetch entries from the remote cache into the local one",
        "Fetches, concurrently, the entries a manifest names (--manifest), or every "
        "key the remote has a record of for this signer, verifying each, into the local cache; "
        "entries already local are not fetched.",
    )
    for parser, verb in ((push, "push"), (pull, "fetch")):
        parser.add_argument(
            "--manifest", metavar="FILE", help=f"{verb} only the programs of a manifest"
        )
    gc = command(
        "gc",
        _gc,
        "delete old records from the remote cache, then unreferenced blobs",
        "Deletes remote records written more than --older-than ago (they are never "
        "rewritten or touched on reads: their age is the time since they were published), and "
        "with --max-size the oldest others until the blobs the rest name fit, then the blobs no "
        "record names. Blobs younger than --grace are kept (a publish in flight).",
    )
    gc.add_argument(
        "--older-than",
        type=_duration,
        metavar="DURATION",
        help="delete the records written longer ago than this: 3600, 90m, 12h, 30d (give "
        "--older-than, --max-size or both)",
    )
    gc.add_argument(
        "--max-size",
        type=size_argument,
        metavar="SIZE",
        help="then delete the oldest records until the blobs the rest name fit: 50G",
    )
    gc.add_argument(
        "--grace",
        type=_duration,
        default=DEFAULT_GRACE,
        metavar="DURATION",
        help="keep blobs younger than this: a publish in flight (default 1h)",
    )
    gc.add_argument("--dry-run", action="store_true", help="say what would go; delete nothing")


def _checked(command: Any) -> Any:
    """Wraps a command so that an unusable local cache or a failing remote exits 1 (a bad
    --remote URL, remote setting or manifest is a UsageError: exit 2)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(command(args))
        except RemoteError as error:
            raise CommandError(f"the remote failed: {error}") from error
        except ValueError as error:  # ManifestError, bad settings
            raise CommandError(str(error)) from error

    return run


def _remote(args: argparse.Namespace, writing: bool) -> RemoteCache:
    tier = open_remote_option(args.remote)
    if tier is None:
        raise UsageError("name the remote cache: --remote URL, or set PJRT_POOL_CACHE_REMOTE")
    if writing and tier.state != "on":
        raise ValueError(
            f"this process cannot write the remote cache {tier.location.shown} ({tier.state}: "
            "PJRT_POOL_CACHE_REMOTE_READ_ONLY, an http(s) URL, or a public key without the "
            "private one)"
        )
    return tier


def _manifest_keys(args: argparse.Namespace) -> list[str] | None:
    if not args.manifest:
        return None
    from pool.manifest import ManifestError, load_manifest

    try:  # a manifest that does not load (a key that is none, say), as for `run`: exit 2
        manifest = load_manifest(args.manifest, args.cache_dir)
    except ManifestError as error:
        raise UsageError(str(error)) from None
    if manifest.bundle is not None:
        raise UsageError(f"{args.manifest} is a bundle: it carries its executables")
    return [manifest.spec(name).key for name in manifest.names]


def _report(args: argparse.Namespace, verb: str, tier: RemoteCache, report: TransferReport) -> int:
    """Prints a transfer's counts (or its JSON) and the remote's warnings; returns the exit."""
    if args.json:
        document = {"remote": tier.location.shown, **report.to_json()}
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        counts = ", ".join(f"{n} {what}" for what, n in sorted(report.counts().items()))
        print(
            f"{verb} {counted(len(report.outcomes), 'entry')} ({tier.location.shown}) in "
            f"{report.seconds:.2f} s: {counts or 'nothing to do'}"
        )
        for key, outcome in report.outcomes.items():
            if not outcome.ok:
                print(f"  {key}: {outcome.value}")
    return ExitCode.OK if report.ok else ExitCode.PROBLEMS


def _push(args: argparse.Namespace) -> int:
    from worker.cache.remote import push

    tier = _remote(args, writing=True)
    cache = DiskCache(checked_cache_dir(args.cache_dir), create=False)
    if cache.problem is not None:
        raise ValueError(f"the cache {cache.directory} cannot be used ({cache.problem})")
    report = push(tier, cache, _manifest_keys(args), concurrency=args.concurrency)
    return _report(args, "pushed", tier, report)


def _pull(args: argparse.Namespace) -> int:
    from worker.cache.open_caches import open_cache
    from worker.cache.remote import prefetch, remote_keys

    tier = _remote(args, writing=False)
    keys = _manifest_keys(args)
    if keys is None:
        keys = remote_keys(tier)
    cache = open_cache(checked_cache_dir(args.cache_dir, create=True))
    report = prefetch(tier, cache, keys, concurrency=args.concurrency)
    return _report(args, "pulled", tier, report)


def _gc(args: argparse.Namespace) -> int:
    from worker.cache.remote import collect

    if args.older_than is None and args.max_size is None:
        raise UsageError("name what to delete: --older-than DURATION, --max-size SIZE, or both")
    tier = _remote(args, writing=not args.dry_run)
    report = collect(
        tier,
        args.older_than,
        max_size=args.max_size,
        grace=args.grace,
        dry_run=args.dry_run,
        concurrency=args.concurrency,
    )
    if args.json:
        print(json.dumps({"remote": tier.location.shown, **report.to_json()}, indent=2))
        return ExitCode.OK
    would = "would delete" if report.dry_run else "deleted"
    print(
        f"{tier.location.shown}: {would} {counted(len(report.old_records), 'old record')}, "
        f"{counted(len(report.dangling_records), 'record')} whose blob is gone, "
        f"{counted(len(report.leases), 'expired lease')}, "
        f"{counted(len(report.blobs), 'unreferenced blob')} "
        f"({format_size(report.freed_bytes)}); kept {counted(report.kept_records, 'record')}, "
        f"{counted(report.kept_blobs, 'blob')} ({format_size(report.kept_bytes)})"
    )
    if report.unreadable_records:
        malformed = counted(len(report.unreadable_records), "malformed record")
        print(f"  {malformed} kept (they keep no blob)")
    if report.newer_records:
        print(
            f"  {counted(len(report.newer_records), 'record')} of a newer format kept (a newer "
            "pjrt-pool shares the remote): no blob deleted, as they may name any"
        )
    return ExitCode.OK
