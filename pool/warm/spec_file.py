"""Reading a warm spec: the programs a user wants in the cache.

A spec is a Python file (``path/to/spec.py``, calling its ``programs()``) or
a ``module:function`` (or ``path/to/spec.py:function``). The function
returns or yields entries, each one of:

- ``(name, function, shapes)``, optionally followed by a platform and a list
  of custom-call targets: ``(name, function, shapes, platform, custom_calls)``;
- a ``WarmProgram`` (the same fields by name, plus compile options);
- a ``LoweredProgram``, or ``(name, LoweredProgram)``.

A spec module may also define ``initialize()``: it runs in every worker after
the plugin loads, to register custom-call targets the programs need.

A spec that cannot be loaded raises SpecError with one line saying why: the
file is missing, importing it raised (with the line) or called sys.exit, it
has no such function, the function raised, or it returned no programs.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from worker.errors import PjrtPoolError
from worker.records import LoweredProgram


class SpecError(PjrtPoolError, ValueError):
    """A spec cannot be loaded or holds an entry that is not a program."""


class WarmProgram(NamedTuple):
    """One program of a warm spec, before lowering."""

    name: str
    """The program's name in reports and in the manifest."""

    function: Callable[..., Any] | None
    """The JAX function to lower, or None when `lowered` is given."""

    shapes: Sequence[Any] = ()
    """The arguments as shapes or arrays (each may be a pytree of them), as lower() takes them."""

    platform: str | None = None
    """The platform to lower and compile for (default: the warm run's platform)."""

    custom_calls: Sequence[str] = ()
    """Custom-call targets the function may call (see lower())."""

    lowered: LoweredProgram | None = None
    """The program already lowered, when the spec gave a LoweredProgram."""

    compile_options: bytes | None = None
    """A serialized CompileOptionsProto to compile with instead of the default."""

    in_shardings: Any = None
    """The arguments' shardings, as lower() and jax.jit take them, for a program over several
    devices (docs/sharding.md); None: those the function and shapes say, if any."""

    out_shardings: Any = None
    """The results' shardings, as lower() and jax.jit take them (None: as the function says)."""


class Spec(NamedTuple):
    """A loaded spec: its programs and its optional worker initializer."""

    programs: list[WarmProgram]
    initializer: Callable[[], None] | None
    source: str


def _load_file(path: Path) -> ModuleType:
    name = f"pjrt_pool_spec_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SpecError(f"cannot load {path} as a Python file")
    module = importlib.util.module_from_spec(spec)
    # Registered so that cloudpickle and dataclasses can find the module.
    sys.modules[name] = module
    # As for a script run by Python: the spec may import modules next to it.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:
        del sys.modules[name]
        raise SpecError(f"importing {path} {_failure(error, path)}") from error
    return module


def _failure(error: BaseException, path: Path | None = None) -> str:
    """Says how running a spec's code failed: where in the spec, and with what."""
    if isinstance(error, SystemExit):
        return (
            f"called sys.exit({error.code!r}); a spec must not exit: remove the call, or put "
            "it under if __name__ == '__main__':"
        )
    where = ""
    if path is not None:
        frames = traceback.extract_tb(error.__traceback__)
        inside = [f for f in frames if Path(f.filename).resolve() == path.resolve()]
        if inside:
            where = f" at line {inside[-1].lineno}"
    message = " ".join(str(error).split())  # one line
    return f"failed{where}: {type(error).__name__}: {message}"


def _resolve(text: str) -> tuple[ModuleType, str]:
    target, function = text.rsplit(":", 1) if ":" in text else (text, "")
    if target.endswith(".py") or Path(target).is_file():
        path = Path(target)
        if not path.is_file():
            raise SpecError(f"spec file {target} does not exist")
        return _load_file(path), function or "programs"
    if not function:
        raise SpecError(f"{text!r} is neither a Python file nor module:function")
    try:
        return importlib.import_module(target), function
    except ImportError as error:
        raise SpecError(f"cannot import spec module {target!r}: {error}") from error


def entry_to_program(index: int, entry: Any) -> WarmProgram:
    """Normalizes one spec entry; raises SpecError saying what a valid entry looks like."""
    if isinstance(entry, WarmProgram):
        program = entry
    elif isinstance(entry, LoweredProgram):
        program = WarmProgram(entry.name, None, (), entry.platform, (), entry)
    elif isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], LoweredProgram):
        program = WarmProgram(str(entry[0]), None, (), entry[1].platform, (), entry[1])
    elif isinstance(entry, tuple) and 3 <= len(entry) <= 5:
        program = WarmProgram(*entry)
    else:
        raise SpecError(
            f"spec entry {index} is {type(entry).__name__}; expected (name, function, shapes"
            "[, platform[, custom_calls]]), a WarmProgram, a LoweredProgram or "
            "(name, LoweredProgram)"
        )
    if not isinstance(program.name, str) or not program.name:
        raise SpecError(f"spec entry {index} needs a non-empty str name, not {program.name!r}")
    if program.lowered is None and not callable(program.function):
        raise SpecError(f"spec entry {program.name!r}: the function is not callable")
    return program


def load_spec(text: str) -> Spec:
    """Loads a spec from a file path or module:function; raises SpecError.

    A spec with no programs is an error too: warming it would do nothing.
    """
    module, function_name = _resolve(text)
    function = getattr(module, function_name, None)
    source = getattr(module, "__file__", None)
    if not callable(function):
        raise SpecError(
            f"{source or module.__name__} has no function {function_name}(); define it to "
            "return the programs to warm, or name another function as SPEC:function"
        )
    try:
        entries: Iterable[Any] = function()
        programs = [entry_to_program(i, e) for i, e in enumerate(entries)]
    except SpecError:
        raise
    except (Exception, SystemExit) as error:
        path = Path(source) if source else None
        raise SpecError(f"{text}: {function_name}() {_failure(error, path)}") from error
    if not programs:
        raise SpecError(f"{text}: {function_name}() returned no programs; there is nothing to warm")
    names = [p.name for p in programs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SpecError(f"{text}: program names must be unique; repeated: {duplicates}")
    initializer = getattr(module, "initialize", None)
    return Spec(programs, initializer if callable(initializer) else None, text)
