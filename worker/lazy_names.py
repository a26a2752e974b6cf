"""Package namespaces whose names are imported on first use.

Python runs a package's __init__ before any of its modules, so what an
__init__ imports eagerly every importer of any module of the package pays
for. The packages whose __init__ re-exports heavy modules (pool, worker,
worker.cache) import those names only under TYPE_CHECKING, each as
``from module import Name as Name`` (the form type checkers take for a
re-export), and say why there. That block is the one list of a package's
names: on the first use of one of them, on_first_use reads it from the
package's source, and imports the name's module then.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

_BLOCK = "if TYPE_CHECKING:"


def on_first_use(package: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Returns a package's __getattr__ and __dir__ for the names its __init__ imports under
    TYPE_CHECKING, each imported from its module when used; __all__ is those names.

    The first lookup of a name imports its module and keeps the value in the
    package, so later lookups cost what any attribute does. The list is read
    at the first lookup of a public name (tens of microseconds), never for a
    private one (``from worker import _pjrt`` imports that module).
    """
    exports: dict[str, str] = {}

    def names() -> dict[str, str]:
        if not exports:
            exports.update(type_checking_imports(package))
        return exports

    def getattr_(name: str) -> Any:
        if name == "__all__":
            value: Any = sorted(names())
        else:
            module = None if name.startswith("_") else names().get(name)
            if module is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names()})

    return getattr_, dir_


def type_checking_imports(package: str) -> dict[str, str]:
    """Each name a package's __init__ imports in its ``if TYPE_CHECKING:`` block, and the
    module it imports it from, read from the package's source.

    Read as lines, one ``from module import Name as Name`` each (the form
    the formatter keeps them in; tests/test_structure.py checks that this
    reads what Python would), so that a first use costs no parse.
    """
    path = sys.modules[package].__file__
    assert path is not None, f"{package} has no source to read its names from"
    with open(path, encoding="utf-8") as file:
        lines = file.read().splitlines()
    found: dict[str, str] = {}
    for line in lines[lines.index(_BLOCK) + 1 :]:
        if line and not line[0].isspace():
            break
        words = line.split()
        if words[:1] == ["from"]:
            found[words[-1]] = words[1]
    return found
