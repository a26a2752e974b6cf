"""Serializing StableHLO for the plugin that will read it.

jax.export serializes at a StableHLO version about four weeks old, which an
older plugin may not read and which forbids newer ops. pjrt-pool instead
serializes at the newest version both this jaxlib and the target plugin
know. That needs JAX's private ``serialize_portable_artifact`` (the function
jax.export itself uses); this module is the only place that touches it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from jaxlib.mlir.dialects import stablehlo

from worker.errors import PjrtPoolError

T = TypeVar("T")


class StableHLOVersionError(PjrtPoolError, RuntimeError):
    """The plugin and this jaxlib share no StableHLO version, or JAX moved its serializer."""


def _private_api() -> tuple[Any, Any, Any]:
    # Imported on first use, not at the top: a JAX that moved them raises the
    # error below when a program is serialized, not when pjrt-pool is imported.
    try:
        from jax._src import xla_bridge
        from jax._src.interpreters import mlir as jax_mlir
        from jax._src.lib import _jax
    except ImportError as error:
        raise StableHLOVersionError(
            f"this JAX version moved the private StableHLO serializer pjrt-pool uses ({error}); "
            "install a jax within pjrt-pool's supported range"
        ) from None
    if not hasattr(_jax.mlir, "serialize_portable_artifact"):
        raise StableHLOVersionError(
            "this JAX version has no _jax.mlir.serialize_portable_artifact; "
            "install a jax within pjrt-pool's supported range"
        )
    return _jax, jax_mlir, xla_bridge


def _parse(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def target_version(plugin_minimum: str | None, plugin_current: str | None) -> str | None:
    """Returns the StableHLO version to serialize at: the newer of what both sides read.

    None when the plugin does not say (then jax.export's default is used).
    Raises StableHLOVersionError when the windows do not overlap.
    """
    if plugin_current is None:
        return None
    producer = stablehlo.get_current_version()
    target = min(plugin_current, producer, key=_parse)
    if plugin_minimum is not None and _parse(target) < _parse(plugin_minimum):
        raise StableHLOVersionError(
            f"this jaxlib writes StableHLO up to {producer} but the plugin reads "
            f"{plugin_minimum} to {plugin_current}: install a newer jaxlib or an older plugin"
        )
    return target


def _export_default_version() -> str:
    """The StableHLO version jax.export serializes at (about four weeks old)."""
    return str(
        stablehlo.get_version_from_compatibility_requirement(
            stablehlo.StablehloCompatibilityRequirement.WEEK_4
        )
    )


def reserialize(
    artifact: bytes,
    target: str | None,
    rewrite: Callable[[Any], bool] | None = None,
    describe: Callable[[Any], T] | None = None,
) -> tuple[bytes, str, T | None]:
    """Returns (bytecode at `target`, module text without locations, what describe(module)
    returns, or None without describe) for a jax.export artifact.

    The bytecode keeps source locations, so the plugin's errors point at the
    user's code; the text leaves them out, so that the cache key depends on
    the program only, not on where it was written. rewrite, if given,
    changes the MLIR module in place first (returning whether it changed
    anything): the workarounds for plugin builds known to miscompile some
    programs (pool.lowering.workarounds). describe reads the module as it
    is compiled (pool.lowering.options: the options JAX compiles it with).
    """
    _jax, jax_mlir, xla_bridge = _private_api()
    with jax_mlir.make_ir_context():
        module = _jax.mlir.deserialize_portable_artifact(artifact)
        changed = rewrite is not None and rewrite(module)
        text = module.operation.get_asm(enable_debug_info=False)
        described = None if describe is None else describe(module)
        if target is None:
            if not changed:
                return artifact, text, described
            target = _export_default_version()
        try:
            code = _jax.mlir.serialize_portable_artifact(
                module, target, xla_bridge.get_backend().serialize_with_sdy
            )
        except Exception as error:  # the serializer raises plain errors for unsupported ops
            raise StableHLOVersionError(
                f"cannot serialize this program for StableHLO {target}, the newest version "
                f"the plugin reads: {error}. The program uses an op newer than the plugin; "
                "use a newer plugin"
            ) from error
    return code, text, described
