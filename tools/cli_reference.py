"""Writes docs/cli.md's reference of each command from the command line's own parsers.

Each command's reference lies between two markers on the page:

    <!-- reference: pjrt-pool warm (tools/cli_reference.py writes it from the parser) -->
    ...
    <!-- end of reference -->

and is what ``pjrt-pool warm --help`` says, laid out for the page: the
description, the usage, a table of the arguments and options (each with its
help, which says its default), the subcommands of a command that has some,
and the exit statuses. The text around the sections is the page's own. The
parsers are those pool.cli.main.build_parser builds, however their options
are declared, so the page cannot say other than the command does.

    python tools/cli_reference.py          # rewrites the sections of docs/cli.md
    python tools/cli_reference.py --check  # exit 1, with the difference, if they differ

tests/test_cli_help.py runs the check.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "cli.md"
WIDTH = 100
"""The usage lines' width: argparse wraps them to the terminal's, so the page names its own."""

_BEGIN = re.compile(r"^<!-- reference: (pjrt-pool[\w -]*?) \(.*\) -->$")
_END = "<!-- end of reference -->"
_CODE = re.compile(
    r"(?<![\w`])("
    r"--[a-z][\w-]*(?:=[\w,]+)?"  # an option, with a value given to it
    r"|\$[A-Z][A-Z0-9_]*|PJRT_POOL_[A-Z0-9_<>*]*"  # a variable, a family of them
    r"|[a-z][a-z0-9+]*://[^\s,;)]*"  # a URL
    r"|'[^'\s]+'"  # a quoted word: a pattern
    r"|\S*\*\S*"  # a word with a wildcard
    r")"
)


def marker(command: str) -> str:
    """The line a command's reference starts with."""
    return f"<!-- reference: {command} (tools/cli_reference.py writes it from the parser) -->"


def commands(
    parser: argparse.ArgumentParser, path: str = "pjrt-pool"
) -> Iterator[tuple[str, argparse.ArgumentParser, argparse.ArgumentParser]]:
    """Every command's parser below the top one, by its words ("pjrt-pool bundle create"),
    with the parser of the command it is under; each command before its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                words = f"{path} {name}"
                yield words, sub, parser
                yield from commands(sub, words)


def _markdown(text: str) -> str:
    """A help text as a table cell: names, variables, URLs and patterns as code."""
    return _CODE.sub(r"`\1`", " ".join(text.split())).replace("|", "\\|")


def _names(action: argparse.Action) -> str:
    """How an argument or option is written: `SPEC`, `MANIFEST...`, `-o FILE`, `--json`."""
    metavar = action.metavar if isinstance(action.metavar, str) else None
    if not action.option_strings:
        name = metavar or action.dest.upper()
        return f"`{name}...`" if action.nargs in ("+", "*") else f"`{name}`"
    value = ""
    if action.nargs != 0:
        value = f" {metavar or action.dest.upper()}" + ("..." if action.nargs in ("+", "*") else "")
    return ", ".join(f"`{option}{value}`" for option in action.option_strings)


def _usage(parser: argparse.ArgumentParser) -> str:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH + 2)  # HelpFormatter wraps at COLUMNS - 2
    try:
        usage = parser.format_usage()
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before
    first, *rest = usage.removeprefix("usage: ").rstrip().splitlines()
    return "\n".join([first, *(line[len("usage: ") :] for line in rest)])


def section(
    command: str, parser: argparse.ArgumentParser, above: argparse.ArgumentParser
) -> list[str]:
    """A command's reference: the lines between its markers. Its exit statuses are left out
    where they are those of the command it is under, said there."""
    lines = [marker(command), "", "```", _usage(parser), "```", ""]
    if parser.description:
        lines += [_markdown(parser.description), ""]
    rows = []
    children: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            children = {choice.dest: choice.help or "" for choice in action._choices_actions}
            continue
        rows.append(f"| {_names(action)} | {_markdown(action.help or '')} |")
    if children:
        lines += ["| command | what it does |", "|---|---|"]
        lines += [f"| `{command} {name}` | {_markdown(text)} |" for name, text in children.items()]
        lines.append("")
    if rows:
        lines += ["| argument, option | meaning |", "|---|---|", *rows, ""]
    if parser.epilog and parser.epilog != above.epilog:
        epilog = _markdown(parser.epilog)
        lines += [epilog[0].upper() + epilog[1:], ""]
    return [*lines, _END]


def rewritten(text: str, parser: argparse.ArgumentParser) -> str:
    """The page with each command's reference made from the parser. Raises ValueError for a
    command with no markers on the page, or markers of a command there is none of."""
    made = {words: (command, above) for words, command, above in commands(parser)}
    lines = text.splitlines()
    out: list[str] = []
    seen = set()
    index = 0
    while index < len(lines):
        match = _BEGIN.match(lines[index])
        if match is None:
            out.append(lines[index])
            index += 1
            continue
        command = match.group(1)
        if command not in made:
            raise ValueError(f"{PAGE.name}: a reference of {command!r}, which is no command")
        end = lines.index(_END, index)
        out += section(command, *made[command])
        seen.add(command)
        index = end + 1
    missing = [command for command in made if command not in seen]
    if missing:
        raise ValueError(
            f"{PAGE.name} has no reference of {', '.join(missing)}: add the line "
            f"{marker(missing[0])!r} and {_END!r} where it goes, then run this script"
        )
    return "\n".join(out) + "\n"


def main() -> int:
    """Rewrites docs/cli.md, or with --check says whether it is what the parsers make."""
    arguments = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arguments.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    check = arguments.parse_args().check
    from pool.cli.main import build_parser

    text = PAGE.read_text(encoding="utf-8")
    made = rewritten(text, build_parser())
    if made == text:
        return 0
    if check:
        lines = text.splitlines(keepends=True), made.splitlines(keepends=True)
        sys.stdout.writelines(difflib.unified_diff(*lines, "docs/cli.md", "made"))
        print("docs/cli.md is stale: run python tools/cli_reference.py", file=sys.stderr)
        return 1
    PAGE.write_text(made, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
