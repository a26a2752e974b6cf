"""The command line's help is for users, and docs/cli.md is made of it (issue 53).

docs/cli.md's reference of each command is what tools/cli_reference.py
makes of the parsers, so the page cannot say other than --help does; and
the help itself: every command has a description and every argument and
option a help that says its default, with a metavar of its own (N, DIR), in
plain text (no reStructuredText, no internal module). A default the help
states is the one the command takes (the platform's, here).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from conftest import load_tool, pjrt_pool

from pool.cli.main import build_parser

TRIVIAL_DEFAULTS = (None, False, [], argparse.SUPPRESS)
_REFERENCE = load_tool("cli_reference")
PAGE, commands, rewritten = _REFERENCE.PAGE, _REFERENCE.commands, _REFERENCE.rewritten


def every_parser() -> list[tuple[str, argparse.ArgumentParser]]:
    return [(words, parser) for words, parser, _ in commands(build_parser())]


def _words(text: str) -> str:
    """The page with every run of whitespace as one space: argparse wraps a usage line where
    a long option group falls (3.13 keeps a group of alternatives on one line, 3.11 breaks it),
    and the page is written with one Python."""
    return " ".join(text.split())


def test_the_command_line_page_is_what_the_parsers_make() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert _words(rewritten(text, build_parser())) == _words(text), (
        "docs/cli.md differs from the parsers: run python tools/cli_reference.py"
    )


def test_every_command_option_and_argument_says_what_it_is() -> None:
    missing, unnamed, silent = [], [], []
    for words, parser in every_parser():
        if not parser.description:
            missing.append(words)
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = action.option_strings[-1] if action.option_strings else action.dest
            if not action.help:
                missing.append(f"{words} {name}")
            if action.option_strings and action.nargs != 0 and action.metavar is None:
                unnamed.append(f"{words} {name}")  # argparse would show --workers WORKERS
            says = "default" in (action.help or "")
            if action.nargs != 0 and action.default not in TRIVIAL_DEFAULTS and not says:
                silent.append(f"{words} {name} (default {action.default!r})")
    assert not missing, f"without a description or help: {missing}"
    assert not unnamed, f"options whose value has no metavar of its own: {unnamed}"
    assert not silent, f"options whose help does not say their default: {silent}"


def test_help_is_plain_text_for_users() -> None:
    internal = re.compile(r"\b(pool\.(cli|executor|warm|lowering)|worker\.[a-z])")
    found = []
    for words, parser in every_parser():
        texts = [parser.description or "", parser.epilog or ""]
        texts += [action.help or "" for action in parser._actions]
        for text in texts:
            if "``" in text or internal.search(text):
                found.append(f"{words}: {text[:120]}")
    assert not found, found


def test_every_command_s_help_ends_with_its_exit_statuses() -> None:
    for words, parser in every_parser():
        help_text = parser.format_help()
        assert re.search(r"[Ee]xit status(es)?:", help_text), words


def test_the_platform_a_help_names_as_default_is_the_one_taken(tmp_path: Path) -> None:
    """warm --help: '--platform P ... (default: $PJRT_POOL_PLATFORM, else cpu)'."""
    spec = tmp_path / "spec.py"
    spec.write_text("def programs():\n    return []\n")
    done = pjrt_pool("warm", str(spec), env={"PJRT_POOL_PLATFORM": "nosuch"})
    assert done.returncode == 2 and "--platform nosuch: no PJRT plugin found" in done.stderr


@pytest.mark.parametrize("words", ["--help", "bundle create --help", "cache gc --help"])
def test_help_is_the_page_s_in_a_child(words: str) -> None:
    """What a user reads: the real command's help holds each help text the page shows."""
    done = pjrt_pool(*words.split(), env={"COLUMNS": "1000"})
    assert done.returncode == 0, done.stderr
    parser = dict(every_parser()).get(" ".join(["pjrt-pool", *words.split()[:-1]]))
    if parser is not None:
        for action in parser._actions:
            assert " ".join((action.help or "").split()) in " ".join(done.stdout.split())
