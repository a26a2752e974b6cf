"""A cap on how many compiles run at once on this machine: compile slots under file locks.

XLA's GPU compiler keeps about four cores busy per compile and autotunes its
kernels on the GPU, so sixteen workers compiling at once on a sixteen-core
GPU host run some sixty threads and sixteen autotuning sessions against one
another. Each compile first takes one of N slots: N lock files in a
directory of this user under the temporary directory (machine-local even
when the disk cache is on a shared filesystem), locked with flock, which the
kernel releases when the holder exits or dies, so a killed worker never keeps
a slot.

N is ``PJRT_POOL_COMPILE_SLOTS`` (a positive integer; 0 for no cap), else
what the platform says (worker.plugin.platforms: Platform.compile_slots): for
GPU platforms, one slot per CORES_PER_GPU_COMPILE cores; CPU platforms have
no cap by default (there a compile is bound by cores, and XLA's own thread
pool already spreads one compile over them).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from worker.log import get_logger
from worker.plugin.platforms.platform import CompileSlots
from worker.plugin.platforms.registry import platform_named

SLOTS_ENV = "PJRT_POOL_COMPILE_SLOTS"
"""Names how many compiles may run at once on this machine (0: any number)."""

CORES_PER_GPU_COMPILE = 4
"""Cores one XLA GPU compile keeps busy: serial jax.jit compiles of 64 programs on
an H200 host took 136.6 CPU-seconds in 33-34 s of wall time."""

_POLL_SECONDS = (0.002, 0.05)  # first and longest sleep between tries for a free slot

logger = get_logger("pjrt_pool.slots")


def compile_slots(platform: str) -> int | None:
    """Returns how many compiles may run at once for a platform, or None for no cap.

    Raises ValueError naming the variable when PJRT_POOL_COMPILE_SLOTS is not
    a non-negative integer.
    """
    text = os.environ.get(SLOTS_ENV, "").strip()
    if text:
        try:
            slots = int(text)
        except ValueError:
            slots = -1
        if slots < 0:
            raise ValueError(
                f"{SLOTS_ENV}={text!r}: write how many compiles may run at once on this "
                "machine (a positive integer), or 0 for no cap"
            )
        return slots or None
    if platform_named(platform).compile_slots is CompileSlots.PER_GPU_COMPILE:
        return max(1, (os.cpu_count() or 1) // CORES_PER_GPU_COMPILE)
    return None


def slots_dir(platform: str) -> Path:
    """The directory of a platform's slot files: this user's, under the temporary directory."""
    return Path(tempfile.gettempdir()) / f"pjrt-pool-{os.getuid()}" / f"compile-slots-{platform}"


def _private_dir(directory: Path) -> bool:
    """Creates a directory (and its parent) 0700; False if either is not this user's own."""
    for folder in (directory.parent, directory):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        info = folder.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return False
    return True


@contextlib.contextmanager
def compile_slot(platform: str) -> Iterator[None]:
    """Holds one of the machine's compile slots for a platform during the with-block.

    Waits until a slot is free. Without a cap, or when the slot directory
    cannot be used (not this user's, or not writable), it does not wait:
    a cap only ever costs time, never a compile.
    """
    count = compile_slots(platform)
    fd = None if count is None else _take(slots_dir(platform), count)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock


def _take(directory: Path, count: int) -> int | None:
    try:
        if not _private_dir(directory):
            logger.warning("not capping compiles: %s is not this user's own", directory)
            return None
        fds = [
            os.open(directory / f"slot-{i}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            for i in range(count)
        ]
    except OSError as error:
        logger.warning("not capping compiles: cannot use %s: %s", directory, error)
        return None
    # Start at a slot that depends on the process, so that waiters spread out.
    order = [fds[(os.getpid() + i) % count] for i in range(count)]
    pause = _POLL_SECONDS[0]
    try:
        while True:
            for fd in order:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                fds.remove(fd)
                return fd
            time.sleep(pause)
            pause = min(pause * 2, _POLL_SECONDS[1])
    except OSError as error:  # a filesystem without flock: compile without a cap
        logger.warning("not capping compiles: cannot lock in %s: %s", directory, error)
        return None
    finally:
        for fd in fds:
            os.close(fd)
