"""The exceptions of pjrt-pool's worker side, and the one base of every error pjrt-pool raises.

Every failure a user can cause or meet gets one of these, or a standard
TypeError/ValueError for malformed arguments, with a message that says what
was wrong and what to do about it. Every exception class pjrt-pool defines,
here and in pool/, derives from PjrtPoolError, and from the builtin exception
it has always derived from (ValueError, RuntimeError, ...), so that both
``except PjrtPoolError`` and ``except ValueError`` catch it (docs/api.md,
"Errors"). The native module (worker._pjrt) raises the four classes defined
for it here (PjrtError, HandlerVersionError, PluginLoadError, SocketError),
which it takes from this module as it initializes: nothing here imports it,
so this module is the lowest floor of the worker side.
"""

from __future__ import annotations

__all__ = [
    "BundleError",
    "DeviceCountError",
    "DeviceUnavailableError",
    "HandlerVersionError",
    "JaxlibApiError",
    "MissingExtraError",
    "NeverCompileError",
    "NotInCacheError",
    "NotLoadedError",
    "PjrtError",
    "PjrtPoolError",
    "PlatformMismatchError",
    "PluginLoadError",
    "PluginNotFoundError",
    "SocketError",
    "TopologyError",
]


class PjrtPoolError(Exception):
    """The base of every error pjrt-pool raises: ``except PjrtPoolError`` catches them all.

    Each error also derives from the builtin exception its kind of failure is
    (a malformed argument's ValueError, a failed call's RuntimeError, a lost
    connection's ConnectionError, ...), and from its family's base (PoolError,
    PjrtError, NotInCacheError, ...): docs/api.md, "Errors".
    """


class PjrtError(PjrtPoolError, RuntimeError):
    """A PJRT call failed. `code` is the PJRT error code, `code_name` its name (the native
    module sets both)."""

    code: int
    code_name: str


class HandlerVersionError(PjrtError):
    """An FFI handler is built for an XLA FFI version the plugin's XLA cannot take.
    `handler_version` and `plugin_version` are (major, minor) (the native module sets them)."""

    handler_version: tuple[int, int] | None
    plugin_version: tuple[int, int] | None


class PluginLoadError(PjrtPoolError, OSError):
    """A PJRT plugin library could not be loaded or is not a usable PJRT plugin."""


class SocketError(PjrtPoolError, ConnectionError):
    """A worker's socket failed with an errno that has no ConnectionError of its own
    (`errno` says which)."""


class MissingExtraError(PjrtPoolError, ModuleNotFoundError):
    """A feature needs a package that one of pjrt-pool's extras installs, and it is not installed.

    The message names the feature, the package, the extra and the pip
    command that installs the extra from where this pjrt-pool came from (a
    checkout or a wheel: no package index serves pjrt-pool). `name` is the
    missing module (as for any ModuleNotFoundError), `extra` the extra and
    `install` the command. The plugins, extras too, have their own error:
    PluginNotFoundError, which names their extras the same way.
    """

    def __init__(self, message: str, *, name: str = "", extra: str = "", install: str = "") -> None:
        super().__init__(message, name=name or None)
        self.extra = extra
        self.install = install


class PluginNotFoundError(PjrtPoolError, RuntimeError):
    """No PJRT plugin is installed or configured for the requested platform."""


class DeviceUnavailableError(PjrtError):
    """The platform's device is not here, or another process holds it.

    `holder` is the pid of the process that holds it, when the plugin names
    one (libtpu does), else None. A PjrtError, as the failed call it comes from.
    """

    def __init__(self, message: str, holder: int | None = None) -> None:
        super().__init__(message)
        self.holder = holder
        self.code = 14  # PJRT_Error_Code_UNAVAILABLE
        self.code_name = "UNAVAILABLE"


class DeviceCountError(PjrtPoolError, ValueError):
    """A program over several devices needs more devices than the process (or a pool's
    worker, or a topology) has; refused before it compiles.

    `needed` and `available` are the two counts; the message names the setting that gives
    more (a Pool's devices_per_worker, a larger topology).
    """

    def __init__(self, message: str, needed: int = 0, available: int = 0) -> None:
        # Defaults: a pool rebuilds a worker's error from its message, then sets the counts.
        super().__init__(message)
        self.needed = needed
        self.available = available


class NotLoadedError(PjrtPoolError, RuntimeError):
    """An executable compiled for a topology without a device was asked to run.

    It runs where devices of that topology are: loaded there from the cache
    or a bundle it was published to.
    """


class JaxlibApiError(PjrtPoolError, RuntimeError):
    """The installed jaxlib lacks a binding pjrt-pool uses (its private API moved): raised by
    the modules that compile or run through jaxlib's own clients (worker.plugin.jaxlib*)."""


class TopologyError(PjrtPoolError, ValueError):
    """The plugin cannot make the topology asked for: a name it does not know, options that do
    not fit the name, or a plugin that compiles for no topology (the CPU plugins)."""


class PlatformMismatchError(PjrtPoolError, RuntimeError):
    """A program is for another platform than the plugin loaded in this process."""


class NotInCacheError(PjrtPoolError, LookupError):
    """No usable executable for a program here: not in the disk cache (or bundle) asked.

    Attributes: `program` (its name, when known), `key` (the cache key looked
    for), `location` (the cache directory or bundle), and `differences`: when
    an entry for the same program built elsewhere was found, the key parts in
    which it differs from this process's, one per line (else "").
    """

    def __init__(
        self,
        message: str,
        program: str = "",
        key: str = "",
        location: str = "",
        differences: str = "",
    ) -> None:
        super().__init__(message)
        self.program = program
        self.key = key
        self.location = location
        self.differences = differences


class NeverCompileError(NotInCacheError):
    """A program would have to be compiled, and this process must never compile.

    Raised instead of compiling in never-compile mode (PJRT_POOL_COMPILE=never,
    or never_compile=True): nothing was compiled. Warm the program on a
    machine like this one, or see `differences` for why the entries found do
    not fit here.
    """


class BundleError(PjrtPoolError, ValueError):
    """A bundle is not one, is damaged, or was changed after it was made.

    The message names the file and what is wrong with it (a member added,
    removed, resized or damaged, a truncated file, a member that is not a regular
    file or whose name leads outside the bundle); nothing was loaded or
    imported from it.
    """
