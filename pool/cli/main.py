"""The ``pjrt-pool`` command line.

Subcommands come from the modules in COMMANDS. Each has a function
``register(subparsers)`` that adds its parser(s) and sets a default ``run``:
a function of the parsed arguments that returns the exit code. To add a
command, write such a module and list it here. Only the module of the
command named on the command line is imported (all of them for ``--help``),
and modules import JAX (or load a plugin) only inside ``run``, so that
commands that need neither start fast: ``pjrt-pool cache`` never imports
JAX, and ``pjrt-pool run`` of a bundle imports no compiler.

Exit codes, for every command:

    0  success
    1  the command ran and found problems (``cache verify``: bad entries) or failed
    2  usage error (bad arguments, or a confirmation that was needed and not given)

A command reports a user's mistake by raising UsageError: main prints its
message as one line on stderr and exits 2. Any other exception is a bug (or
a failure the command did not foresee) and keeps its traceback.

The caches warn of what they could not do (worker.cache's
CacheUnavailableWarning, the remote tier's RemoteCacheWarning) both through
their logger, one line on stderr, and as a Python warning, for programs that
catch or filter those: while a command runs, such a warning is not printed a
second time (with the file and line that raised it); it is still raised, for
whoever records warnings.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import warnings
from typing import Any

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2

COMMANDS = {
    "warm": "pool.cli.warm",
    "run": "pool.cli.warm",
    "bundle": "pool.cli.bundle",
    "cache": "pool.cli.cache",
    "check-plugin": "pool.cli.check",
}
"""Each command and the module whose register(subparsers) adds it, in the order of the help."""


class UsageError(Exception):
    """A user's mistake: what was wrong and what to do, printed as one line (exit 2)."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Returns the parser with the command's subcommand, or with every one (None or unknown)."""
    parser = argparse.ArgumentParser(
        prog="pjrt-pool",
        description="Compile and run JAX programs on PJRT plugins in worker processes.",
        epilog="exit codes: 0 success, 1 problems found or command failed, 2 usage error",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    # Only the command's module: a production job's ``pjrt-pool run`` need not import
    # what the cache, bundle and check-plugin commands do.
    modules = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command line and returns its exit code (see the module docstring)."""
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(words[0] if words else None)
    try:
        args = parser.parse_args(words)
    except SystemExit as exit_:  # argparse exits 2 on usage errors, 0 after --help
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    run = getattr(args, "run", None)
    if run is None:
        parser.print_usage(sys.stderr)
        print("pjrt-pool: error: name a command", file=sys.stderr)
        return EXIT_USAGE
    formatting = warnings.formatwarning
    warnings.formatwarning = _format_warning
    try:
        code = int(run(args))
    except UsageError as error:
        prog = getattr(args, "prog", parser.prog)
        print(f"{prog}: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    finally:
        warnings.formatwarning = formatting  # a caller's process, as it was
    if argv is None and getattr(args, "exit_at_once", False):
        exit_at_once(code)
    return code


_python_format_warning = warnings.formatwarning


def _format_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: Any = None
) -> str:
    """A warning's text as Python prints it; nothing for the caches' own, which their logger
    printed already (recording them, as pytest.warns does, formats nothing)."""
    # Imported here, when something warns: by then whatever warned has imported it.
    from worker.cache.store import CacheUnavailableWarning

    if issubclass(category, CacheUnavailableWarning):
        return ""
    return _python_format_warning(message, category, filename, lineno, line)


def exit_at_once(code: int) -> None:
    """Ends the process now, skipping the plugin's teardown: for a command that is done.

    A command given exit_at_once=True (and run as the command line, argv
    None) wrote everything it had to: a PJRT plugin's teardown (its client,
    its thread pools: about 40 ms on CPU) does nothing for it. A library
    never calls this; its users' processes end as theirs do.
    """
    for stream in (sys.stdout, sys.stderr):
        # A closed pipe: nothing more can be said on it.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
