"""``pjrt-pool cache info | list | verify [--load] | prune --max-size SIZE | clear [--yes]``.

(and ``push | pull | gc --remote URL``, for the remote tier: pool.cli.cache_remote; and
``explain SPEC_OR_MANIFEST``, why a program would miss: pool.cli.cache_explain)

Human-readable tables by default; ``--json`` prints one JSON document for
scripts. ``--cache-dir`` names the directory (default: PJRT_POOL_CACHE_DIR,
else the user cache directory); no command but prune, clear and pull changes
it, and none but pull creates it. Nothing here imports JAX (but explain, lowering a
spec); ``verify --load`` loads
entries with the plugin in child processes (``python -m worker.serve.entry_check``),
so that an entry that crashes the plugin is reported instead of crashing this.
A directory that others could write is refused (exit 2, as for every command)
as compiling refuses it (see worker.cache.trust), and with signing on
(PJRT_POOL_CACHE_SECRET or PJRT_POOL_CACHE_KEY_FILE) verify reports entries
without the right signature as bad.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pool.cli import cache_explain, cache_remote
from pool.cli.main import CommandError, ExitCode, UsageError
from pool.cli.options import (
    add_command,
    add_pool_option,
    add_remote_option,
    open_remote_option,
    size_argument,
)
from pool.cli.paths import checked_cache_dir
from pool.errors import describe_exit
from pool.spawn import child_environment, python_command
from worker.cache import CACHE_DIR_ENV, DiskCache, format_size
from worker.cache import report as cache_report
from worker.cache.report import OTHER, UNREADABLE
from worker.plugin.locate import env_var
from worker.words import counted

LOAD_TIMEOUT = 120.0
"""Seconds a verifying child may take to start and load its plugin..."""
LOAD_TIMEOUT_PER_ENTRY = 30.0
"""...plus this much per entry, after which it counts as hung on its current entry."""
PRUNE_WAIT = 60.0
"""Seconds prune waits for another process's trim or write to finish."""


_CACHE_EXIT = (
    "exit status: 0 when everything asked for was done; 1 when problems were found or an "
    "operation failed (verify: a bad or unreadable entry; prune or clear: entries that could "
    "not be removed, or folders that are not real directories; push and pull: an entry that "
    "did not end where it was to go; a remote that failed); 2 for usage and environment "
    "errors (a cache directory that is a file or that others can write, a signing setting it "
    "cannot use, no remote named, a --manifest that does not load, a plugin that does not load "
    "for verify --load)."
)


def register(subparsers: Any) -> None:
    """Adds the ``cache`` command and its subcommands."""
    cache = add_command(
        subparsers,
        "cache",
        _name_a_command,
        "inspect and maintain the disk cache of compiled executables",
        "Inspects and maintains the disk cache of compiled executables, and moves entries to "
        "and from its remote tier. Tables by default, --json for one JSON document. Only pull "
        "creates the cache directory; only prune, clear and pull change it.",
        epilog=_CACHE_EXIT,
    )
    common = argparse.ArgumentParser(add_help=False)
    add_pool_option(common, "cache_dir", "the cache directory")
    common.add_argument("--json", action="store_true", help="print one JSON document")
    commands = cache.add_subparsers(title="cache commands", metavar="COMMAND")

    def command(name: str, run: Any, *texts: str) -> argparse.ArgumentParser:
        return add_command(
            commands,
            name,
            _refusing_bad_settings(run),
            *texts,
            epilog=_CACHE_EXIT,
            parents=(common,),
        )

    info = command("info", _info, "where the cache is and how full, and how it is signed")
    add_remote_option(
        info, "also say how this host uses this remote cache tier: whether it signs its records"
    )
    command("list", _list, "one line per entry")
    verify = command(
        "verify",
        _verify,
        "check every entry's digests (exit 1 if any is bad)",
        "Checks every entry's header and payload digests. With --load, also "
        "loads each entry with the plugin, in a child process; entries made by another "
        "plugin build or on another host are reported as such, not as bad.",
    )
    verify.add_argument(
        "--load",
        action="store_true",
        help="also load each entry with the plugin, in a child process (an entry that crashes "
        "the plugin is reported as bad)",
    )
    prune = command("prune", _prune, "evict least-recently-used entries down to a size")
    prune.add_argument(
        "--max-size",
        required=True,
        type=size_argument,
        metavar="SIZE",
        help="the size to evict down to, for example 500M or 2G",
    )
    clear = command(
        "clear",
        _clear,
        "remove every entry",
        "Removes every entry (lock files stay), after asking on the terminal, or without "
        "asking with --yes.",
    )
    clear.add_argument("--yes", action="store_true", help="remove without asking")
    cache_remote.register(commands, common, _CACHE_EXIT)
    cache_explain.register(commands, common)


def _name_a_command(_args: argparse.Namespace) -> int:
    raise UsageError(
        "name a cache command: info, list, verify, explain, prune, clear, push, pull or gc"
    )


def _open(args: argparse.Namespace) -> DiskCache:
    return DiskCache(checked_cache_dir(args.cache_dir), create=False)


def _refusing_bad_settings(command: Any) -> Any:
    """Wraps a command so that a setting it cannot use (signing, size bound, sharing: a
    ValueError naming the variable) is a usage error, as an untrusted directory is."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(command(args))
        except ValueError as error:
            raise UsageError(str(error)) from error

    return run


def _print_json(document: Any) -> None:
    print(json.dumps(document, indent=2, sort_keys=True))


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in (headers, *rows)
    ]
    return "\n".join(line.rstrip() for line in lines)


# -- info and list ---------------------------------------------------------


def _info(args: argparse.Namespace) -> int:
    summary = cache_report.info(_open(args))
    if args.json:
        tier = open_remote_option(args.remote)
        remote = None
        if tier is not None:
            remote = {
                "url": tier.location.shown,
                "state": tier.state,
                "signer": tier.signer,
                "signs": tier.signs,
            }
        _print_json({**summary, "remote": remote})
        return ExitCode.OK
    state = (
        "missing" if not summary["exists"] else ("writable" if summary["writable"] else "read-only")
    )
    used = summary["entry_bytes"] + summary["temp_bytes"]
    share = f"{100 * used / summary['max_size']:.1f}%" if summary["max_size"] else "-"
    rows = [
        ("directory", f"{summary['directory']} ({state})"),
        ("entries", f"{summary['entries']} ({format_size(summary['entry_bytes'])})"),
        ("being written", f"{summary['temp_files']} ({format_size(summary['temp_bytes'])})"),
        (
            "bound",
            f"{format_size(summary['max_size'])} (from {summary['max_size_from']}), {share} used",
        ),
        ("lock files", str(summary["lock_files"])),
        ("sharing", "group-shared" if summary["shared"] else "private to this user"),
        (
            "signing",
            f"on (key id {summary['signing_key_id']})" if summary["signing_key_id"] else "off",
        ),
        ("last used", _when(summary["newest_use"])),
        ("least recently used", _when(summary["oldest_use"])),
    ]
    rows += _remote_rows(args.remote)
    print("\n".join(f"{name:<20} {value}" for name, value in rows))
    return ExitCode.OK


def _remote_rows(option: str | None) -> list[tuple[str, str]]:
    """info's lines of the remote tier (--remote, else PJRT_POOL_CACHE_REMOTE): where, whether
    this host writes it, and how it signs; none without a remote."""
    tier = open_remote_option(option)
    if tier is None:
        return []
    return [
        ("remote", f"{tier.location.shown} ({tier.state})"),
        ("remote signing", tier.signing()),
    ]


def _list(args: argparse.Namespace) -> int:
    cache = _open(args)
    records = cache_report.list_entries(cache)
    if args.json:
        _print_json({"directory": str(cache.directory), "entries": records})
        return ExitCode.OK
    if not records:
        print(f"no entries in {cache.directory}")
        return ExitCode.OK
    rows = []
    for record in records:
        seconds = record.get("compile_seconds")
        rows.append(
            (
                record["key"][:16],
                format_size(record["size"]),
                _when(record["last_used"]),
                record.get("platform") or "-",
                record.get("api_version") or "-",
                "-" if seconds is None else f"{seconds:.3f} s",
                record.get("name") or f"(unreadable: {record.get('error')})",
            )
        )
    headers = ("KEY", "SIZE", "LAST USED", "PLATFORM", "PJRT API", "COMPILE", "PROGRAM")
    print(_table(headers, rows))
    total = sum(record["size"] for record in records)
    print(f"{counted(len(records), 'entry')}, {format_size(total)}")
    return ExitCode.OK


# -- verify ----------------------------------------------------------------


def _run_verifier(directory: Path, platform: str, keys: list[str]) -> tuple[list[Any], str | None]:
    """Runs one verifying child; returns its records and, if it did not finish, how it ended."""
    timeout = LOAD_TIMEOUT + LOAD_TIMEOUT_PER_ENTRY * len(keys)
    command = python_command("worker.serve.entry_check", "--platform", platform)
    try:
        done = subprocess.run(
            command,
            input="\n".join(keys),
            env=child_environment({CACHE_DIR_ENV: str(directory)}),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        stdout: str | bytes = done.stdout
        ending = None if done.returncode == 0 else describe_exit(done.returncode)
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout or ""
        ending = f"hung for over {timeout:.0f} s"
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    records = []
    for line in stdout.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # the plugin's own output
    return [r for r in records if isinstance(r, dict)], ending


def _load_with_plugin(
    directory: Path, platform: str, keys: list[str]
) -> dict[str, tuple[str, str]]:
    """Loads entries in child processes; returns {key: (status, detail)}.

    A child that dies or hangs on an entry marks that entry bad, and a new
    child goes on with the rest.
    """
    results: dict[str, tuple[str, str]] = {}
    pending = list(keys)
    while pending:
        records, ending = _run_verifier(directory, platform, pending)
        current = None
        checked = 0
        for record in records:
            if "error" in record and (
                record.get("kind") == "PluginLoadError" or os.environ.get(env_var(platform))
            ):  # the plugin installed or named here does not load: this machine's set-up
                raise UsageError(f"platform {platform}: {record['error']}")
            if "error" in record:  # no plugin for this platform here: another host's entries
                return {key: (OTHER, record["error"]) for key in pending} | results
            if "checking" in record:
                current = record["checking"]
            elif "key" in record:
                results[record["key"]] = (record.get("status", "bad"), record.get("detail", ""))
                current = None
                checked += 1
        if ending is None:
            break  # keys without a result vanished meanwhile
        if current is not None:
            results[current] = ("bad", f"the plugin process {ending} loading it")
        elif not checked:  # died loading the plugin: nothing says the entries are at fault
            detail = f"the verifying process {ending} before checking entries"
            return {key: (OTHER, detail) for key in pending if key not in results} | results
        pending = [key for key in pending if key not in results]
    return results


def _verify(args: argparse.Namespace) -> int:
    cache = _open(args)
    records = cache_report.check_entries(cache)
    if args.load:
        platforms: dict[str, list[str]] = {}
        for record in records:
            if record["status"] == "ok":
                platforms.setdefault(record["platform"] or "cpu", []).append(record["key"])
        for platform, keys in platforms.items():
            loaded = _load_with_plugin(cache.directory, platform, keys)
            for record in records:
                if record["key"] in loaded:
                    record["status"], record["detail"] = loaded[record["key"]]
    counts = {status: 0 for status in ("ok", "bad", UNREADABLE, OTHER)}
    for record in records:
        counts[record["status"]] = counts.get(record["status"], 0) + 1
    if args.json:
        _print_json(
            {
                "directory": str(cache.directory),
                "loaded": args.load,
                "entries": records,
                "ok": counts["ok"],
                "bad": counts["bad"],
                "unreadable": counts[UNREADABLE],
                "other": counts[OTHER],
            }
        )
    elif records:
        rows = [(r["key"][:16], format_size(r["size"]), r["status"], r["detail"]) for r in records]
        print(_table(("KEY", "SIZE", "STATUS", "DETAIL"), rows))
        print(
            f"{counted(len(records), 'entry')}: {counts['ok']} ok, {counts['bad']} bad, "
            f"{counts[UNREADABLE]} unreadable, {counts[OTHER]} for another plugin build or host"
        )
    else:
        print(f"no entries in {cache.directory}")
    return ExitCode.PROBLEMS if counts["bad"] or counts[UNREADABLE] else ExitCode.OK


# -- prune and clear -------------------------------------------------------


def _refuse_unusable(cache: DiskCache) -> None:
    """Raises CommandError (exit 1), with the reason, for a cache that exists but cannot be used.

    A missing cache has nothing to change; one with a symlink or a file
    where a folder should be is never changed through it.
    """
    if cache.problem is not None:
        raise CommandError(
            f"the cache {cache.directory} cannot be used ({cache.problem}); nothing was changed"
        )


def _prune(args: argparse.Namespace) -> int:
    cache = _open(args)
    _refuse_unusable(cache)
    result = cache.trim(args.max_size, wait=PRUNE_WAIT) if cache.usable else None
    if result is not None and not result.ran:
        reason = (
            f"another process held the space lock for {PRUNE_WAIT:.0f} s"
            if cache.writable
            else f"cannot write {cache.directory}"
        )
        raise CommandError(reason)
    document = {
        "directory": str(cache.directory),
        "max_size": args.max_size,
        "evicted": 0 if result is None else result.evicted,
        "total_before": 0 if result is None else result.total_before,
        "total_after": 0 if result is None else result.total_after,
        "temp_removed": 0 if result is None else result.temp_removed,
    }
    if args.json:
        _print_json(document)
    else:
        print(
            f"evicted {counted(document['evicted'], 'entry')} and "
            f"{counted(document['temp_removed'], 'stale temporary file')}: "
            f"{format_size(document['total_before'])} -> "
            f"{format_size(document['total_after'])} (bound {format_size(args.max_size)})"
        )
    return ExitCode.OK


def _clear(args: argparse.Namespace) -> int:
    cache = _open(args)
    _refuse_unusable(cache)
    entries = [entry for entry in cache.list_entries() if entry.regular]
    if entries and not args.yes:
        if not sys.stdin.isatty():
            raise UsageError("pass --yes to clear without a terminal to confirm on")
        size = format_size(sum(e.size for e in entries))
        answer = input(
            f"remove {counted(len(entries), 'entry')} ({size}) from {cache.directory}? [y/N] "
        )
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return ExitCode.OK
    cleared = cache.clear_entries()
    left = [str(path) for path in cleared.left]
    if args.json:
        failed = [str(path) for path, _ in cleared.failed]
        document = {"removed": cleared.removed, "left": left, "failed": failed}
        _print_json({"directory": str(cache.directory), **document})
    else:
        print(
            f"removed {counted(cleared.removed, 'entry')} from {cache.directory} (lock files stay)"
        )
        if left:
            print(
                f"left {len(left)} that {'is' if len(left) == 1 else 'are'} named like an entry "
                f"but not a regular file (a directory or a link), which clear never removes: "
                f"{', '.join(left)}; remove {'it' if len(left) == 1 else 'them'} by hand"
            )
    if cleared.failed:
        path, error = cleared.failed[0]
        others = len(cleared.failed) - 1
        raise CommandError(
            f"could not remove {len(cleared.failed)} of {len(cleared.failed) + cleared.removed} "
            f"entries ({path.name}: {error.strerror}{f', and {others} more' if others else ''}); "
            f"make {path.parent} writable for this user and clear again"
        )
    return ExitCode.PROBLEMS if left else ExitCode.OK
