"""The workarounds lower() applies to programs for plugin builds known to miscompile them.

worker.known_builds lists the builds (by the SHA-256 that plugin_info
reports), what each gets wrong and which workaround covers it; here each
workaround is a rewrite of the StableHLO module. It runs on the module
jax.export produced, inside the MLIR context stablehlo.reserialize opens,
before the module is printed and serialized: so the program text, and with
it the cache key, differ from the form the build miscompiles. Rewriting the
module rather than the traced function catches an op however the program
came to contain it: jnp.arctan and jnp.arctan2 alike (CHLO is decomposed by
then), in every function, branch and loop body, whatever its operands are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker.known_builds import ATAN2_DIVISOR_BARRIER, Workaround, known_build, workarounds_enabled

Rewrite = Callable[[Any], int]
"""Changes an MLIR module in place; returns how many places it changed."""


def _owner_name(value: Any) -> str | None:
    """The name of the op that defines a value, None for a block argument."""
    owner = value.owner
    operation = getattr(owner, "operation", owner)
    return getattr(operation, "name", None)


def _barrier_atan2_divisors(module: Any) -> int:
    """Puts the divisor of every stablehlo.atan2 through a stablehlo.optimization_barrier.

    Every atan2, not only those whose divisor is a constant here: XLA folds
    values to the constant 1.0 that the module does not show as one (a
    loop-invariant carried into a while body, a select on a constant), and a
    barrier costs next to nothing where the divisor is already a buffer.
    A divisor that already comes out of a barrier is left alone.
    """
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import stablehlo

    found: list[Any] = []

    def visit(operation: Any) -> Any:
        if operation.name == "stablehlo.atan2":
            found.append(operation)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    changed = 0
    for operation in found:  # changed after the walk, which must not see its own insertions
        divisor = operation.operands[1]
        if _owner_name(divisor) == "stablehlo.optimization_barrier":
            continue
        with ir.InsertionPoint(operation), operation.location:
            barrier = stablehlo.OptimizationBarrierOp([divisor])
        operation.operands[1] = barrier.results[0]
        changed += 1
    return changed


REWRITES: dict[str, Rewrite] = {ATAN2_DIVISOR_BARRIER.name: _barrier_atan2_divisors}
"""Each workaround of worker.known_builds, by name."""


def build_workarounds(info: dict[str, Any] | None) -> tuple[Workaround, ...]:
    """The workarounds for the plugin build plugin_info describes, whether on or off."""
    build = known_build(info.get("plugin_sha256")) if info else None
    return build.workarounds if build is not None else ()


def active_workarounds(info: dict[str, Any] | None) -> tuple[Workaround, ...]:
    """The workarounds lower() applies for that plugin: none when PJRT_POOL_WORKAROUNDS=off.

    Raises ValueError for a PJRT_POOL_WORKAROUNDS that is neither on nor off.
    """
    workarounds = build_workarounds(info)
    return workarounds if workarounds and workarounds_enabled() else ()


def module_rewrite(workarounds: tuple[Workaround, ...]) -> Callable[[Any], bool] | None:
    """The rewrite that applies the workarounds to a module (True if it changed), or None."""
    if not workarounds:
        return None
    rewrites = [REWRITES[workaround.name] for workaround in workarounds]

    def rewrite(module: Any) -> bool:
        return sum(apply(module) for apply in rewrites) > 0

    return rewrite
