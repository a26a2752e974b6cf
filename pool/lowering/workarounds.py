"""The workarounds lower() applies to programs for plugin builds known to miscompile them.

worker.plugin.known_builds lists the builds (by the SHA-256 that plugin_info
reports), what each gets wrong and which workaround covers it; here each
workaround is a rewrite of the StableHLO module. It runs on the module
jax.export produced, inside the MLIR context stablehlo.reserialize opens,
before the module is printed and serialized: so the program text, and with
it the cache key, differ from the form the build miscompiles. Rewriting the
module rather than the traced function catches an op however the program
came to contain it: jnp.arctan and jnp.arctan2 alike (CHLO is decomposed by
then), in every function, composite, branch and loop body.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from worker.plugin.known_builds import (
    ATAN2_DIVISOR_BARRIER,
    Workaround,
    known_build,
    workarounds_enabled,
)

Rewrite = Callable[[Any], int]
"""Changes an MLIR module in place; returns how many places it changed."""


_NOT_CONSTANT_IN_ANY_OPERAND = frozenset(
    f"stablehlo.{name}"
    for name in (
        *("add", "subtract", "multiply", "divide", "negate", "abs", "sqrt", "rsqrt", "cbrt"),
        *("exponential", "exponential_minus_one", "log", "log_plus_one", "sine", "cosine"),
        *("tan", "tanh", "logistic", "real", "imag", "convert"),
    )
)
"""Elementwise ops whose result is not a constant function of any one operand, whatever the
others are (but NaN, which makes everything NaN): x * 0 is NaN for x = inf, so not constant;
pow(x, 0) is 1 for every x, so power is not here, nor are select, compare, min and max."""

_REARRANGING = frozenset(
    f"stablehlo.{name}"
    for name in ("broadcast_in_dim", "reshape", "transpose", "slice", "dynamic_slice", "reverse")
)
"""Ops whose result elements are all elements of their first operand."""


def _name(operation: Any) -> str:
    return str(getattr(operation, "operation", operation).name)


def _symbol(attribute: Any) -> str:
    return str(ir.FlatSymbolRefAttr(attribute).value)


def _function_name(function: Any) -> str:
    return str(ir.StringAttr(function.attributes["sym_name"]).value)


def _is_block_argument(value: Any) -> bool:
    return isinstance(value.owner, ir.Block)


class _Unknowns:
    """Which values of a module XLA cannot know, in any element, when it compiles the program.

    Those are the program's inputs (the arguments of its public function),
    the results of optimization barriers, and what the ops above compute
    from them, through calls (a private function's argument counts when
    every func.call and stablehlo.composite of it passes such a value).
    Everything else might be a constant to XLA, which folds constants,
    simplifies, inlines calls and sinks loop invariants into loop bodies:
    a block argument of a loop body, a call's result, a select, anything
    the analysis does not follow. It is a semantic property, not a guess
    about XLA's passes: a value that is not a constant function of the
    inputs cannot become a constant, whatever XLA does, as long as XLA keeps
    IEEE semantics. Its fast-math flags (off by default) let it assume no
    NaN or infinity, and then x * 0 is 0: with those in XLA_FLAGS, the
    analysis no longer holds.
    """

    DEPTH = 64
    """How far back a value is followed before it counts as possibly constant."""

    def __init__(self, module: Any) -> None:
        functions: dict[str, Any] = {}
        calls: dict[str, list[Any]] = {}

        def visit(operation: Any) -> Any:
            name = operation.name
            if name == "func.func":
                functions[_function_name(operation)] = operation
            elif name == "func.call":
                calls.setdefault(_symbol(operation.attributes["callee"]), []).append(operation)
            elif name == "stablehlo.composite":
                target = _symbol(operation.attributes["decomposition"])
                calls.setdefault(target, []).append(operation)
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
        self._arguments: dict[str, set[int]] = {
            name: set(range(len(function.regions[0].blocks[0].arguments)))
            for name, function in functions.items()
            if "sym_visibility" not in function.attributes
            or ir.StringAttr(function.attributes["sym_visibility"]).value == "public"
        }
        # The least fixed point: start from the public functions' arguments and add a private
        # function's argument once every call passes a value known to be unknown.
        changed = True
        while changed:
            changed = False
            self._memo: dict[Any, bool] = {}
            for name, sites in calls.items():
                if name not in functions:
                    continue
                known = self._arguments.setdefault(name, set())
                count = len(functions[name].regions[0].blocks[0].arguments)
                for index in range(count):
                    if index in known or not all(
                        len(site.operands) == count and self.unknown(site.operands[index])
                        for site in sites
                    ):
                        continue
                    known.add(index)
                    changed = True
        self._memo = {}

    def unknown(self, value: Any, depth: int = 0) -> bool:
        """Whether XLA cannot know any element of value when it compiles."""
        if value in self._memo:
            return self._memo[value]
        if depth > self.DEPTH:
            return False
        owner = value.owner
        name = "" if _is_block_argument(value) else _name(owner)
        if not name:  # a block argument: of a function, or of a loop body or a branch
            function = owner.owner
            result = (
                _name(function) == "func.func"
                and owner == function.regions[0].blocks[0]
                and ir.BlockArgument(value).arg_number
                in self._arguments.get(_function_name(function), ())
            )
        elif name == "stablehlo.optimization_barrier":
            result = True
        elif name in _NOT_CONSTANT_IN_ANY_OPERAND:
            result = any(self.unknown(operand, depth + 1) for operand in owner.operands)
        elif name in _REARRANGING:
            result = self.unknown(owner.operands[0], depth + 1)
        elif name == "stablehlo.concatenate":  # its elements are elements of every operand
            result = all(self.unknown(operand, depth + 1) for operand in owner.operands)
        else:
            result = False
        self._memo[value] = result
        return result


def _hide(divisor: Any, before: Any) -> Any:
    """The divisor through an optimization barrier, inserted before the op `before`.

    A broadcast, or a splat constant, goes in as the value it broadcasts and
    is broadcast after the barrier, so that the fused kernel still reads that
    value, not a buffer of copies of it.
    """
    owner = divisor.owner
    name = "" if _is_block_argument(divisor) else _name(owner)
    with ir.InsertionPoint(before), before.location:
        small, dimensions = None, None
        if name == "stablehlo.broadcast_in_dim":
            small, dimensions = owner.operands[0], owner.attributes["broadcast_dimensions"]
        elif name == "stablehlo.constant":
            value = ir.DenseElementsAttr(owner.attributes["value"])
            if value.is_splat:
                element = ir.RankedTensorType(divisor.type).element_type
                scalar = ir.DenseElementsAttr.get_splat(
                    ir.RankedTensorType.get([], element), value.get_splat_value()
                )
                small, dimensions = stablehlo.ConstantOp(scalar).result, []
        if small is None:
            return stablehlo.OptimizationBarrierOp([divisor]).results[0]
        barrier = stablehlo.OptimizationBarrierOp([small])
        return stablehlo.BroadcastInDimOp(divisor.type, barrier.results[0], dimensions).result


def _barrier_atan2_divisors(module: Any) -> int:
    """Puts the divisor of every stablehlo.atan2 that XLA might see as a constant through a barrier.

    Which divisors those are is _Unknowns' question: a divisor computed
    from the program's inputs by ordinary arithmetic (arcsin's
    1 + sqrt(1 - x^2), the real part in a complex log, cos(x)) is left
    alone, and so keeps being fused with its producers; any other one,
    however it came to be (a constant, a broadcast scalar, a loop-carried
    value, a select), goes through the barrier, which costs a fused kernel
    next to nothing for a constant.
    """
    found: list[Any] = []

    def visit(operation: Any) -> Any:
        if operation.name == "stablehlo.atan2":
            found.append(operation)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    if not found:
        return 0
    unknowns = _Unknowns(module)
    divisors = [operation.operands[1] for operation in found]
    hidden = [not unknowns.unknown(divisor) for divisor in divisors]
    # Changed after the analysis and the walk, which must not see their own insertions.
    replaced = []
    for operation, divisor, hide in zip(found, divisors, hidden, strict=True):
        if hide:
            operation.operands[1] = _hide(divisor, operation)
            replaced.append(divisor)
    for divisor in dict.fromkeys(replaced):  # a splat constant or broadcast used no more
        owner = divisor.owner
        if (
            not _is_block_argument(divisor)
            and not list(divisor.uses)
            and _name(owner) in ("stablehlo.constant", "stablehlo.broadcast_in_dim")
        ):
            owner.operation.erase()
    return sum(hidden)


REWRITES: dict[str, Rewrite] = {ATAN2_DIVISOR_BARRIER.name: _barrier_atan2_divisors}
"""Each workaround of worker.plugin.known_builds, by name."""


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
