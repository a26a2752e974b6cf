"""Package namespaces whose names are imported on first use.

Python runs a package's __init__ before any of its modules, so what an
__init__ imports eagerly every importer of any module of the package pays
for. The packages whose __init__ re-exports heavy modules (pool, worker,
worker.cache) give each name's module here instead, and say why there.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def on_first_use(
    package: str, modules: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Returns a package's __getattr__ and __dir__ for names imported from `modules` when used.

    modules maps each name to the module that defines it. The first lookup
    imports the module and keeps the value in the package, so later lookups
    cost what any attribute does.
    """

    def getattr_(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *modules})

    return getattr_, dir_
