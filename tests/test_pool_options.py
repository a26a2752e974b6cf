"""Each Pool option is declared once (pool.executor.options); what is made of the
declarations, or written out beside them, agrees with them.

- Pool's signature (written out in WorkerPool.__init__ so that type checkers
  see it) states exactly the declared options, in order, with their kinds,
  types and defaults; help(Pool) documents each one.
- Every option reaches the executor's settings, as a PoolSettings field of
  its own name holding its checked value, or combined with others.
- ClusterPool and RayClusterPool take every Pool option, with Pool's defaults and checks.
- docs/pool.md states the signature.
- A worker's command line reads back as the parent wrote it.
- `pjrt-pool`'s flags for Pool options are the declared ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import pydoc
from collections.abc import Iterator
from pathlib import Path

import pytest

from pool import DeviceStart, Pool
from pool.executor.options import OPTIONS, POOL_OPTIONS, signature_text
from pool.executor.settings import PoolSettings

REPO = Path(__file__).resolve().parent.parent

COMBINED = {"initargs": "initializer", "preload_names": "preload", "run_workers": "plan"}
"""The options that reach PoolSettings combined with another, and the field they reach."""


def test_the_signature_of_pool_is_the_declared_options() -> None:
    parameters = list(inspect.signature(Pool).parameters.values())
    assert [p.name for p in parameters] == [o.name for o in POOL_OPTIONS]
    for parameter, option in zip(parameters, POOL_OPTIONS, strict=True):
        kind = (
            inspect.Parameter.POSITIONAL_OR_KEYWORD
            if option.positional
            else inspect.Parameter.KEYWORD_ONLY
        )
        stated = (parameter.kind, parameter.default, parameter.annotation)
        assert stated == (kind, option.default, option.annotation), option.name


def test_help_documents_every_option() -> None:
    text = pydoc.render_doc(Pool, renderer=pydoc.plaintext)
    lines = [line.removeprefix(" |  ").strip() for line in text.splitlines()]
    flat = " ".join(" ".join(lines).split())
    for option in POOL_OPTIONS:
        assert f"{option.name}: {option.annotation} = {option.shown()}" in lines, option.name
        assert " ".join(option.doc.split()) in flat, option.name


def test_every_option_reaches_the_settings_checked(tmp_path: Path) -> None:
    given = {option.name: option.default for option in POOL_OPTIONS}
    given.update(workers=3, cache_dir=str(tmp_path), max_loaded=5, zero_copy=False, prime=True)
    given.update(task_timeout=7, stop_grace=1, segment_fds=9, remote=False, never_compile=True)
    given.update(device_start="at once")
    settings = PoolSettings.check(given)
    fields = {field.name for field in dataclasses.fields(PoolSettings)}
    for option in POOL_OPTIONS:
        assert option.name in fields or COMBINED.get(option.name) in fields, option.name
    assert (settings.workers, settings.max_loaded, settings.segment_fds) == (3, 5, 9)
    assert (settings.zero_copy, settings.prime, settings.never_compile) == (False, True, True)
    assert (settings.task_timeout, settings.stop_grace, settings.remote) == (7.0, 1.0, False)
    assert isinstance(settings.stop_grace, float)  # the check's value, not the one given
    assert settings.device_start is DeviceStart.AT_ONCE


def test_the_first_bad_option_in_the_signature_order_is_the_one_named() -> None:
    with pytest.raises(TypeError, match="max_loaded must be an int"):
        PoolSettings.check(
            {**{o.name: o.default for o in POOL_OPTIONS}, "max_loaded": "3", "prime": "yes"}
        )
    defaults = {o.name: o.default for o in POOL_OPTIONS}
    with pytest.raises(ValueError, match="device_start must be a DeviceStart or one of"):
        PoolSettings.check({**defaults, "device_start": "later"})
    with pytest.raises(TypeError, match="device_start must be a DeviceStart"):
        PoolSettings.check({**defaults, "device_start": True})
    with pytest.raises(TypeError, match="unexpected options"):
        PoolSettings.check({**{o.name: o.default for o in POOL_OPTIONS}, "max_load": 3})


@pytest.mark.parametrize("engine", ["distributed", "ray"])
def test_cluster_pools_take_every_pool_option_with_pool_defaults(engine: str) -> None:
    pytest.importorskip(engine)
    from pool import cluster

    cluster_pool = cluster.ClusterPool if engine == "distributed" else cluster.RayClusterPool
    parameters = inspect.signature(cluster_pool).parameters
    named = {"workers_per_node": "workers"}
    shared = [named.get(name, name) for name in parameters if named.get(name, name) in OPTIONS]
    assert shared == [option.name for option in POOL_OPTIONS]  # every one, in Pool's order
    for name, parameter in parameters.items():
        option = OPTIONS.get(named.get(name, name))
        if option is not None:
            assert parameter.default == option.default, name
            assert parameter.annotation == option.annotation, name
            assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, name
    # The docstring's options section is made of the same declarations.
    assert "workers_per_node: int | None = None" in (cluster_pool.__doc__ or "")
    assert "device_start: DeviceStart = DeviceStart.WHEN_NEEDED" in (cluster_pool.__doc__ or "")


def test_the_docs_state_the_signature() -> None:
    text = " ".join((REPO / "docs" / "pool.md").read_text().split())
    assert f"`{signature_text()}`" in text


def test_a_worker_command_reads_back_as_the_parent_wrote_it() -> None:
    from worker.plugin.topology import parse_topology
    from worker.serve.command_line import WorkerCommand

    full = WorkerCommand(
        fd=5,
        max_loaded=3,
        parent_pid=7,
        platform="cpu",
        never_compile=True,
        topology=parse_topology("v5e:2x2", {"chips_per_host_bounds": [2, 2, 1]}),
    )
    bare = WorkerCommand(fd=5, max_loaded=64)
    for command in (full, bare):
        assert WorkerCommand.parse(command.arguments()) == command
    assert "--cache-dir" not in full.arguments()  # the environment carries it, alone


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """A parser and every subcommand's parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def test_pjrt_pool_flags_for_pool_options_are_made_from_the_declarations() -> None:
    from pool.cli.main import build_parser

    flags = {o.flag.name: o for o in POOL_OPTIONS if o.flag is not None}
    seen = set()
    for parser in _parsers(build_parser()):
        for action in parser._actions:
            for text in set(action.option_strings) & set(flags):
                declared = flags[text].flag
                assert declared is not None
                made = (action.metavar, action.type or str, action.default)
                assert made == (declared.metavar, declared.type, None), (parser.prog, text)
                seen.add(text)
    assert seen == set(flags)  # each declared flag is some command's
