"""Parent-side exceptions and the wording of child-process failures."""

from __future__ import annotations

import signal


def describe_exit(returncode: int | None) -> str:
    """Says how a child process ended: "was killed by SIGSEGV (signal 11)" or "exited with 3"."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        number = -returncode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"was killed by {name} (signal {number})"
    return f"exited with status {returncode}"
