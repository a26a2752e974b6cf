"""Who may write the cache directory: the check that comes before reading anything in it.

Whoever can write a cache directory chooses the machine code its readers
load (an entry's key is a hash of public facts). So a cache directory, and
each directory under it, must be writable only by people the reader trusts:

- **Private (the default).** Each directory is owned by this process's user
  and is not writable by its group or by others. Anything else is refused
  with UntrustedCacheError, which names the directory, what was found and
  the fix (``chmod 700 DIR``, or another directory).
- **Group-shared** (``PJRT_POOL_CACHE_SHARED=1``, or ``shared=True``), for a
  cache that a team or the nodes of a cluster share. Every member of each
  directory's group is trusted: a directory may be group-writable if its
  group is one of this process's groups, and may be owned by another user
  if so. It must still never be writable by others. Directories this
  process creates are made ``2770`` (setgid, so that files keep the group)
  and files group-readable and -writable. Sign the entries too (see signing.py): on a
  shared filesystem, permissions are often not the whole story.

In both modes the directories above the cache must not let others replace it
(an ancestor writable by others is refused unless it is sticky, as /tmp is),
a symlink to the cache directory is checked at the directory it resolves to,
and the directories under it must be real directories, not symlinks.

Mode bits are not the whole story where a directory has a POSIX ACL: its
``system.posix_acl_access`` entries may let named users and groups write it
(the group bits then show the ACL's mask). A directory whose ACL grants
write to a user other than this one, or to a group that the mode would not
trust, is refused like a mode that grants it. Other access control (NFSv4
ACLs, SELinux labels) is not read.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import grp
import os
import pwd
import stat
import struct
from pathlib import Path

from worker.cache.location import SUBDIRECTORIES, flag_from_environment, resolve_cache_dir
from worker.errors import PjrtPoolError

SHARED_ENV = "PJRT_POOL_CACHE_SHARED"
"""Set to 1 to trust a cache directory's group (a group-shared cache)."""


PRIVATE_DIR_MODE = 0o700
SHARED_DIR_MODE = 0o2770
PRIVATE_FILE_MODE = 0o600
SHARED_FILE_MODE = 0o660
"""Group-writable: members open lock files and the ledger for writing, and refresh
entries' access times (which needs write permission on a file another member made)."""


class UntrustedCacheError(PjrtPoolError):
    """A cache directory is writable by someone this process does not trust.

    The message names the directory, its owner and mode, and how to fix it.
    """


def shared_mode(shared: bool | None = None) -> bool:
    """Returns whether the cache is group-shared: the argument, else PJRT_POOL_CACHE_SHARED."""
    if shared is not None:
        return bool(shared)
    return flag_from_environment(SHARED_ENV, "set it to 1 (a group-shared cache) or 0")


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:  # no such user (a file made in a container, say)
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def _my_groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


def _describe(path: Path, found: os.stat_result) -> str:
    mode = stat.S_IMODE(found.st_mode)
    return (
        f"{path} is owned by {_owner(found.st_uid)}, group {_group(found.st_gid)}, mode {mode:04o}"
    )


def not_a_directory(path: Path) -> NotADirectoryError:
    """The error for a file or a symlink where the cache expects a directory."""
    # Not a question of trust, and nothing is read through it: the cache is unusable.
    return NotADirectoryError(
        errno.ENOTDIR,
        "not a directory (a file or a symlink where the cache expects a directory; "
        "remove it, and pjrt-pool creates the directory again)",
        str(path),
    )


def check_directory(path: Path, found: os.stat_result, shared: bool, fd: int | None = None) -> None:
    """Raises UntrustedCacheError unless a cache directory's stat shows only trusted writers.

    Raises NotADirectoryError when found is not a directory (a symlink under
    the cache directory is never followed). The directory's POSIX ACL, if it
    has one, is read through fd when given (else through path) and must not
    let anyone else write it either.
    """
    if not stat.S_ISDIR(found.st_mode):
        raise not_a_directory(path)
    mode = stat.S_IMODE(found.st_mode)
    me = os.geteuid()
    # Described only for a refusal: naming the owner and group looks them up
    # (the passwd and group databases), which every cache open would pay.
    where = functools.partial(_describe, path, found)
    fix_other = (
        "choose a cache directory of your own (--cache-dir, cache_dir= or PJRT_POOL_CACHE_DIR)"
    )
    if mode & stat.S_IWOTH:
        raise UntrustedCacheError(
            f"{where()}: anyone can write it, and so choose the machine code this process "
            f"would load; run 'chmod o-w {path}'"
            + (" (a shared cache trusts a group, never everyone)" if shared else "")
        )
    if not shared:
        if found.st_uid != me:
            raise UntrustedCacheError(
                f"{where()}, not by {_owner(me)}: its owner chooses the machine code this "
                f"process would load; {fix_other}, or set {SHARED_ENV}=1 if it is a cache "
                "shared by your group"
            )
        if mode & stat.S_IWGRP:
            raise UntrustedCacheError(
                f"{where()}: its group can write it, and so choose the machine code this "
                f"process would load; run 'chmod 700 {path}', or set {SHARED_ENV}=1 to "
                "share the cache with that group on purpose"
            )
        return
    in_my_groups = found.st_gid in _my_groups()
    if mode & stat.S_IWGRP and not in_my_groups:
        raise UntrustedCacheError(
            f"{where()}: it is writable by a group this process is not in; run "
            f"'chgrp GROUP {path}' with your shared group, or 'chmod g-w {path}'"
        )
    if found.st_uid not in (me, 0) and not in_my_groups:
        raise UntrustedCacheError(
            f"{where()}: neither this user nor a member of one of its groups owns it; {fix_other}"
        )
    _check_acl(path, fd, shared)


ACL_XATTR = "system.posix_acl_access"
_ACL_HEADER = struct.Struct("<I")
_ACL_ENTRY = struct.Struct("<HHI")
_ACL_VERSION = 2
_ACL_USER, _ACL_GROUP, _ACL_MASK = 0x02, 0x08, 0x10
_ACL_WRITE = 0o2


def acl_writers(value: bytes) -> tuple[set[int], set[int]]:
    """Returns the named users and named groups that a POSIX ACL (the xattr's bytes) lets write.

    The mask limits named entries, as the kernel applies it. Raises
    ValueError for bytes that are not an ACL of the version Linux writes.
    """
    if len(value) < _ACL_HEADER.size or (len(value) - _ACL_HEADER.size) % _ACL_ENTRY.size:
        raise ValueError(f"{len(value)} bytes is not a POSIX ACL")
    (version,) = _ACL_HEADER.unpack_from(value)
    if version != _ACL_VERSION:
        raise ValueError(f"POSIX ACL version {version}, expected {_ACL_VERSION}")
    entries = [
        _ACL_ENTRY.unpack_from(value, offset)
        for offset in range(_ACL_HEADER.size, len(value), _ACL_ENTRY.size)
    ]
    mask = next((perm for tag, perm, _ in entries if tag == _ACL_MASK), 0o7)
    users = {id_ for tag, perm, id_ in entries if tag == _ACL_USER and perm & mask & _ACL_WRITE}
    groups = {id_ for tag, perm, id_ in entries if tag == _ACL_GROUP and perm & mask & _ACL_WRITE}
    return users, groups


def _check_acl(path: Path, fd: int | None, shared: bool) -> None:
    """Raises UntrustedCacheError if the directory's ACL lets an untrusted user or group write."""
    if not hasattr(os, "getxattr"):
        return  # no POSIX ACLs to read on this system
    try:
        value = os.getxattr(path if fd is None else fd, ACL_XATTR)
    except OSError as error:
        if error.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return  # no ACL, or a filesystem without them: the mode bits say it all
        raise
    try:
        users, groups = acl_writers(value)
    except ValueError as error:
        raise UntrustedCacheError(
            f"{path} has an ACL this process cannot read ({error}), so it cannot tell who "
            f"may write it; remove the ACL with 'setfacl -b {path}'"
        ) from None
    users.discard(os.geteuid())
    if shared:
        groups -= _my_groups()
    if users or groups:
        named = [f"user {_owner(uid)}" for uid in sorted(users)]
        named += [f"group {_group(gid)}" for gid in sorted(groups)]
        raise UntrustedCacheError(
            f"{path} has an ACL that lets {', '.join(named)} write it, and so choose the "
            f"machine code this process would load; remove those entries ('setfacl -x "
            f"u:NAME {path}', or 'setfacl -b {path}' for the whole ACL)"
        )


def _check_ancestors(real: Path) -> None:
    # Whoever can write a parent can rename the cache directory away and put
    # their own in its place; a sticky parent (/tmp) forbids that.
    for parent in real.parents:
        try:
            found = os.stat(parent)
        except OSError:
            continue
        mode = stat.S_IMODE(found.st_mode)
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            raise UntrustedCacheError(
                f"{_describe(parent, found)}: anyone can replace the cache directory "
                f"inside it; run 'chmod o-w {parent}' (or 'chmod +t {parent}'), or choose "
                "a cache directory elsewhere"
            )


def check_cache_directory(
    directory: Path, subdirectories: tuple[str, ...] = (), shared: bool | None = None
) -> Path:
    """Checks an existing cache directory and the named directories under it.

    Returns the directory's real path (a symlink to it is resolved, and the
    real directory checked). Raises UntrustedCacheError when someone this
    process does not trust can write them (see the module docstring), and
    OSError when one is missing (FileNotFoundError) or not a directory.
    """
    is_shared = shared_mode(shared)
    real = Path(os.path.realpath(directory))
    check_directory(real, os.stat(real), is_shared)
    _check_ancestors(real)
    for name in subdirectories:
        try:
            found = os.lstat(real / name)
        except FileNotFoundError:
            continue
        check_directory(real / name, found, is_shared)
    return real


def check_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> None:
    """Raises UntrustedCacheError now if the cache directory exists and is not trusted.

    A Pool calls this when it starts, so that a bad directory fails there
    rather than in every task. A directory that does not exist yet passes
    (it is created private, or group-shared, when first used).
    """
    # Missing, or not a directory: the cache then degrades to compiling, with a warning.
    with contextlib.suppress(OSError):
        check_cache_directory(resolve_cache_dir(cache_dir), SUBDIRECTORIES)


PRIVATE_PARENT_MODE = 0o700
SHARED_PARENT_MODE = 0o750
"""Directories made above a group-shared cache: its group must pass through them."""


def make_parents(directory: Path, shared: bool) -> None:
    """Creates the missing directories above a cache directory, never wider than private.

    pathlib's mkdir(parents=True) makes parents with the umask's mode, which
    under umask 000 is writable by everyone (and then refused as an
    ancestor others could replace). These are made 0700, or 0750 for a
    group-shared cache, whose group must reach the cache.
    """
    missing = []
    parent = directory.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    mode = SHARED_PARENT_MODE if shared else PRIVATE_PARENT_MODE
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            os.mkdir(path, mode)  # the umask can only take bits away


def make_directory(path: Path, shared: bool) -> bool:
    """Creates one cache directory with the mode of the sharing mode; False if it exists.

    The parents are checked first (UntrustedCacheError if anyone could
    replace what is made inside them). The mode is set exactly (the umask
    would otherwise take the group bits a shared cache needs) through a
    descriptor of the directory made, opened without following a symlink:
    a racer who swaps it for a link gets ELOOP, never a chmod of the link's
    target. Raises OSError when what lies at path afterwards is not a
    directory this process owns. The caller checks directories that existed.
    """
    _check_ancestors(Path(os.path.realpath(path.parent)) / path.name)
    mode = SHARED_DIR_MODE if shared else PRIVATE_DIR_MODE
    try:
        os.mkdir(path, mode & 0o777)
    except FileExistsError:
        return False
    if shared:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags)
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                raise OSError(errno.EPERM, "replaced by another user's directory", str(path))
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    return True
