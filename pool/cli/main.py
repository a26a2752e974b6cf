"""The ``pjrt-pool`` command line.

Subcommands come from the modules in COMMANDS. Each has a function
``register(subparsers)`` that adds its parser(s) and sets a default ``run``:
a function of the parsed arguments that returns the exit code. To add a
command, write such a module and list it here. Only the module of the
command named on the command line is imported (all of them for ``--help``),
and modules import JAX (or load a plugin) only inside ``run``, so that
commands that need neither start fast: ``pjrt-pool cache`` never imports
JAX, and ``pjrt-pool run`` of a bundle imports no compiler.

Exit codes, for every command (ExitCode):

    0    success
    1    the command ran and found problems (``cache verify``: bad entries) or failed
    2    a usage or environment error: bad arguments, a confirmation that was
         needed and not given, a plugin or cache directory that cannot be used
    130  interrupted (Ctrl-C: SIGINT)
    143  terminated (SIGTERM: kill, a CI job's timeout)

A command reports what stopped it by raising a CommandError (exit 1) or a
UsageError (exit 2): main prints its message as one line on stderr. The
library's errors that mean this machine is not set up for the command (no
plugin, a file that is not one, a cache directory others can write, an
extra's package not installed: see _environment_error), raised anywhere,
even in a worker that failed to start, are usage errors too. Any other
exception is a bug (or a failure the command did not foresee) and keeps its
traceback. A Ctrl-C ends every command with 130 and SIGTERM with 143, at any
moment, start-up included, with one line on stderr, once what it started has
stopped and what it writes (warm's report and manifest) is written
(pool.cli.interrupts).

The command line's own JAX only lowers (for the platform a command names), so
it runs on the CPU: JAX_PLATFORMS defaults to "cpu" here, except for the
commands in JAX_ON_DEVICES.

The caches warn of what they could not do (worker.cache's
CacheUnavailableWarning, the remote tier's RemoteCacheWarning) through their
logger, one line on stderr; the Python warning they also issue, for programs
that record or filter it, is not printed (worker.cache.store).
"""

from __future__ import annotations

import os
import sys

from pool.cli import interrupts

if os.path.basename(sys.argv[0]) == "pjrt-pool" or __name__ == "__main__":
    # Run as the command (its console script, or python -m): the signals are the
    # command's from here on, before anything slow is imported (pool.cli.interrupts).
    interrupts.install()

# After the signal handlers, on purpose.
import argparse
import contextlib
import enum
import importlib
import logging
from collections.abc import Iterator
from typing import Any, ClassVar

from worker.errors import PjrtPoolError


class ExitCode(enum.IntEnum):
    """A command's exit status: the same meaning for every command."""

    OK = 0
    """Everything asked for was done."""
    PROBLEMS = 1
    """The command ran and found problems, or an operation failed."""
    USAGE = 2
    """A usage or environment error, said in one line before anything slow started, where
    it can be."""
    INTERRUPTED = 130
    """Ctrl-C: 128 + SIGINT, as a shell reports a process that SIGINT ended."""
    TERMINATED = 143
    """SIGTERM (kill, a CI job's timeout): 128 + SIGTERM."""


COMMANDS = {
    "warm": "pool.cli.warm",
    "run": "pool.cli.warm",
    "bundle": "pool.cli.bundle",
    "cache": "pool.cli.cache",
    "check-plugin": "pool.cli.check",
}
"""Each command and the module whose register(subparsers) adds it, in the order of the help."""


class CommandError(PjrtPoolError):
    """What stopped a command, and what to do: printed as one line, exit_code its status."""

    exit_code: ClassVar[ExitCode] = ExitCode.PROBLEMS


class UsageError(CommandError):
    """A user's mistake: what was wrong and what to do, printed as one line (exit 2)."""

    exit_code = ExitCode.USAGE


def _causes(error: BaseException) -> Iterator[BaseException]:
    """The error, what it was raised from, and so on down."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__


def _environment_error(error: BaseException) -> bool:
    """Whether an error, or one it was raised from, says this machine is not set up for
    the command: no plugin for the platform, a plugin file that does not load, a cache
    directory that others can write, no device for the platform (or another process
    holds it), a topology the plugin cannot make, or a package of an extra that is not
    installed. Each message says what to do."""
    # Imported here, once a command failed: main imports nothing of the library,
    # so that each command starts as fast as its own module lets it.
    from worker.cache.trust import UntrustedCacheError
    from worker.errors import (
        DeviceUnavailableError,
        MissingExtraError,
        PluginLoadError,
        PluginNotFoundError,
        TopologyError,
    )

    kinds = (
        PluginNotFoundError,
        PluginLoadError,
        UntrustedCacheError,
        DeviceUnavailableError,
        TopologyError,
        MissingExtraError,
    )
    return any(isinstance(cause, kinds) for cause in _causes(error))


class _ShowVersion(argparse.Action):
    """--version: prints pool.cli.version's lines and exits 0 (computed only when asked)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from pool.cli.version import describe

        print(describe())
        parser.exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Returns the parser with the command's subcommand, or with every one (None or unknown)."""
    parser = argparse.ArgumentParser(
        prog="pjrt-pool",
        description="Compile and run JAX programs on PJRT plugins in worker processes.",
        epilog="exit codes: 0 success, 1 problems found or command failed, 2 usage or "
        "environment error, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM)",
    )
    parser.add_argument(
        "--version",
        action=_ShowVersion,
        help="print pjrt-pool's version, where it was installed from, and the plugin found for "
        "each platform, then exit",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    # Only the command's module: a production job's ``pjrt-pool run`` need not import
    # what the cache, bundle and check-plugin commands do.
    modules = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(name).register(subparsers)
    return parser


JAX_ON_DEVICES = frozenset({"check-plugin"})
"""Commands whose own JAX runs on the platform's devices (check-plugin's references)."""


def main(argv: list[str] | None = None) -> int:
    """Runs the command line and returns its exit code (see the module docstring)."""
    if argv is None:  # the command line: its signals are its own (pool.cli.interrupts)
        interrupts.install()
    words = sys.argv[1:] if argv is None else argv
    if not words or words[0] not in JAX_ON_DEVICES:
        # The command line's JAX only lowers, for a platform it names: on the CPU, so that
        # it never opens a device its workers need, nor loads libtpu (whose lock it would
        # take) just to find no TPU. A JAX_PLATFORMS of the user's is kept.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    parser = build_parser(words[0] if words else None)
    try:
        args = parser.parse_args(words)
    except SystemExit as exit_:  # argparse exits 2 on usage errors, 0 after --help
        return exit_.code if isinstance(exit_.code, int) else ExitCode.USAGE
    run = getattr(args, "run", None)
    if run is None:
        parser.print_usage(sys.stderr)
        print("pjrt-pool: error: name a command", file=sys.stderr)
        return ExitCode.USAGE
    prog = getattr(args, "prog", parser.prog)
    interrupts.name_command(prog)
    try:
        with interrupts.unwinding():  # the command marks what holds nothing, or must be written
            code = int(run(args))
    except KeyboardInterrupt as interrupt:
        # What the command started has stopped on the way here: a Pool's with
        # block terminated its workers, warm joined its lowering thread. Only a
        # second Ctrl-C, which cuts that join short, leaves a thread that may be
        # in jaxlib's native code, which the interpreter's teardown would abort
        # (pool.warm.lowerer): the command line leaves without that teardown.
        if not isinstance(interrupt, interrupts.Reported):
            print(interrupts.describe(), file=sys.stderr)
        if argv is None:
            exit_at_once(interrupts.exit_code())
        return interrupts.exit_code()
    except BrokenPipeError:
        # Its reader went away (pjrt-pool run BUNDLE | head): nothing more can be said there,
        # and nothing is wrong with the command. As a shell reports a process SIGPIPE ended.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # SIGPIPE
    except Exception as error:
        if _environment_error(error):
            code = ExitCode.USAGE
        elif isinstance(error, CommandError):
            code = error.exit_code
        else:
            raise
        print(f"{prog}: {' '.join(str(error).split())}", file=sys.stderr)
        return code
    if interrupts.received() is not None:
        # A signal came and its KeyboardInterrupt was lost on the way (raised in a
        # __del__ or a callback, which Python reports and goes on from): it still ends
        # the command, with its status.
        print(interrupts.describe(), file=sys.stderr)
        code = interrupts.exit_code()
    if argv is None and (getattr(args, "exit_at_once", False) or interrupts.received()):
        exit_at_once(code)
    return code


def exit_at_once(code: int) -> None:
    """Ends the process now, skipping the plugin's teardown: for a command that is done.

    A command given exit_at_once=True (and run as the command line, argv
    None) wrote everything it had to: a PJRT plugin's teardown (its client,
    its thread pools: about 40 ms on CPU) does nothing for it. So has every
    command a Ctrl-C ended, once its with blocks and finally clauses ran. A
    library never calls this; its users' processes end as theirs do.
    """
    for stream in (sys.stdout, sys.stderr):
        # A closed pipe: nothing more can be said on it.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    # Run as `python -m pool.cli.main`, this module is `__main__`, and the command
    # modules import `pool.cli.main` a second time: call that one's main, whose
    # UsageError is the class they raise.
    from pool.cli.main import main as _main

    sys.exit(_main())
