"""lower: a JAX function to a LoweredProgram that a PJRT plugin compiles.

Arguments and results may be any JAX pytrees. A program takes and returns the
pytrees' leaves, flattened in JAX's order: lower_tree records the structures
(a TreeProgram) so that callers such as Pool.function can flatten arguments
and rebuild results. A typed PRNG key crosses a program's boundary as its key
data (jax.random.key_data: uint32, the key shape plus the implementation's
key shape); inside the program it is wrapped back into a key of the same
implementation, and a key the function returns leaves as key data.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from pool.lowering.devices import leave_devices_to_workers
from pool.lowering.options import detailed_logging, jit_compile_options
from pool.lowering.plugin_info import plugin_info
from pool.lowering.sharding import boundary_shardings, flat_shardings, partitioning_of
from pool.lowering.stablehlo import reserialize, target_version
from pool.lowering.workarounds import active_workarounds, module_rewrite
from worker.dtypes import code_of_dtype
from worker.plugin.platforms.registry import platform_named, platform_of_jax_device
from worker.records import ArrayType, DigestedProgram, LoweredProgram

KeyDtype = Any
"""The dtype of a typed PRNG key array (key<fry>, ...), which numpy cannot represent."""


class TreeProgram(NamedTuple):
    """A lowered program and how its flat inputs and outputs map to the function's pytrees."""

    program: LoweredProgram
    """The program, whose inputs and outputs are the flattened leaves."""

    in_tree: Any
    """The jax PyTreeDef of ``(args, kwargs)``."""

    input_keys: tuple[KeyDtype | None, ...]
    """Per flat input: the key dtype whose key data it carries, or None for an array."""

    out_tree: Any
    """The jax PyTreeDef of the function's result."""

    output_keys: tuple[KeyDtype | None, ...]
    """Per flat output: the key dtype whose key data it carries, or None for an array."""

    float0_outputs: tuple[int, ...] = ()
    """Flat outputs of dtype float0 (gradients of integer inputs), which the program
    returns as booleans of the same shape (a float0 array holds no data)."""


def _jax_platform(device: Any) -> str:
    """The platform of a device of JAX's ("cpu", "cuda", "rocm", "tpu"; a "gpu" device's
    client names CUDA or ROCm in its platform version)."""
    version = getattr(device.client, "platform_version", "")
    return platform_of_jax_device(device.platform, version)


def lowering_platform(shapes: Sequence[Any]) -> str:
    """Returns the platform that arguments lower for when no platform is named.

    Arrays (and ShapeDtypeStructs with a sharding) committed to devices choose
    their devices' platform; otherwise JAX's default device decides
    (``jax.config.jax_default_device``, else the default backend). Arguments
    on devices of different platforms are refused with ValueError. Each
    argument may be a pytree; its leaves count.
    """
    platforms = set()
    for shape in jax.tree_util.tree_leaves(list(shapes)):
        sharding = getattr(shape, "sharding", None)
        if sharding is None or (isinstance(shape, jax.Array) and not shape.committed):
            continue
        platforms.update(_jax_platform(d) for d in sharding.device_set)
    if len(platforms) > 1:
        raise ValueError(
            f"the arguments are on devices of several platforms ({sorted(platforms)}); "
            "move them to one, or name the platform"
        )
    if platforms:
        return platforms.pop()
    default = jax.config.jax_default_device
    if isinstance(default, str):
        return platform_of_jax_device(default)
    if default is not None:
        return _jax_platform(default)
    return _jax_platform(jax.devices()[0])


def key_dtype_of(dtype: Any) -> KeyDtype | None:
    """Returns dtype if it is a typed PRNG key dtype, else None."""
    if dtype is None:
        return None
    try:
        return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else None
    except TypeError:  # not a dtype at all
        return None


_PYTHON_SCALARS = (bool, int, float, complex)
"""The Python scalars jax.jit traces as weakly typed 0-d arrays (bool is strongly typed)."""


def _leaf_shape(label: str, value: Any) -> tuple[jax.ShapeDtypeStruct, KeyDtype | None]:
    """One argument leaf as the ShapeDtypeStruct the program takes, and its key dtype if a key."""
    if isinstance(value, jax.ShapeDtypeStruct):
        shape = value
    elif type(value) in _PYTHON_SCALARS:
        try:
            aval = jax.typeof(value)
        except OverflowError as error:  # an int that does not fit the default integer type
            raise TypeError(f"{label}: {error}") from None
        shape = jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
    elif hasattr(value, "shape") and hasattr(value, "dtype"):
        shape = jax.ShapeDtypeStruct(
            value.shape, value.dtype, weak_type=bool(getattr(value, "weak_type", False))
        )
    else:
        kind = type(value).__name__
        raise TypeError(
            f"{label} must be a jax.ShapeDtypeStruct, an array or a Python scalar, not {kind}: "
            "a program takes arrays only. Convert a value that is array-like with "
            "jnp.asarray(x); make one that is not static (static_argnums in Pool.function) "
            "or bind it with functools.partial before lowering"
        )
    if any(not isinstance(n, int) for n in shape.shape):
        raise TypeError(f"{label} has a symbolic shape {shape.shape}; give concrete sizes")
    key = key_dtype_of(shape.dtype)
    if key is not None:
        # The program takes the key data; the function gets the key back (see _flat_function).
        return jax.eval_shape(jax.random.key_data, shape), key
    try:
        dtype = np.dtype(shape.dtype)
        code_of_dtype(dtype)
    except TypeError as error:
        raise TypeError(f"{label}: {error}") from None
    # complex128 is the 64-bit complex type: two float64s in 16 bytes.
    wide = dtype.itemsize == (16 if dtype.kind == "c" else 8)
    if wide and dtype.kind in "iufc" and not jax.config.jax_enable_x64:
        raise TypeError(
            f"{label} is {dtype}, which JAX traces as 32-bit while jax_enable_x64 "
            "is off; turn it on (jax.config.update('jax_enable_x64', True)) or use a 32-bit dtype"
        )
    # The weak type matters: JAX promotes a weakly typed float32 with bfloat16 to bfloat16.
    return jax.ShapeDtypeStruct(shape.shape, dtype, weak_type=shape.weak_type), None


def function_name(function: Callable[..., Any]) -> str:
    """The name JAX gives a traced function (the program is called jit_<name>)."""
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__name__", None) or type(function).__name__


def _flat_function(
    function: Callable[..., Any],
    in_tree: Any,
    input_keys: tuple[KeyDtype | None, ...],
    results: list[tuple[Any, tuple[KeyDtype | None, ...]]],
) -> Callable[..., list[Any]]:
    """The function as JAX exports it: flat leaves in (key data for keys), flat leaves out.

    Tracing it appends (output tree, output key dtypes) to results.
    """

    def flat(*leaves: Any) -> list[Any]:
        leaves_in = [
            leaf if key is None else jax.random.wrap_key_data(leaf, dtype=key)
            for leaf, key in zip(leaves, input_keys, strict=True)
        ]
        args, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves_in)
        out_leaves, out_tree = jax.tree_util.tree_flatten(function(*args, **kwargs))
        output_keys = tuple(key_dtype_of(getattr(leaf, "dtype", None)) for leaf in out_leaves)
        results.append((out_tree, output_keys))
        return [
            leaf if key is None else jax.random.key_data(leaf)
            for leaf, key in zip(out_leaves, output_keys, strict=True)
        ]

    # The module's name (jit_<name>) names the program in reports and errors.
    flat.__name__ = flat.__qualname__ = function_name(function)
    return flat


_CALLBACKS = {
    "debug_print": "jax.debug.print",
    "debug_callback": "jax.debug.callback",
    "io_callback": "io_callback",
    "pure_callback": "jax.pure_callback",
}


def _callback_equations(jaxpr: Any) -> Iterator[Any]:
    """The equations of a jaxpr, and of the jaxprs nested in it, that call back into Python."""
    for equation in jaxpr.eqns:
        name = equation.primitive.name
        if name in _CALLBACKS or "callback" in name:
            yield equation
        for param in equation.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr holds its Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _callback_equations(inner)


def _where(equation: Any) -> str:
    try:  # private, and only for the message: leave the location out if it moved
        from jax._src import source_info_util

        return f" at {source_info_util.summarize(equation.source_info)}"
    except Exception:
        return ""


def _from_equinox(equation: Any) -> bool:
    """Whether a callback was made by equinox (its runtime checks, eqx.error_if and the like)."""
    module = sys.modules.get("equinox")
    if module is None or not getattr(module, "__file__", None):
        return False
    try:  # private, and only for the message: no hint if it moved
        from jax._src import source_info_util

        frame = source_info_util.user_frame(equation.source_info.traceback)
    except Exception:
        return False
    package = os.path.dirname(module.__file__) + os.sep
    return frame is not None and frame.file_name.startswith(package)


def _host_callback_error(found: list[Any]) -> ValueError:
    """The error for a function whose program calls back into Python, naming the callback."""
    first = found[0]
    what = _CALLBACKS.get(first.primitive.name, first.primitive.name) + _where(first)
    if len(found) > 1:
        what += f", and {len(found) - 1} more"
    hint = "Remove the callback, or return the value as an output instead"
    if any(_from_equinox(equation) for equation in found):
        # Equinox's checks are callbacks unless EQX_ON_ERROR, read when equinox is
        # imported, turns them into NaN outputs, which a standalone program can carry.
        hint = (
            "The callback is one of equinox's runtime checks (diffrax, lineax and optimistix "
            "make them too): set the environment variable EQX_ON_ERROR=nan before equinox is "
            "imported, so that a failed check gives NaN instead of calling back. " + hint
        )
    return ValueError(
        f"the function calls back into Python ({what}), which a standalone program cannot "
        "do: it runs in a worker process, or later from the disk cache, with no Python "
        f"caller to call. {hint}"
    )


class _Lowerings(threading.local):
    """The lowerings this thread is inside, innermost last (a traced function may lower)."""

    def __init__(self) -> None:
        self.custom_calls: list[set[str]] = []
        """Per lowering: the custom-call targets its program may call."""


_lowerings = _Lowerings()


def lowering_here() -> bool:
    """Whether this thread is tracing a function that lower_tree is lowering."""
    return bool(_lowerings.custom_calls)


def allow_custom_calls(targets: Sequence[str]) -> None:
    """Lets the program this thread is lowering call these custom-call targets too.

    A PoolFunction traced into the program of another lowering (as a nested
    jax.jit is) brings the targets it was made with.
    """
    if _lowerings.custom_calls:
        _lowerings.custom_calls[-1].update(targets)


def lower_tree(
    function: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    platform: str | None = None,
    custom_calls: Sequence[str] = (),
    label: Callable[[int, str], str] = lambda i, path: f"shapes[{i}]{path}",
    in_shardings: Any = None,
    out_shardings: Any = None,
) -> TreeProgram:
    """Lowers function(*args, **kwargs) for pytrees of shapes or arrays; see lower.

    label(argument index, key path) names an argument leaf in error messages
    (the index is -1 for a keyword argument, whose key path then starts with
    its name). in_shardings and out_shardings are as jax.jit takes them (a
    sharding, or a pytree prefix of ``(args, kwargs)`` and of the result), for
    a program over several devices (pool.lowering.sharding).
    """
    if not callable(function):
        raise TypeError(f"function must be callable, not {type(function).__name__}")
    if isinstance(custom_calls, str):
        raise TypeError("custom_calls must be a sequence of target names, not one str")
    tree_input = (tuple(args), dict(kwargs or {}))
    paths_and_leaves, in_tree = jax.tree_util.tree_flatten_with_path(tree_input)
    arguments, input_keys = _flat_arguments(paths_and_leaves, label)
    if platform is not None:
        leave_devices_to_workers(platform)
    platform = platform or lowering_platform([leaf for _, leaf in paths_and_leaves])

    results: list[tuple[Any, tuple[KeyDtype | None, ...]]] = []
    flat = _flat_function(function, in_tree, input_keys, results)
    jitted = jax.jit(flat, keep_unused=True)
    targets = set(custom_calls)
    _lowerings.custom_calls.append(targets)
    try:
        # Traced once: export reuses this trace. Callbacks are found in the program
        # itself, never guessed from an error's text (the function's own errors pass).
        jaxpr = jitted.trace(*arguments).jaxpr
        callbacks = list(_callback_equations(jaxpr.jaxpr))
        if callbacks:
            raise _host_callback_error(callbacks)
        boundary = boundary_shardings(
            jaxpr.jaxpr,
            _input_shardings(in_shardings, tree_input),
            flat_shardings(out_shardings, _out_shapes(results[-1][0], jaxpr), "out_shardings"),
            [getattr(leaf, "sharding", None) for _, leaf in paths_and_leaves],
        )
        if boundary is not None:
            # Over several devices: lowered again with every boundary sharding given
            # (pool.lowering.sharding), as jax.jit(f, in_shardings=..., out_shardings=...).
            results.clear()
            jitted = jax.jit(
                _flat_function(function, in_tree, input_keys, results),
                in_shardings=tuple(boundary[1]),
                out_shardings=list(boundary[2]),
                keep_unused=True,
            )
        exported = jax.export.export(
            jitted,
            platforms=[platform_named(platform).jax_names[0]],
            disabled_checks=[
                jax.export.DisabledSafetyCheck.custom_call(t) for t in sorted(targets)
            ],
        )(*arguments)
    finally:
        _lowerings.custom_calls.pop()
    program = _program(exported, boundary, platform)
    out_tree, output_keys = results[-1]
    float0 = tuple(i for i, a in enumerate(exported.out_avals) if a.dtype == jax.dtypes.float0)
    return TreeProgram(program, in_tree, input_keys, out_tree, output_keys, float0)


def _flat_arguments(
    paths_and_leaves: list[tuple[Any, Any]], label: Callable[[int, str], str]
) -> tuple[list[Any], tuple[KeyDtype | None, ...]]:
    """Each leaf of ``(args, kwargs)`` as the shape it is traced with, and the key dtype of
    those that are typed PRNG keys (None for an array)."""
    arguments, input_keys = [], []
    for path, leaf in paths_and_leaves:
        # path[0] is 0 (positional) or 1 (keyword); path[1] the index or name.
        index = path[1].idx if path[0].idx == 0 else -1
        rest = path[2:] if path[0].idx == 0 else path[1:]
        argument, key = _leaf_shape(label(index, jax.tree_util.keystr(rest)), leaf)
        arguments.append(argument)
        input_keys.append(key)
    return arguments, tuple(input_keys)


def _program(exported: Any, boundary: Any, platform: str) -> DigestedProgram:
    """The LoweredProgram of an export: its StableHLO for the platform's plugin, its types,
    its partitioning over several devices, and the options jax.jit compiles it with."""
    if exported.ordered_effects:
        raise ValueError(
            f"the function has ordered side effects ({exported.ordered_effects}), which a "
            "standalone program cannot carry; remove io_callback(ordered=True) and the like"
        )
    info = plugin_info(platform)
    target = None
    if info is not None:
        target = target_version(
            info["stablehlo_minimum_version"], info["stablehlo_current_version"]
        )
    rewrite = module_rewrite(active_workarounds(info))
    code, text, detailed = reserialize(
        exported.mlir_module_serialized, target, rewrite, detailed_logging
    )
    input_types = tuple(ArrayType.of(a.dtype, a.shape) for a in exported.in_avals)
    partitioning = None
    if boundary is not None:
        mesh, ins, outs = boundary
        partitioning = partitioning_of(
            mesh,
            [(s, a.shape) for s, a in zip(ins, exported.in_avals, strict=True)],
            [(s, a.shape) for s, a in zip(outs, exported.out_avals, strict=True)],
            platform,
            text,
        )
        _check_devices(partitioning, exported.nr_devices)
    return DigestedProgram(
        code=code,
        text=text,
        input_types=input_types,
        platform=platform,
        partitioning=partitioning,
        compile_options=jit_compile_options(
            bool(detailed), len(exported.in_avals), len(exported.out_avals), partitioning
        ),
    )


def _input_shardings(
    in_shardings: Any, tree_input: tuple[tuple[Any, ...], dict[str, Any]]
) -> list[Any]:
    """in_shardings per input leaf: a prefix of the positional arguments, as jax.jit takes it
    (keyword arguments get none)."""
    args, kwargs = tree_input
    keywords = len(jax.tree_util.tree_leaves(kwargs))
    return flat_shardings(in_shardings, args, "in_shardings") + [None] * keywords


def _out_shapes(out_tree: Any, jaxpr: Any) -> Any:
    """The traced result as a pytree of its avals (what out_shardings is a prefix of)."""
    return jax.tree_util.tree_unflatten(out_tree, list(jaxpr.out_avals))


def _check_devices(partitioning: Any, exported_devices: int) -> None:
    """Refuses a program whose mesh is not the devices JAX lowered it for."""
    if partitioning.devices != exported_devices:
        raise ValueError(
            f"the program was lowered for {exported_devices} devices but its shardings are over "
            f"{partitioning.describe()}: use one mesh for every sharding, as jax.jit requires"
        )


def lower(
    function: Callable[..., Any],
    shapes: Sequence[jax.ShapeDtypeStruct | jax.Array],
    platform: str | None = None,
    custom_calls: Sequence[str] = (),
    *,
    in_shardings: Any = None,
    out_shardings: Any = None,
) -> LoweredProgram:
    """Lowers a function to StableHLO for a platform, which by default follows JAX.

    shapes are the arguments as shapes, or as arrays; a Python scalar leaf
    (a float in a dict of parameters, say) is a weakly typed 0-d input, as
    jax.jit traces it, and is passed as the value at run time. Their placement and the
    default device of JAX choose the platform as lowering_platform describes,
    unless platform names one. The program records the platform, and
    compile_program loads the plugin for it.

    function is typed Callable[..., Any] because it may take and return any
    arrays that JAX traces. Unused arguments stay in the signature, since
    callers pass every input of a program. jax.export refuses custom calls that
    it knows no compatibility guarantees for, such as the targets of
    third-party libraries, so custom_calls names the targets that the function
    may call. The kernels of jnp.linalg need no entry.

    The function is traced with the current setting of jax.enable_x64, so
    64-bit arguments and values need that setting on, as they do in JAX.

    Each argument may be a pytree (dicts, tuples, lists, registered
    dataclasses, ...) of shapes or arrays: the program takes its leaves,
    flattened in JAX's order (jax.tree_util.tree_leaves of the arguments),
    and returns the leaves of the function's result the same way; None
    leaves are empty, as in JAX. A typed PRNG key (jax.random.key, or a
    ShapeDtypeStruct of a key dtype) is taken, and returned, as its key data
    (jax.random.key_data); inside the program it is a key of the same
    implementation again. Pool.function flattens and rebuilds the pytrees,
    keys included, itself.

    The bytecode is serialized at the newest StableHLO version that both this
    jaxlib and the platform's plugin read, so it loads on that plugin.

    For a plugin build known to miscompile some programs (worker.plugin.known_builds
    lists them by SHA-256), the program is changed so that it does not hit
    the bug, and so its text and cache key differ from the miscompiled form;
    for example, jnp.arctan on the default CPU plugin. Programs for other
    plugins are exactly as JAX writes them. PJRT_POOL_WORKAROUNDS=off turns
    the workarounds off.

    A function over several devices (SPMD) lowers to one program for all of
    them, which records its Partitioning (LoweredProgram.partitioning): a
    jax.jit with shardings over a Mesh, a shard_map, arguments placed on a
    mesh (jax.Array, or ShapeDtypeStruct(..., sharding=NamedSharding(...))),
    or in_shardings and out_shardings given here as jax.jit takes them (a
    pytree prefix of shapes, and of the result). The mesh may hold this
    process's devices, TPU devices of jax.experimental.topologies (no chip
    needed), or be a jax.sharding.AbstractMesh. Every input and output of the
    program gets a sharding: the one given, placed or said inside, else
    replicated (see pool.lowering.sharding); the program is the one
    jax.jit(function, in_shardings=..., out_shardings=...) compiles with
    those. It takes and returns global arrays, as jax.jit does.
    """
    if isinstance(shapes, (jax.ShapeDtypeStruct, np.ndarray, jax.Array)) or not isinstance(
        shapes, Sequence
    ):
        raise TypeError("shapes must be a sequence with one shape or array per argument")
    return lower_tree(
        function,
        shapes,
        platform=platform,
        custom_calls=custom_calls,
        in_shardings=in_shardings,
        out_shardings=out_shardings,
    ).program
