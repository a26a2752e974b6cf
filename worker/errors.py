"""The exceptions of pjrt-pool's worker side.

Every failure a user can cause or meet gets one of these, or a standard
TypeError/ValueError for malformed arguments, with a message that says what
was wrong and what to do about it.
"""

from __future__ import annotations

from worker._pjrt import PjrtError, PluginLoadError

__all__ = [
    "PjrtError",
    "PlatformMismatchError",
    "PluginLoadError",
    "PluginNotFoundError",
]


class PluginNotFoundError(RuntimeError):
    """No PJRT plugin is installed or configured for the requested platform."""


class PlatformMismatchError(RuntimeError):
    """A program is for another platform than the plugin loaded in this process."""
