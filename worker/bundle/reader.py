"""Opening a bundle: its members checked against its index, and its index's signature.

Opening reads one header per member and the index, nothing else (a bundle
at a URL: its end and the layout its index gives, each header when its
member is first read; remote.py says what is checked when): it refuses
a bundle whose members are not exactly those the index lists (a member
added, removed, or of another size than the index says), one whose size is
not the one its members make (container.archive_size: cut short or added
to anywhere, tar's padding included), one that holds
anything but regular files named index.json, index.mac and
entries/<key>.pjx, and, with a signing secret set (PJRT_POOL_CACHE_SECRET
or PJRT_POOL_CACHE_KEY_FILE), one whose index is unsigned or signed with
another secret. An entry is read only when asked for, and then checked as a
cache entry is read: its SHA-256 against the index, its own digests, and its
signature when a secret is set.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any

from worker.bundle.container import Archive, Member
from worker.bundle.index import (
    Index,
    IndexEntry,
    check_member_name,
    open_index,
)
from worker.bundle.signatures import type_mismatch
from worker.bundle.urls import bundle_source, is_url
from worker.cache import entry as entry_format
from worker.cache.location import resolve_max_size
from worker.cache.signing import Signer, signer_from_environment
from worker.errors import BundleError

if TYPE_CHECKING:
    from worker.bundle.remote import RemoteArchive

_FROM_ENVIRONMENT: Any = object()
_SHOWN_CHANGES = 6


class Bundle:
    """An opened, checked bundle (see the module docstring); close it, or use it in a with.

    path is a file, or a URL (s3://, gs://, az://, file://, http(s)://) read
    by ranges; self.path names it in messages (a URL without credentials),
    self.source opens it again elsewhere (the URL as given, or the file's
    absolute path: a Pool's workers open it so).
    """

    def __init__(
        self, path: str | os.PathLike[str], signer: Signer | None = _FROM_ENVIRONMENT
    ) -> None:
        self.signer: Signer | None = (
            signer_from_environment() if signer is _FROM_ENVIRONMENT else signer
        )
        self.archive: Archive | RemoteArchive
        self.source: str = bundle_source(path)  # type: ignore[assignment]
        opened: tuple[bytes, Index] | None = None
        if is_url(path):
            # Here: a process that opens files only never imports the remote tier.
            from worker.bundle.remote import RemoteArchive

            remote = self.archive = RemoteArchive(path, self.signer)
            opened = remote.index_bytes, remote.index  # read by open_index, for its layout
        else:
            self.archive = Archive(path)
        self.path = self.archive.path
        try:
            self._members = {member.name: member for member in self.archive.members}
            keys = {}
            for name, member in self._members.items():
                key = check_member_name(name, self.path)
                if key is not None:
                    keys[key] = member
            self.index_bytes, self.index = opened or open_index(
                self._members, self.archive.read, self.signer, self.path
            )
            self._check_members(keys)
            self._entries = keys
        except BaseException:
            self.archive.close()
            raise

    def close(self) -> None:
        """Closes the bundle's file."""
        self.archive.close()

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _check_members(self, members: dict[str, Member]) -> None:
        """Refuses a bundle whose entry members are not exactly the index's, naming each change."""
        changes = []
        for key in sorted(members.keys() - self.index.entries.keys()):
            changes.append(f"{members[key].name} was added (the index does not list it)")
        for key in sorted(self.index.entries.keys() - members.keys()):
            changes.append(f"{self.index.entries[key].member} was removed (the index lists it)")
        for key in sorted(members.keys() & self.index.entries.keys()):
            expected, found = self.index.entries[key].size, members[key].size
            if expected != found:
                changes.append(
                    f"{members[key].name} has {found} bytes where the index says {expected}"
                )
        if changes:
            more = len(changes) - _SHOWN_CHANGES
            shown = "; ".join(changes[:_SHOWN_CHANGES]) + (f"; and {more} more" if more > 0 else "")
            raise BundleError(
                f"{self.path} is damaged or was changed after it was made, so none of it is "
                f"used: {shown}"
            )

    def check_digests(self) -> None:
        """Reads every entry member whole and checks its SHA-256 against the index (each
        entry's own checks come when it is read: entry()); raises BundleError naming the
        first that differs. With opening's checks (every header, the members against the
        index, the size against the members, the signature), the whole bundle is checked."""
        for key, record in sorted(self.index.entries.items()):
            self._check_digest(record, self.archive.digest(self._entries[key]))

    def entry_bytes(self, key: str, max_payload: int | None = None) -> bytearray:
        """Returns an entry member's bytes, checked against the index's SHA-256.

        Nothing but the entry's header is read before its header is verified
        (its digest, and its MAC with a secret, checked before it is parsed)
        and its payload size found to be what the member holds and at most
        max_payload (default: the cache's bound, PJRT_POOL_CACHE_MAX_SIZE);
        then the member is read once, into one buffer. Raises BundleError.
        """
        return self._read_entry(key, max_payload)[1]

    def _read_entry(
        self, key: str, max_payload: int | None
    ) -> tuple[entry_format.Header, bytearray]:
        record = self.index.entries[key]
        member = self._entries[key]
        bound = resolve_max_size(None) if max_payload is None else max_payload
        try:
            prefix = self.archive.read_part(member, 0, entry_format.PREFIX_SIZE)
            length = entry_format.header_length(prefix)
            if length > member.size:
                raise entry_format.CorruptEntryError("truncated inside the header")
            head = self.archive.read_part(member, 0, length)
            header = entry_format.decode_header(head, self.signer)
            entry_format.payload_size(header, member.size, bound)
        except entry_format.CorruptEntryError as error:
            self._check_digest(record, self.archive.digest(member))  # damaged: say so
            raise BundleError(f"{self.path}: entry {key} cannot be used: {error}") from None
        data = bytearray(member.size)
        self.archive.read_into(member, data)
        self._check_digest(record, hashlib.sha256(data).hexdigest())
        if data[:length] != head:  # the file changed between the two reads
            raise BundleError(f"{self.path}: {record.member} changed while it was read")
        return header, data

    def _check_digest(self, record: IndexEntry, digest: str) -> None:
        if digest != record.sha256:
            raise BundleError(
                f"{self.path}: {record.member} is damaged or was changed after the bundle was "
                f"made (its SHA-256 is {digest}, the index says {record.sha256}); make the "
                "bundle again from its manifests"
            )

    def entry(self, key: str, max_payload: int | None = None) -> entry_format.Entry:
        """Returns a verified entry: read as entry_bytes reads it, checked as a cache read checks.

        The types the index gives each program of the entry must be those the
        entry records (signatures.py): an index whose types were changed is
        refused, naming the program and both sets of types.
        """
        header, data = self._read_entry(key, max_payload)
        del data[: header.payload_offset]  # the payload, without a copy
        try:
            entry = entry_format.verified_entry(header, key, data)
        except entry_format.CorruptEntryError as error:
            raise BundleError(f"{self.path}: entry {key} cannot be used: {error}") from None
        for program in self.index.programs.values():
            if key in program.keys:
                mismatch = type_mismatch(program.spec(key), entry.metadata)
                if mismatch is not None:
                    raise BundleError(
                        f"{self.path}: its index gives program {program.name!r} {mismatch} "
                        "(the index was changed after the bundle was made): make the bundle again"
                    )
        return entry
