"""Making bundles: from warmed programs in a cache (create), or from other bundles (merge).

The container is written deterministically (see container.py for how it is
read): members sorted by name, mtime 0, uid and gid 0, no owner names, mode
0644, regular files only, no compression, and a canonical index; so the same
inputs give the same bytes, and CI can cache and compare bundles by digest.
Every entry is verified before it goes in, as a cache read verifies it (its
digests, and its signature when a secret is set), and read again and
checked against its digest as it is written, so that an entry changed in
between is not shipped. create may read the entries a cache lacks from
the remote tier (worker.cache.remote), verified as a remote hit is, and then
as a cache entry is.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.bundle.index import (
    INDEX_NAME,
    MAC_NAME,
    Index,
    IndexBuilder,
    member_name,
    signature,
)
from worker.bundle.reader import Bundle
from worker.bundle.signatures import type_mismatch
from worker.cache import entry as entry_format
from worker.cache.atomic import sync_directory
from worker.cache.signing import Signer, signer_from_environment
from worker.cache.space import entry_name
from worker.cache.store import DiskCache
from worker.errors import BundleError
from worker.records import ProgramSpec

if TYPE_CHECKING:
    from worker.cache.remote.tier import RemoteCache

_FROM_ENVIRONMENT: Any = object()


@dataclass(frozen=True)
class Source:
    """A member to write: its name, size and a function that returns its bytes.

    read() is called once, when the member is written, so that large members
    are held in memory one at a time.
    """

    name: str
    size: int
    read: Callable[[], bytes]


def write_archive(path: Path, sources: Sequence[Source], mode: int = 0o644) -> None:
    """Writes an archive of the sources, sorted by name, atomically (a temporary file, renamed).

    Raises BundleError when a source's bytes are not of its declared size,
    and OSError when the file cannot be written.
    """
    names = [source.name for source in sources]
    if len(set(names)) != len(names):
        raise BundleError(f"{path}: two members would have the same name")
    with contextlib.suppress(FileNotFoundError):
        # The bundle is renamed over path: a device node or FIFO there would be replaced.
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise BundleError(
                f"{path} exists and is not a regular file: write the bundle elsewhere"
            )
    temp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as file:
            with tarfile.open(fileobj=file, mode="w", format=tarfile.USTAR_FORMAT) as archive:
                for source in sorted(sources, key=lambda s: s.name):
                    data = source.read()
                    if len(data) != source.size:
                        raise BundleError(
                            f"{source.name} changed while the bundle was written "
                            f"({len(data)} bytes, {source.size} expected): make the bundle again"
                        )
                    archive.addfile(_member_info(source.name, len(data)), io.BytesIO(data))
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temp, mode)  # exactly: the umask must not change what is shipped
        os.replace(temp, path)
        sync_directory(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _member_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def _signer(signer: Signer | None) -> Signer | None:
    return signer_from_environment() if signer is _FROM_ENVIRONMENT else signer


def _write(output: Path, index: Index, entries: list[Source], signer: Signer | None) -> None:
    index_bytes = index.encode()
    sources = [*entries, Source(INDEX_NAME, len(index_bytes), lambda: index_bytes)]
    if signer is not None:
        mac = signature(index_bytes, signer)
        sources.append(Source(MAC_NAME, len(mac), lambda: mac))
    write_archive(output, sources)


def _checked(read: Callable[[], bytes], sha256: str, what: str) -> Callable[[], bytes]:
    def again() -> bytes:
        data = read()
        if hashlib.sha256(data).hexdigest() != sha256:
            raise BundleError(f"{what} changed while the bundle was written: make it again")
        return data

    return again


def _read_cache_entry(
    cache: DiskCache, spec: ProgramSpec, where: str, remote: RemoteCache | None = None
) -> bytes:
    """An entry file's bytes, read through the cache's entries/ folder (never a link), else
    fetched from the remote tier (its record and bytes verified, see remote/verify.py)."""
    path = cache.path_of(spec.key)
    entries = cache.folder("entries")
    try:
        if entries is None:
            raise FileNotFoundError(path)
        with entry_format.open_entry(entry_name(spec.key), dir_fd=entries.fd) as file:
            size = os.fstat(file.fileno()).st_size
            if size > cache.max_size + entry_format.MAX_HEADER_SIZE:
                raise BundleError(
                    f"{spec.name}{where}: {path} is {size} bytes, more than the cache's bound"
                )
            return file.read()
    except FileNotFoundError:
        fetched = None if remote is None else remote.fetch(spec.key, cache.max_size)
        if fetched is not None:
            return fetched[0]
        elsewhere = "" if remote is None else f" nor in the remote {remote.location.shown}"
        raise BundleError(
            f"{spec.name}{where}: its entry {spec.key} is not in the cache {cache.directory}"
            f"{elsewhere}: warm it there first (pjrt-pool warm), or pass the cache it was "
            "warmed into (--cache-dir)"
        ) from None
    except (OSError, entry_format.CorruptEntryError) as error:
        raise BundleError(f"{spec.name}{where}: cannot read {path}: {error}") from None


def create_bundle(
    output: str | os.PathLike[str],
    programs: Sequence[tuple[ProgramSpec, DiskCache, str]],
    signer: Signer | None = _FROM_ENVIRONMENT,
    *,
    remote: RemoteCache | None = None,
) -> Index:
    """Writes a bundle of programs and their cache entries; returns its index.

    programs are (spec, the cache that holds its entry, where the spec came
    from for messages, such as " (from m.json)"). The entries go in byte for
    byte, so their digests and signatures carry over; with a signer (by
    default the cache's secret, PJRT_POOL_CACHE_SECRET or
    PJRT_POOL_CACHE_KEY_FILE, if set) the index is signed too. Raises
    BundleError for an entry that is missing, damaged or wrongly signed, and
    for two programs of one name with different signatures. With remote, an
    entry a cache lacks is fetched from it (and again as it is written,
    checked against the same digest, so that memory holds one entry at a
    time).
    """
    builder = IndexBuilder()
    sources = []
    for spec, cache, where in programs:
        data = _read_cache_entry(cache, spec, where, remote)
        try:
            entry = entry_format.verify(data, spec.key, cache.signer)
        except entry_format.CorruptEntryError as error:
            raise BundleError(
                f"{spec.name}{where}: its cache entry {spec.key} in {cache.directory} cannot "
                f"be used ({error}): warm it again"
            ) from None
        mismatch = type_mismatch(spec, entry.metadata)
        if mismatch is not None:
            raise BundleError(
                f"{spec.name}{where}: the manifest gives it {mismatch}: the manifest was "
                "edited or is stale; write it again (pjrt-pool warm --manifest)"
            )
        digest = hashlib.sha256(data).hexdigest()
        flags = entry.metadata.get("cpu_flags")
        flags = (
            flags if isinstance(flags, list) and all(isinstance(f, str) for f in flags) else None
        )
        if builder.add(spec, entry.parts, len(data), digest, flags, where):
            reread = _checked(
                lambda c=cache, s=spec, w=where: _read_cache_entry(c, s, w, remote),
                digest,
                str(cache.path_of(spec.key)),
            )
            sources.append(Source(member_name(spec.key), len(data), reread))
    if not builder.index.programs:
        raise BundleError("no programs to bundle: the manifests list none")
    _write(Path(output), builder.index, sources, _signer(signer))
    return builder.index


def merge_bundles(
    output: str | os.PathLike[str],
    paths: Sequence[str | os.PathLike[str]],
    signer: Signer | None = _FROM_ENVIRONMENT,
) -> Index:
    """Writes one bundle with the programs of several; returns its index.

    Entries of a program built in different environments (another plugin
    build, other CPU features, other XLA flags) go side by side, and a
    loader picks the one built for it; an entry in several bundles goes in
    once. Every bundle is checked as opening it checks, and every entry as
    loading it would. Raises BundleError for a damaged or changed bundle and
    for programs of one name with different signatures.
    """
    chosen = _signer(signer)
    builder = IndexBuilder()
    sources = []
    with contextlib.ExitStack() as stack:
        for path in paths:
            bundle = stack.enter_context(Bundle(path, chosen))
            index = bundle.index
            for program in index.programs.values():
                for key in program.keys:
                    record = index.entries[key]
                    bundle.entry(key)  # digests and signature, before anything is written
                    flags = index.environments[record.environment].cpu_flags
                    where = f" (from {bundle.path})"
                    spec = program.spec(key)
                    if builder.add(
                        spec, index.parts_of(key), record.size, record.sha256, flags, where
                    ):
                        read = _checked(
                            lambda b=bundle, k=key: b.entry_bytes(k), record.sha256, record.member
                        )
                        sources.append(Source(member_name(key), record.size, read))
        _write(Path(output), builder.index, sources, chosen)
    return builder.index
