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
        """Logs at WARNING."""
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
