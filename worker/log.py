"""The worker side's loggers, which import `logging` only when a message could be seen.

Importing logging (with traceback and string, which it imports) costs
milliseconds on the path of every serving process's start (docs/facts.md,
"Start-up costs"), and most processes never see a message of ours. Until some module of the
process has imported logging, nothing can have configured it, so its root
logger's level is WARNING: a debug or info message is then dropped, as
logging itself would drop it, without importing it. A warning or an error
imports logging and is logged as usual (with logging's last-resort handler
when nothing is configured). Once logging is imported, by anyone, every call
goes to the real logger, whose level and handlers decide.

A pool's worker also keeps its warnings (pass_on_warnings: its loggers' and
Python's), which its next reply carries to the pool (said): its own output
reaches only the pool's debug log.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import logging


class Logger:
    """A `logging.Logger` by name, made on first use; see the module docstring."""

    __slots__ = ("_logger", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._logger: logging.Logger | None = None

    def real(self) -> logging.Logger:
        """The logging.Logger of this name (importing logging)."""
        if self._logger is None:
            import logging

            self._logger = logging.getLogger(self.name)
        return self._logger

    def _log(self, method: str, message: str, args: tuple[Any, ...], kwargs: Any) -> None:
        # Two frames more than a direct call (this one and debug/info/...): records name
        # our caller, not this module.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 2
        getattr(self.real(), method)(message, *args, **kwargs)

    def debug(self, message: str, *args: Any, **kwargs: Any) -> None:
        """Logs at DEBUG, if logging is imported (else nothing could show it)."""
        if "logging" in sys.modules:
            self._log("debug", message, args, kwargs)

    def info(self, message: str, *args: Any, **kwargs: Any) -> None:
        """Logs at INFO, if logging is imported (else nothing could show it)."""
        if "logging" in sys.modules:
            self._log("info", message, args, kwargs)

    def warning(self, message: str, *args: Any, **kwargs: Any) -> None:
        """Logs at WARNING (and, in a pool's worker, passes it on: pass_on_warnings)."""
        if _said is not None:
            try:
                _note(str(message) % args if args else str(message))
            except (TypeError, ValueError):  # logging says what is wrong with its arguments
                _note(str(message))
        self._log("warning", message, args, kwargs)

    def error(self, message: str, *args: Any, **kwargs: Any) -> None:
        """Logs at ERROR."""
        self._log("error", message, args, kwargs)

    def exception(self, message: str, *args: Any, **kwargs: Any) -> None:
        """Logs at ERROR with the exception being handled."""
        kwargs.setdefault("exc_info", True)
        self._log("error", message, args, kwargs)


def get_logger(name: str) -> Logger:
    """Returns the worker side's logger called `name` ("pjrt_pool.cache", ...)."""
    return Logger(name)


# A pool's worker passes its warnings on to the pool, which says each once in the caller's
# process (its output, which the pool reads, reaches only the pool's debug log).
_said: list[str] | None = None  # None: not passing them on (not a pool's worker)
_noted: set[str] = set()
MAX_SAID = 2000
"""Characters of a warning passed on, at most."""


def pass_on_warnings() -> None:
    """Keeps each warning this process gives from now on (a worker Logger's, and Python's
    warnings that are shown) for said(), once per text; each is still printed as before."""
    global _said
    if _said is not None:
        return
    _said = []
    import warnings  # imported already by Python's own start-up: costs nothing

    shown = warnings.showwarning

    def showwarning(message: Any, category: Any, *where: Any, **more: Any) -> None:
        _note(str(message))
        shown(message, category, *where, **more)

    warnings.showwarning = showwarning


def _note(text: str) -> None:
    if _said is not None and text not in _noted:
        _noted.add(text)
        _said.append(text[:MAX_SAID])


def said() -> tuple[str, ...]:
    """The warnings kept since the last call (pass_on_warnings), each once; () when none."""
    if not _said:
        return ()
    taken = tuple(_said)
    _said.clear()
    return taken
