"""Closing file descriptors quietly: where nothing can be done about an error, nothing is raised.

Used wherever a descriptor is let go of in cleanup (a failed step, a stop, a
reply's descriptors nothing took), in the parent and in workers alike.
"""

from __future__ import annotations

import os


def close_quietly(fd: int) -> None:
    """Closes a descriptor, ignoring every error (closed already, or -1).

    os.closerange never raises, so no try (and so no call, where an
    interrupt could land) comes between letting go of the number and
    closing it.
    """
    os.closerange(fd, fd + 1)


def close_all(fds: list[int]) -> None:
    """Closes received descriptors that nothing took, each out of the list as it is closed."""
    while fds:
        fd = fds[-1]
        del fds[-1]  # out of the list and closed with no call between
        os.closerange(fd, fd + 1)  # never raises: no try, so no call before it
