"""lower: a JAX function to a LoweredProgram that a PJRT plugin compiles."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pool.plugin_info import plugin_info
from pool.stablehlo import reserialize, target_version
from worker.dtypes import code_of_dtype
from worker.records import ArrayType, LoweredProgram


def _jax_platform(device: Any) -> str:
    """The jax.export platform name of a device ("cpu", "cuda", "rocm", "tpu")."""
    platform = device.platform
    if platform == "gpu":
        version = getattr(device.client, "platform_version", "").lower()
        return "rocm" if "rocm" in version else "cuda"
    return platform


def lowering_platform(shapes: Sequence[Any]) -> str:
    """Returns the platform that arguments lower for when no platform is named.

    Arrays (and ShapeDtypeStructs with a sharding) committed to devices choose
    their devices' platform; otherwise JAX's default device decides
    (``jax.config.jax_default_device``, else the default backend). Arguments
    on devices of different platforms are refused with ValueError.
    """
    platforms = set()
    for shape in shapes:
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
        return "cuda" if default == "gpu" else default
    if default is not None:
        return _jax_platform(default)
    return _jax_platform(jax.devices()[0])


def _as_shape(index: int, value: Any) -> jax.ShapeDtypeStruct:
    if isinstance(value, jax.ShapeDtypeStruct):
        shape = value
    elif hasattr(value, "shape") and hasattr(value, "dtype"):
        shape = jax.ShapeDtypeStruct(value.shape, value.dtype)
    else:
        kind = type(value).__name__
        raise TypeError(f"shapes[{index}] must be a jax.ShapeDtypeStruct or an array, not {kind}")
    dtype = np.dtype(shape.dtype)
    try:
        code_of_dtype(dtype)
    except TypeError as error:
        raise TypeError(f"shapes[{index}]: {error}") from None
    # complex128 is the 64-bit complex type: two float64s in 16 bytes.
    wide = dtype.itemsize == (16 if dtype.kind == "c" else 8)
    if wide and dtype.kind in "iufc" and not jax.config.jax_enable_x64:
        raise TypeError(
            f"shapes[{index}] is {dtype}, which JAX traces as 32-bit while jax_enable_x64 "
            "is off; turn it on (jax.config.update('jax_enable_x64', True)) or use a 32-bit dtype"
        )
    if any(not isinstance(n, int) for n in shape.shape):
        raise TypeError(f"shapes[{index}] has a symbolic shape {shape.shape}; give concrete sizes")
    return jax.ShapeDtypeStruct(shape.shape, dtype)


def lower(
    function: Callable[..., Any],
    shapes: Sequence[jax.ShapeDtypeStruct | jax.Array],
    platform: str | None = None,
    custom_calls: Sequence[str] = (),
) -> LoweredProgram:
    """Lowers a function to StableHLO for a platform, which by default follows JAX.

    shapes are the arguments as shapes, or as arrays. Their placement and the
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

    The bytecode is serialized at the newest StableHLO version that both this
    jaxlib and the platform's plugin read, so it loads on that plugin.
    """
    if not callable(function):
        raise TypeError(f"function must be callable, not {type(function).__name__}")
    if isinstance(shapes, (jax.ShapeDtypeStruct, np.ndarray, jax.Array)) or not isinstance(
        shapes, Sequence
    ):
        raise TypeError("shapes must be a sequence with one shape or array per argument")
    if isinstance(custom_calls, str):
        raise TypeError("custom_calls must be a sequence of target names, not one str")
    arguments = [_as_shape(i, s) for i, s in enumerate(shapes)]
    platform = platform or lowering_platform(shapes)

    exported = jax.export.export(
        jax.jit(function, keep_unused=True),
        platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t) for t in custom_calls],
    )(*arguments)
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
    code, text = reserialize(exported.mlir_module_serialized, target)
    input_types = tuple(ArrayType.of(a.dtype, a.shape) for a in exported.in_avals)
    return LoweredProgram(code=code, text=text, input_types=input_types, platform=platform)
