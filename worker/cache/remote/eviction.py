"""Evicting from the remote: records older than a cutoff first, then the blobs none names.

Readers never write (no access-time objects: a hit costs reads only), so age
is the time the store wrote an object, from its listing: a record is
rewritten only to replace one that did not serve (RemoteCache.publish), so
its age is the time since its key was last published.
collect() deletes, in this order:

1. records written before the cutoff (every signer's), and with a size
   bound the oldest of the others until the blobs the rest name fit in it:
   their keys are then misses, compiled and published again by whoever
   needs them;
2. records whose blob is gone (left by a race with an earlier collection),
   unless younger than ``grace``;
3. blobs no remaining record names;
4. program index names (``programs/<program>/<key>``, hints for refusals)
   of keys no remaining record is for;
5. leases (lease.py) that have expired, or cannot be read, and were last
   written before ``grace``: a live holder renews its lease (rewrites it)
   every third of its time, and a released one is left for the next host
   to take over, so these are of hosts long gone.

A publisher writes its blob before its record, and a blob it finds there
already is not rewritten: a blob younger than ``grace`` seconds is never
deleted, so a publish in flight keeps its blob. A record that cannot be
read for a failed request stops the collection before anything is deleted.
What this version cannot read it leaves: a record of a newer format (a
newer pjrt-pool sharing the remote) may name any blob, so while one is
there no blob is deleted (the other steps go on). A file://
remote refuses links inside it (files.py): a collection never deletes
through one.
The one race left (a publish that reuses an old unreferenced blob while it is being
deleted) leaves a record naming a missing blob: readers take it for a miss
(never a wrong result), the next publish of its key replaces it, and the
next collection removes it if none did (step 2). A lease taken over between
its read and its deletion here is lost to its new holder: the store has no
conditional delete, and that costs at most a second compile of one key.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.cache.remote.layout import (
    MAX_RECORD_SIZE,
    BadRecordError,
    NewRecordError,
    decode_record,
    parse_blob_name,
    parse_index_name,
    parse_record_name,
)
from worker.cache.remote.lease import MAX_LEASE_SIZE, decode_lease, parse_lease_name
from worker.cache.remote.objects import Failure, ObjectInfo, RemoteError
from worker.cache.remote.transfer import run_concurrently

if TYPE_CHECKING:
    from worker.cache.remote.tier import RemoteCache

DEFAULT_GRACE = 3600.0
"""Seconds a new blob or record is kept whatever else holds (a publish in flight)."""
NEWER = "newer"
"""What _named_blob says of a record of a newer format: it may name any blob."""


@dataclass
class CollectReport:
    """What a collection deleted (or, dry run, would delete) and kept."""

    dry_run: bool
    old_records: list[str] = field(default_factory=list)
    dangling_records: list[str] = field(default_factory=list)
    """Records whose blob is gone."""
    unreadable_records: list[str] = field(default_factory=list)
    """Records that could not be read or parsed: kept, and they keep no blob."""
    newer_records: list[str] = field(default_factory=list)
    """Records of a newer format (a newer pjrt-pool's): kept, and while any is there no blob
    is deleted, since this version cannot tell which they name."""
    blobs: list[str] = field(default_factory=list)
    """Unreferenced blobs deleted."""
    index_names: list[str] = field(default_factory=list)
    """Program index names of keys left without a record, deleted."""
    leases: list[str] = field(default_factory=list)
    """Leases that expired (or cannot be read) and were last written before the grace, deleted."""
    freed_bytes: int = 0
    kept_records: int = 0
    kept_blobs: int = 0
    kept_bytes: int = 0

    def to_json(self) -> dict[str, object]:
        """The report as a JSON-ready dict."""
        return {
            "dry_run": self.dry_run,
            "deleted_records": len(self.old_records) + len(self.dangling_records),
            "old_records": self.old_records,
            "dangling_records": self.dangling_records,
            "unreadable_records": self.unreadable_records,
            "newer_records": self.newer_records,
            "deleted_blobs": self.blobs,
            "deleted_index_names": self.index_names,
            "deleted_leases": self.leases,
            "freed_bytes": self.freed_bytes,
            "kept_records": self.kept_records,
            "kept_blobs": self.kept_blobs,
            "kept_bytes": self.kept_bytes,
        }


def _named_blob(remote: RemoteCache, record: ObjectInfo) -> str | None:
    """The SHA-256 a listed record names; None if it is gone or malformed, NEWER if it is of
    a newer format.

    Raises RemoteError when it cannot be read: a blob it may name must not be
    judged unreferenced for a failed request.
    """
    parsed = parse_record_name(record.path)
    if parsed is None:
        return None
    key, signer = parsed
    deadline = time.monotonic() + remote.limits.deadline
    try:
        data = remote.client.get(record.path, MAX_RECORD_SIZE, deadline)
        return None if data is None else decode_record(data, key, signer).sha256
    except NewRecordError:
        return NEWER
    except BadRecordError:
        return None
    except RemoteError as error:
        if error.failure is Failure.TOO_LARGE:  # no record is that large
            return None
        raise


def _lease_ended(remote: RemoteCache, lease: ObjectInfo) -> bool:
    """Whether a listed lease has expired or cannot be read (it is gone: not to delete)."""
    key = parse_lease_name(lease.path)
    if key is None:
        return False
    deadline = time.monotonic() + remote.limits.deadline
    found = remote.client.get_versioned(lease.path, MAX_LEASE_SIZE, deadline)
    if found is None:
        return False
    read = None if found.data is None else decode_lease(found.data, key)
    return read is None or read.expired()


def _oldest_over(
    records: list[ObjectInfo],
    named: dict[str, str | None],
    blobs: dict[str, ObjectInfo],
    bound: int,
) -> list[ObjectInfo]:
    """The oldest records to delete so that the blobs the rest name hold at most bound bytes."""
    holders: dict[str, int] = {}
    for record in records:
        digest = named.get(record.path)
        if digest in blobs:
            holders[digest] = holders.get(digest, 0) + 1
    total = sum(blobs[digest].size for digest in holders)
    chosen = []
    for record in sorted(records, key=lambda r: r.modified):
        if total <= bound:
            break
        digest = named.get(record.path)
        if digest not in holders:
            continue  # names no listed blob: holds no bytes
        chosen.append(record)
        holders[digest] -= 1
        if not holders[digest]:
            del holders[digest]
            total -= blobs[digest].size
    return chosen


def collect(
    remote: RemoteCache,
    older_than: float | None,
    *,
    max_size: int | None = None,
    grace: float = DEFAULT_GRACE,
    dry_run: bool = False,
    concurrency: int | None = None,
) -> CollectReport:
    """Deletes records older than older_than seconds (and, with max_size, the oldest others
    until the blobs the rest name hold at most max_size bytes), then unreferenced blobs; see
    the module docstring.

    Raises RemoteError when listing fails, or a deletion does (what was
    deleted before it stays deleted; running again goes on). Raises
    ValueError for negative ages or sizes, neither bound, or a remote this
    process may not write.
    """
    if older_than is None and max_size is None:
        raise ValueError("name what to collect: an age (older_than), a size bound, or both")
    if (older_than or 0) < 0 or grace < 0 or (max_size or 0) < 0:
        raise ValueError("the age, the size bound and the grace period are 0 or more")
    if remote.state != "on" and not dry_run:
        raise ValueError(
            f"the remote cache {remote.location.shown} is {remote.state} for this process: "
            "collecting deletes objects (drop the read-only setting, or use --dry-run)"
        )
    now = time.time()
    sweeps = _Sweeps(remote, CollectReport(dry_run), concurrency, young=now - grace)
    records = [r for r in sweeps.listed("records/") if parse_record_name(r.path) is not None]
    # Blobs are listed before the records are read: a record written meanwhile
    # names a blob that is either listed (and then kept) or new (young).
    blobs = {
        digest: blob
        for blob in sweeps.listed("blobs/")
        if (digest := parse_blob_name(blob.path)) is not None
    }
    cutoff = -1.0 if older_than is None else now - older_than
    # Records first: a blob goes only once no record names it.
    remaining, named = sweeps.old_records(records, blobs, cutoff, max_size)
    kept, referenced = sweeps.dangling_records(remaining, named, blobs)
    sweeps.unreferenced_blobs(blobs, referenced)
    sweeps.index_names(kept)
    sweeps.ended_leases()
    return sweeps.report


@dataclass
class _Sweeps:
    """One collection: the five sweeps of the module docstring, in its order, each filling
    its part of the report; a dry run deletes nothing."""

    remote: RemoteCache
    report: CollectReport
    concurrency: int | None
    young: float
    """Objects written after this (time.time()) are within the grace period."""

    def listed(self, folder: str) -> list[ObjectInfo]:
        return self.remote.client.list_objects(folder, self._deadline())

    def _deadline(self) -> float:
        return time.monotonic() + self.remote.limits.deadline

    def _delete(self, paths: list[str]) -> None:
        def delete(path: str) -> None:
            self.remote.client.delete(path, self._deadline())

        if not self.report.dry_run:
            run_concurrently(paths, delete, self.concurrency)

    def old_records(
        self,
        records: list[ObjectInfo],
        blobs: dict[str, ObjectInfo],
        cutoff: float,
        max_size: int | None,
    ) -> tuple[list[ObjectInfo], dict[str, str | None]]:
        """1. Deletes the records written before the cutoff and, with a size bound, the
        oldest others until the blobs the rest name fit; returns the rest, and the blob
        each of them names (_named_blob)."""
        old = {r.path for r in records if r.modified < cutoff}
        remaining = [r for r in records if r.path not in old]
        by_path = {r.path: r for r in remaining}
        named = run_concurrently(
            by_path, lambda path: _named_blob(self.remote, by_path[path]), self.concurrency
        )
        if max_size is not None:
            old |= {r.path for r in _oldest_over(remaining, named, blobs, max_size)}
            remaining = [r for r in remaining if r.path not in old]
        self.report.old_records = sorted(old)
        self._delete(self.report.old_records)
        return remaining, named

    def dangling_records(
        self,
        remaining: list[ObjectInfo],
        named: dict[str, str | None],
        blobs: dict[str, ObjectInfo],
    ) -> tuple[list[ObjectInfo], set[str]]:
        """2. Deletes the records whose blob is gone, unless young; returns the records kept
        and the blobs they name. Records of a newer format, or unreadable, are kept and
        reported, and name no blob."""
        kept, referenced, dangling = [], set(), []
        for record in remaining:
            digest = named[record.path]
            if digest == NEWER:
                self.report.newer_records.append(record.path)
            elif digest is None:
                self.report.unreadable_records.append(record.path)
            elif digest in blobs or record.modified >= self.young:
                referenced.add(digest)
            else:
                dangling.append(record.path)
                continue
            kept.append(record)
        self.report.dangling_records = sorted(dangling)
        self._delete(self.report.dangling_records)
        self.report.kept_records = len(kept)
        return kept, referenced

    def unreferenced_blobs(self, blobs: dict[str, ObjectInfo], referenced: set[str]) -> None:
        """3. Deletes the blobs no kept record names, unless young; none while a record of a
        newer format is there (it may name any)."""
        report = self.report
        unreferenced = [
            blob
            for digest, blob in blobs.items()
            if digest not in referenced and blob.modified < self.young and not report.newer_records
        ]
        report.blobs = sorted(blob.path for blob in unreferenced)
        self._delete(report.blobs)
        report.freed_bytes = sum(blob.size for blob in unreferenced)
        report.kept_blobs = len(blobs) - len(unreferenced)
        report.kept_bytes = sum(blob.size for blob in blobs.values()) - report.freed_bytes

    def index_names(self, kept: list[ObjectInfo]) -> None:
        """4. Deletes the program index names of keys no kept record is for, unless young."""
        kept_keys = {parsed[0] for r in kept if (parsed := parse_record_name(r.path))}
        self.report.index_names = sorted(
            item.path
            for item in self.listed("programs/")
            if (key := parse_index_name(item.path)) is not None
            and key not in kept_keys
            and item.modified < self.young
        )
        self._delete(self.report.index_names)

    def ended_leases(self) -> None:
        """5. Deletes the leases last written before the grace that have expired or cannot
        be read."""
        leases = {item.path: item for item in self.listed("leases/") if item.modified < self.young}
        ended = run_concurrently(
            leases, lambda path: _lease_ended(self.remote, leases[path]), self.concurrency
        )
        self.report.leases = sorted(path for path, gone in ended.items() if gone)
        self._delete(self.report.leases)
