"""Which process this is, renewed in a forked child: a pool made under another id is a parent's.

A child forked from a process with pools has their records but none of
their threads, and a lock one of those threads held at the fork stays held
in the child; so a pool compares the id it was made under with `pid` on
every call and refuses (PoolForkedError) in a child, taking no lock.
"""

from __future__ import annotations

import os

from pool.errors import PoolForkedError

pid = os.getpid()
"""This process's id (renewed in a forked child, before anything else runs there)."""


def _after_fork_in_child() -> None:
    global pid
    pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def refuse_in_child(owner: int) -> None:
    """Raises PoolForkedError when this process is not `owner`, the one that made a pool."""
    if owner != pid:
        raise PoolForkedError(
            f"this Pool belongs to process {owner}, which this process ({os.getpid()}) "
            "was forked from: a forked child cannot use its parent's workers (it has none "
            "of the parent's threads, and a lock one of them held stays held). Make a Pool "
            "in this process instead."
        )
