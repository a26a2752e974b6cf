"""One base for every error pjrt-pool raises: ``except PjrtPoolError`` catches anything it raised.

Every exception class defined in pool/ and worker/ derives from PjrtPoolError
(worker/errors.py, exported by ``pool`` and ``worker``), and still from the
builtin it derived from before there was a base, so that ``except ValueError``
code keeps working; warnings are not errors, and the one KeyboardInterrupt
(an interrupted warm) stays an interrupt, which ``except Exception`` must not
catch. The native module raises worker.errors' own classes.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
from conftest import REPO

import pool
import worker
from worker import _pjrt
from worker.errors import PjrtPoolError

ENTRY_POINTS = {"worker.__main__"}
"""Modules that do what they are for as they are imported (a pool worker's main loop)."""


def _every_module() -> list[str]:
    names = []
    for package in ("pool", "worker"):
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names.append(".".join(parts))
    return [name for name in names if name not in ENTRY_POINTS]


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class pool/ and worker/ define, by its qualified name."""
    found: dict[str, type[BaseException]] = {}
    for name in _every_module():
        module = importlib.import_module(name)
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__ == name:
                found[f"{name}.{value.__qualname__}"] = value
    return found


def test_every_error_pjrt_pool_defines_derives_from_the_one_base():
    classes = _exception_classes()
    assert len(classes) > 50, sorted(classes)  # the walk reached every module
    outside = [
        name
        for name, cls in classes.items()
        if not issubclass(cls, (Warning, KeyboardInterrupt)) and not issubclass(cls, PjrtPoolError)
    ]
    assert not outside, f"errors that do not derive from PjrtPoolError: {outside}"
    interrupts = [name for name, cls in classes.items() if issubclass(cls, KeyboardInterrupt)]
    assert sorted(interrupts) == [
        "pool.cli.interrupts.Reported",
        "pool.warm.report.WarmInterrupted",
    ]
    assert not any(issubclass(classes[name], Exception) for name in interrupts)


BUILTIN_BASES = {
    "BundleError": ValueError,
    "DescriptorLimitError": OSError,
    "DeviceCountError": ValueError,
    "DeviceFailureError": RuntimeError,
    "FfiVersionError": RuntimeError,
    "ForeignExecutableError": ValueError,
    "InvalidKeyError": ValueError,
    "MissingCustomCallError": RuntimeError,
    "MissingExtraError": ModuleNotFoundError,
    "NeverCompileError": LookupError,
    "NotInCacheError": LookupError,
    "PjrtError": RuntimeError,
    "PlatformMismatchError": RuntimeError,
    "PluginLoadError": OSError,
    "PluginNotFoundError": RuntimeError,
    "PoolClosedError": RuntimeError,
    "PoolError": RuntimeError,
    "PoolForkedError": RuntimeError,
    "ProgramQuarantinedError": RuntimeError,
    "RemoteWorkerError": RuntimeError,
    "TaskTimeoutError": TimeoutError,
    "TracedPoolFunctionError": TypeError,
    "WorkerCrashedError": RuntimeError,
    "WorkerStartupError": RuntimeError,
}
"""The builtin each public error of ``pool`` derived from before the base: it still does."""


def test_the_public_errors_keep_their_builtin_bases_and_are_pool_names():
    public = {
        name: getattr(pool, name)
        for name in dir(pool)
        if isinstance(getattr(pool, name), type) and issubclass(getattr(pool, name), Exception)
    }
    assert public.pop("PjrtPoolError") is PjrtPoolError is worker.PjrtPoolError
    wrong = {
        name: builtin.__name__
        for name, builtin in BUILTIN_BASES.items()
        if not (issubclass(public[name], builtin) and issubclass(public[name], PjrtPoolError))
    }
    assert not wrong, f"errors that lost their builtin base, or have not the one base: {wrong}"
    assert set(BUILTIN_BASES) <= set(public), set(BUILTIN_BASES) - set(public)


def test_errors_the_native_module_raises_are_caught_as_the_base_and_as_before(tmp_path: Path):
    assert _pjrt.PjrtError is worker.errors.PjrtError
    assert _pjrt.PluginLoadError is worker.errors.PluginLoadError
    assert issubclass(_pjrt.HandlerVersionError, _pjrt.PjrtError)
    assert issubclass(_pjrt.SocketError, ConnectionError)
    not_a_plugin = tmp_path / "libnot_a_plugin.so"
    not_a_plugin.write_bytes(b"not an ELF file")
    with pytest.raises(PjrtPoolError) as caught:
        _pjrt.Plugin.load(str(not_a_plugin))
    assert isinstance(caught.value, OSError) and type(caught.value) is _pjrt.PluginLoadError


def test_an_error_of_the_parent_side_is_caught_as_the_base_and_as_before(tmp_path: Path):
    from pool.warm import SpecError, load_spec

    for family in (PjrtPoolError, ValueError, SpecError):
        with pytest.raises(family, match="does not exist"):
            load_spec(str(tmp_path / "missing_spec.py"))
