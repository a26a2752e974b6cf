"""What a pool worker is started with: the command line of ``python -m worker``.

WorkerCommand states it once: the parent makes one for each worker it spawns
(pool.executor.processes) and writes it with arguments(); worker/__main__.py
reads it back with parse(). Each field is an option named after it
(``max_loaded``: ``--max-loaded``): a bool is a flag given when true, None is
left out, and a TopologySpec travels as its JSON (TopologySpec.to_json). A
field is added here and used by the server; nothing else restates it.

What the worker's environment carries instead, set by the parent for it
alone (pool.executor.processes): its cache directory (PJRT_POOL_CACHE_DIR,
the one way a worker is given it), the remote tier (PJRT_POOL_CACHE_REMOTE)
and its plan's variables (a device worker's chip).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.plugin.topology import TopologySpec


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class WorkerCommand:
    """A pool worker's command line (see the module docstring)."""

    fd: int = field(metadata=_help("the inherited socket's descriptor"))
    max_loaded: int = field(metadata=_help("executables kept loaded"))
    parent_pid: int | None = field(default=None, metadata=_help("exit when it dies"))
    platform: str | None = field(default=None, metadata=_help("platform whose plugin to load"))
    never_compile: bool = field(
        default=False, metadata=_help("load from the cache only, never compile")
    )
    topology: TopologySpec | None = field(
        default=None,
        metadata=_help("compile for this topology (TopologySpec.to_json) without a device"),
    )

    def arguments(self) -> list[str]:
        """The arguments after ``python -m worker`` that parse() reads back as this command."""
        found: list[str] = []
        for item, kind in _fields():
            value = getattr(self, item.name)
            if value is None or value is False:
                continue
            found.append(_flag(item.name))
            if kind is not bool:
                found.append(_WRITE.get(kind, str)(value))
        return found

    @classmethod
    def parse(cls, argv: Sequence[str]) -> WorkerCommand:
        """The command that arguments() wrote; exits with argparse's usage error otherwise."""
        parser = argparse.ArgumentParser(
            prog="python -m worker", description="a pool worker serving its parent on a socket"
        )
        for item, kind in _fields():
            text = item.metadata.get("help")
            if kind is bool:
                parser.add_argument(_flag(item.name), action="store_true", help=text)
                continue
            required = item.default is dataclasses.MISSING
            parser.add_argument(
                _flag(item.name), type=_READ.get(kind, kind), required=required, help=text
            )
        return cls(**vars(parser.parse_args(list(argv))))


def _fields() -> list[tuple[dataclasses.Field[Any], type]]:
    """Each field, with its type without None (int for `int | None`)."""
    hints = typing.get_type_hints(WorkerCommand, {"TopologySpec": TopologySpec})
    found = []
    for item in dataclasses.fields(WorkerCommand):
        kinds = [kind for kind in typing.get_args(hints[item.name]) if kind is not type(None)]
        found.append((item, kinds[0] if kinds else hints[item.name]))
    return found


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_WRITE: dict[type, Callable[[Any], str]] = {
    TopologySpec: lambda spec: json.dumps(spec.to_json()),
}
"""How a field's value is written, where str() does not do it."""

_READ: dict[type, Callable[[str], Any]] = {
    TopologySpec: lambda text: TopologySpec.from_json(json.loads(text)),
}
"""How a field's value is read, where its type does not read it."""
