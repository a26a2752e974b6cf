"""The files and the cache directory a user names on the command line, checked before use.

A FIFO given as a manifest, bundle or inputs file would block its reader
forever, and a device or directory is never what a command means, nor is a
file that is missing or cannot be read; an output path that exists must be a
regular file, since writing renames over it (a device node or FIFO there
would be replaced). A cache directory must be a directory where one is
named (checked_cache_dir). Each is refused with one line (UsageError) before
anything is read or written.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pool.cli.main import UsageError
from pool.manifest import does_not_exist, kind_of
from worker.bundle.urls import is_url
from worker.cache.location import CACHE_DIR_ENV, resolve_cache_dir

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISREG, "a file"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def input_file(path: str | os.PathLike[str], what: str, missing: str | None = None) -> None:
    """Raises UsageError unless path is a regular file this process may read (or a URL,
    which its reader opens): missing says what to say of a missing one (default: that
    it does not exist)."""
    if is_url(path):
        return
    try:
        found = os.stat(path)  # stat never blocks, whatever lies there
    except FileNotFoundError:
        raise UsageError(missing or f"{what} {os.fspath(path)} does not exist") from None
    except OSError as error:  # a folder on the way is a file, or cannot be searched
        raise UsageError(
            f"{what} {os.fspath(path)} cannot be read ({error.strerror}); check the path"
        ) from None
    if not stat.S_ISREG(found.st_mode):
        raise UsageError(f"{what} {os.fspath(path)} is {_kind(found.st_mode)}, not a regular file")
    if not os.access(path, os.R_OK):
        raise UsageError(
            f"{what} {os.fspath(path)} cannot be read (permission denied); check its permissions"
        )


def manifest_or_bundle_file(path: str) -> None:
    """input_file for a manifest or a bundle (or a bundle's URL), its messages naming which,
    and for a missing one where one comes from."""
    input_file(path, f"the {kind_of(path)}", does_not_exist(path))


def output_file(path: str | os.PathLike[str], what: str) -> None:
    """Raises UsageError if path exists and is not a regular file (a link included)."""
    try:
        found = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISREG(found.st_mode):
        raise UsageError(
            f"{what} {os.fspath(path)} is {_kind(found.st_mode)}: name a new file, or a "
            "regular file to replace"
        )


def checked_cache_dir(
    cache_dir: str | os.PathLike[str] | None,
    given_as: str = "--cache-dir",
    create: bool = False,
    *,
    creatable: bool = False,
) -> Path:
    """Returns the cache directory a command uses: cache_dir, else PJRT_POOL_CACHE_DIR, else
    the user cache directory.

    Raises UsageError, naming where the directory came from (given_as names an
    explicit cache_dir), when it cannot be a cache: a file or anything else
    that is not a directory is there, or (create) it cannot be made or written,
    or (creatable) it is missing and could not be made: the nearest folder
    above it that exists is not a directory this process may write (nothing is
    made). Otherwise the library would only warn, and go on without a cache
    (or find nothing in it). A missing directory passes unless create or
    creatable.
    """
    directory = resolve_cache_dir(cache_dir)
    named = f"{given_as} {cache_dir}" if cache_dir else f"the cache directory {directory}"
    if cache_dir is None and os.environ.get(CACHE_DIR_ENV):
        named = f"{CACHE_DIR_ENV}={os.environ[CACHE_DIR_ENV]}"
    try:
        found = os.stat(directory)
    except FileNotFoundError:
        found = None
    except OSError as error:  # a folder on the way is a file, or cannot be searched
        if not create:
            reason = error.strerror
            raise UsageError(f"{named} cannot be used ({reason}); name a directory") from None
        found = None  # making it says why it cannot be made
    if found is not None and not stat.S_ISDIR(found.st_mode):
        made = " (made if missing)" if create else ""
        raise UsageError(
            f"{named} is {_kind(found.st_mode)}, not a directory; name a directory{made}"
        )
    if creatable and found is None:
        _check_creatable(directory, named)
    if not create:
        return directory
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{named} cannot be created ({error.strerror}); name another") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"{named} is not writable; name a directory you can write to")
    return directory


def _check_creatable(directory: Path, named: str) -> None:
    """Raises UsageError unless the nearest existing folder above a missing directory is a
    directory this process may write, where the directory could be made."""
    above = directory.parent
    while not os.path.lexists(above) and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise UsageError(f"{named} cannot be created: {above} is not a directory; name another")
    if not os.access(above, os.W_OK | os.X_OK):
        raise UsageError(f"{named} cannot be created: {above} is not writable; name another")


def checked_manifest_cache_dir(cache_dir: str | None, option: str | None, manifest: str) -> Path:
    """checked_cache_dir of a manifest's cache directory (cache_dir): the one --cache-dir
    (option) gives, else the one the manifest records, said so in the message."""
    given_as = "--cache-dir" if option else f"the cache_dir of {manifest},"
    return checked_cache_dir(cache_dir, given_as)
