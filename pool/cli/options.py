"""Options that several commands take, parsed and reported one way.

``add_command`` adds a command (or a subcommand) the one way main.py runs
it: its parser knows the function that runs it and its own name (prog), for
its messages; ``paragraph`` takes a command's description from its module's
docstring. ``argument_type`` makes an argparse type of a parser that raises
ValueError (size, and the cache commands' durations), so that a bad value is
argparse's usage error. ``--remote URL`` (``add_remote_option``) names the
remote cache tier, by default PJRT_POOL_CACHE_REMOTE; ``remote_url`` and
``open_remote_option`` check it as the remote tier parses it, and a URL it
cannot use is a UsageError naming where the URL came from: exit 2 for every
command that takes it. ``open_remote_option`` also reads the tier's other
settings (time limits, signing keys), and one it cannot use is a UsageError
naming the variable. The remote tier's modules are imported only when a
command asks for its remote. ``--topology NAME`` (``add_topology_options``,
with repeatable ``--topology-option KEY=VALUE``) names a topology to compile
for, or check against, without its devices (worker.plugin.topology);
``topology_option`` parses it, and a name libtpu would not take is a
UsageError. A flag that sets a Pool option (``--workers``, ``--platform``,
``--cache-dir``, ``--timeout``, ``--remote``, ``--topology``) is made from the
option's declaration (pool.executor.options: its flag, the word for its
value, its type) by ``add_pool_option``, with each command's own help, and
``pool_option`` checks its value with the option's own check: a bad one is a
UsageError naming the flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pool.cli.main import UsageError
from pool.executor.options import OPTIONS
from worker.cache.location import parse_size

if TYPE_CHECKING:
    from worker.cache.remote import RemoteCache
    from worker.plugin.topology import TopologySpec

_T = TypeVar("_T")


def add_command(
    commands: Any,
    name: str,
    run: Callable[[argparse.Namespace], int],
    help: str | None,
    description: str | None = None,
    *,
    epilog: str | None = None,
    parents: tuple[argparse.ArgumentParser, ...] = (),
    **defaults: Any,
) -> argparse.ArgumentParser:
    """Adds a command to `commands` (what add_subparsers returns) and returns its parser.

    help is its line in the list of commands (None: not listed), description
    what its own --help says first (default: help), epilog what it says
    last (its exit statuses). These texts are for users, in plain text: the
    command line's reference (docs/cli.md) is made of them (tools/cli_reference.py).
    main.py calls run(args) for it, with args.prog its name as its usage
    errors say it; defaults are further values args takes (exit_at_once).
    """
    texts = {"help": help} if help is not None else {}
    parser = commands.add_parser(
        name,
        parents=list(parents),
        description=description or _sentence(help),
        epilog=epilog,
        **texts,
    )
    parser.set_defaults(run=run, prog=parser.prog, **defaults)
    return parser


def _sentence(text: str | None) -> str | None:
    """A command's line in a list of commands, as the sentence its own --help starts with."""
    return None if not text else text[0].upper() + text[1:] + "."


def paragraph(docstring: str | None, index: int) -> str:
    """The index-th paragraph of a module docstring, on one line, without reStructuredText's
    double backticks: a command's description."""
    return (docstring or "").split("\n\n")[index].replace("\n", " ").replace("``", "")


def add_cluster_options(
    parser: argparse.ArgumentParser | Any, verb: str, how: str | None = None
) -> None:
    """Adds ``--scheduler ADDRESS`` (a Dask cluster, or local:N) and ``--ray ADDRESS`` (a Ray
    cluster, or local:N), one or the other, to a command's parser (cluster_address reads
    them)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        default=None,
        help=f"{verb} the Dask cluster at ADDRESS (tcp://host:8786), or on a local cluster of "
        f"N workers started for this run (local:N){', ' + how if how else ''}; needs the "
        "cluster extra",
    )
    group.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help=f"{verb} the Ray cluster whose head is at ADDRESS (host:6379), or on a local Ray "
        f"cluster of N nodes started for this run (local:N){', ' + how if how else ''}, a "
        "pjrt-pool actor on each node; needs the ray extra",
    )


def cluster_address(args: argparse.Namespace) -> str | None:
    """The cluster a command runs on (--scheduler's or --ray's address), or None: here."""
    return args.scheduler or args.ray  # type: ignore[no-any-return]


def check_cluster(args: argparse.Namespace) -> None:
    """Raises MissingExtraError (exit 2, naming the extra) when the engine of --scheduler or
    --ray is not installed, and UsageError for a --ray that is neither local:N nor a head
    that answers (one line, at once, instead of Ray's minutes of retries)."""
    from worker.extras import Feature, require

    if args.scheduler:
        require(Feature.CLUSTER)
    elif args.ray:
        require(Feature.RAY)
        from pool.cluster.ray.connect import check_reachable, parse_local

        try:
            if parse_local(args.ray) is None:
                check_reachable(args.ray)
        except (ValueError, ConnectionError) as error:
            raise UsageError(f"--ray {args.ray}: {error}") from None


def argument_type(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """Returns an argparse type that converts with parse, whose ValueError is a usage error."""

    def convert(text: str) -> _T:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


size_argument = argument_type(parse_size)
"""The argparse type of a size (500M, 2G)."""


def add_pool_option(
    parser: argparse.ArgumentParser | Any, name: str, help: str, *, default: str | None = None
) -> None:
    """Adds the flag of the Pool option `name` to a command's parser, as its declaration
    says (pool.executor.options), with help saying what the command does with it. Its
    default is None: what the option's default is, where the command passes it on. The
    help ends "(default: ...)" with `default`, where the command says its own, else the
    flag's shown_default, where the declaration has one (--platform, --cache-dir)."""
    flag = OPTIONS[name].flag
    if flag is None:
        raise ValueError(f"Pool option {name!r} declares no flag")
    shown = default or flag.shown_default
    if shown is not None:
        help = f"{help} (default: {shown})"
    parser.add_argument(flag.name, metavar=flag.metavar, type=flag.type, default=None, help=help)


def pool_option(args: argparse.Namespace, name: str) -> Any:
    """The value a command was given for the Pool option `name` (add_pool_option's flag),
    checked by the option's own check, or the option's default where it was not given; a bad
    one is a UsageError naming the flag."""
    option = OPTIONS[name]
    assert option.flag is not None, name
    value = getattr(args, option.flag.name.removeprefix("--").replace("-", "_"))
    if value is None:  # not given: the option's default
        return option.default
    try:
        return option.checked(value, option.flag.name)
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from None


def add_remote_option(parser: argparse.ArgumentParser | Any, what: str) -> None:
    """Adds ``--remote URL`` to a command's parser; what says what the command does with it."""
    add_pool_option(
        parser,
        "remote",
        f"{what} (s3://bucket/prefix, file:///dir, ...; default: $PJRT_POOL_CACHE_REMOTE)",
    )


def remote_url(option: str | None) -> str | None:
    """Returns the remote tier's URL: the option, else PJRT_POOL_CACHE_REMOTE; None for none.

    Raises UsageError, naming --remote or the variable, for a URL the remote
    tier cannot use (its scheme, or its form).
    """
    from worker.cache.remote.location import resolve_remote

    try:
        location = resolve_remote(option)
    except ValueError as error:  # the variable's message names it
        raise UsageError(f"--remote: {error}" if option is not None else str(error)) from None
    return None if location is None else location.url


def open_remote_option(option: str | None) -> RemoteCache | None:
    """Returns this process's remote tier for the option (default: the variable), or None.

    Raises UsageError for a bad URL (remote_url), or a setting of the tier's
    other variables it cannot use (time limits, signing keys, a key file
    others can read): the user fixes the command line or the environment.
    """
    url = remote_url(option)
    if url is None:
        return None
    from worker.cache.remote import open_remote

    try:
        return open_remote(url)
    except ValueError as error:  # its message names the variable and what to write
        raise UsageError(str(error)) from None


def add_topology_options(parser: argparse.ArgumentParser | Any, what: str) -> None:
    """Adds ``--topology NAME`` and ``--topology-option KEY=VALUE`` to a command's parser;
    what says what the command does for the topology."""
    add_pool_option(
        parser,
        "topology",
        f"{what}; NAME as libtpu names topologies: v5e:1x1, v5e:2x2, v6e:2x4, ...",
    )
    parser.add_argument(
        "--topology-option",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="a create option of the --topology, overriding the ones derived from its name "
        "(repeatable), for example chips_per_host_bounds=2,2,1",
    )


def topology_option(args: argparse.Namespace) -> TopologySpec | None:
    """The TopologySpec --topology and --topology-option name (None for none); a name or an
    option the topology cannot take is a UsageError."""
    from worker.plugin.topology import parse_topology

    if args.topology is None:
        if args.topology_option:
            raise UsageError("--topology-option needs --topology")
        return None
    options: dict[str, Any] = {}
    for text in args.topology_option:
        key, equals, value = text.partition("=")
        if not equals or not key:
            raise UsageError(f"--topology-option {text!r}: write KEY=VALUE")
        options[key] = _option_value(value)
    try:
        return parse_topology(args.topology, options)
    except (ValueError, TypeError) as error:
        raise UsageError(f"--topology: {error}") from None


def _option_value(text: str) -> Any:
    """A create option's value from the command line: a list of ints, an int, a bool or text."""
    parts = text.split(",")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        return {"true": True, "false": False}.get(text.lower(), text)
    return numbers if len(parts) > 1 else numbers[0]
