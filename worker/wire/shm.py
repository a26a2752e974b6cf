"""Shared-memory segments: anonymous memfds laid out with 64-byte aligned arrays.

Segments have no name, so nothing appears in /dev/shm and nothing can leak:
the kernel frees a memfd when its last descriptor and mapping are gone, which
happens even when a process dies. (Name-based shared memory and its resource
tracker unlink segments still in use, CPython gh-82300.) Arrays start at
64-byte offsets because XLA:CPU uses host memory without copying only when
it is 64-byte aligned, and mmap returns page-aligned memory.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import os
from collections.abc import Callable, Sequence

import numpy as np

from worker.records import ArrayType
from worker.wire.protocol import DescriptorLimitError

ALIGNMENT = 64

ARENA_OUTPUT_SHARE = 4
"""Outputs of at most 1/ARENA_OUTPUT_SHARE of a worker's arena in all come back through it,
copied out (cheaper than a segment for a few KB); larger ones lie in a segment the
results view (the parent's layout, and a first run's offered the inputs' segment)."""

_serials = itertools.count()


def aligned(size: int) -> int:
    """Rounds a byte count up to the alignment."""
    return -(-size // ALIGNMENT) * ALIGNMENT


def layout(types: Sequence[ArrayType], start: int = 0) -> tuple[tuple[int, ...], int]:
    """Returns the aligned byte offset of each array (from `start`) and the end offset."""
    offsets = []
    size = start
    for array_type in types:
        offsets.append(size)
        size += aligned(array_type.nbytes)
    return tuple(offsets), max(size, start + ALIGNMENT)


def _map(fd: int, size: int, populate: bool) -> mmap.mmap:
    # MAP_POPULATE maps every page in one system call instead of one fault per
    # page, which for a segment about to be written whole is several times faster.
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(fd, size, flags=flags)


SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""The seals of every segment: its size is final, so that no process holding it can shrink
it under the other's mappings (whose next access would then fault, SIGBUS), and no seal
can be added or removed later."""


def new_segment(size: int, name: str = "pjrt-pool") -> int:
    """Creates a memfd segment of `size` bytes, sealed at that size; returns its descriptor.

    Running out of descriptors raises DescriptorLimitError, which names the
    limit. Each segment's name is unique in its process (`name-N`): that is
    how a descriptor a signal separated from its variable is found again.
    """
    unique = f"{name}-{next(_serials)}"
    try:
        fd = os.memfd_create(unique, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as error:
        if error.errno in (errno.EMFILE, errno.ENFILE):
            raise DescriptorLimitError("creating a shared-memory segment") from error
        raise
    except BaseException:
        # A signal handled right as memfd_create returns (a Ctrl-C) leaves
        # the new descriptor in no variable; its unique name finds it.
        _close_named(unique)
        raise
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_received(fd: int, size: int, what: str) -> None:
    """Refuses (ValueError) a segment from another process that is not a sealed memfd of at
    least `size` bytes: mapping it for more than it holds, or one its sender could still
    shrink, would make this process's next access fault (SIGBUS) instead of raise."""
    try:
        length = os.fstat(fd).st_size
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as error:  # not a memfd (EINVAL), or not a descriptor at all
        raise ValueError(f"{what} is not a shared-memory segment ({error})") from None
    if length < size:
        raise ValueError(f"{what} holds {length} bytes, not the {size} the reply names")
    if seals & SEALS != SEALS:
        raise ValueError(f"{what} is not sealed at its size (seals {seals:#x})")


def check_layout(types: Sequence[ArrayType], offsets: Sequence[int], size: int, what: str) -> None:
    """Refuses (ValueError) arrays that do not lie, aligned, within `size` bytes of `what`."""
    if len(types) != len(offsets):
        raise ValueError(f"{len(offsets)} offsets for {len(types)} arrays in {what}")
    for array_type, offset in zip(types, offsets, strict=True):
        if type(offset) is not int or offset < 0 or offset % ALIGNMENT:
            raise ValueError(f"an array at offset {offset!r} in {what}")
        if offset + array_type.nbytes > size:
            raise ValueError(
                f"an array of {array_type.nbytes} bytes at offset {offset} overruns the "
                f"{size} bytes of {what}"
            )


def _close_named(name: str) -> None:
    """Closes this process's descriptor of the memfd called `name`, if it has one."""
    target = f"/memfd:{name} (deleted)"
    for entry in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{entry}") == target:
                os.close(int(entry))
                return
        except OSError:
            pass  # the directory's own descriptor, or one closed meanwhile


def create(size: int, name: str = "pjrt-pool", populate: bool = False) -> tuple[int, mmap.mmap]:
    """Creates a memfd segment of `size` bytes; returns its descriptor and a mapping."""
    fd = new_segment(size, name)
    try:
        return fd, _map(fd, size, populate)
    except BaseException:
        os.close(fd)
        raise


def attach(fd: int, size: int, populate: bool = False, keep_fd: bool = False) -> mmap.mmap:
    """Maps a segment received from another process; closes the descriptor unless keep_fd."""
    try:
        return _map(fd, size, populate)
    finally:
        if not keep_fd:
            os.close(fd)


def write(
    segment: mmap.mmap,
    arrays: Sequence[np.ndarray],
    offsets: Sequence[int],
    copy: Callable[[memoryview, np.ndarray], None] | None = None,
) -> None:
    """Copies C-contiguous arrays into a segment at the given byte offsets; `copy`, given,
    copies each one's bytes (flat uint8) into its place (the parent's Copier)."""
    memory = memoryview(segment)
    try:
        for array, offset in zip(arrays, offsets, strict=True):
            if array.nbytes:
                # As bytes: ml_dtypes arrays (bfloat16, ...) have no buffer format.
                source = array.reshape(-1).view(np.uint8)
                place = memory[offset : offset + array.nbytes]
                if copy is None:
                    place[:] = source.data
                else:
                    copy(place, source)
    finally:
        memory.release()


def views(
    segment: mmap.mmap, types: Sequence[ArrayType], offsets: Sequence[int]
) -> list[np.ndarray]:
    """Returns numpy arrays viewing a segment; they keep the mapping alive."""
    return [
        np.frombuffer(segment, dtype=t.dtype, count=t.size, offset=offset).reshape(t.shape)
        if t.size
        else np.empty(t.shape, t.dtype)  # frombuffer cannot view zero bytes
        for t, offset in zip(types, offsets, strict=True)
    ]
