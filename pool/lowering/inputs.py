"""save_inputs: a program's inputs from its function's arguments, in a file for pjrt-pool run.

A program that lower() makes of a function takes the leaves of the
function's arguments, flattened in JAX's order, each as the type JAX traces
it with (lower_tree). ``pjrt-pool run MANIFEST NAME --inputs FILE`` reads
those leaves from an .npz file as arr_0, arr_1, ... (pool.cli.run_files).
save_inputs writes that file from the arguments a user would call the
function with, so that nobody flattens a pytree, unwraps a PRNG key or
narrows a float64 by hand.

numpy's .npz format cannot name ml_dtypes' types (bfloat16, the float8
types): such a leaf is written as raw bytes (a void dtype of its item size),
which run --inputs takes as the program's type of that size.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from pool.lowering.lower import key_dtype_of
from worker.dtypes import code_of_dtype

_PYTHON_SCALARS = (bool, int, float, complex)


def _leaf_array(label: str, leaf: Any) -> np.ndarray:
    """One argument leaf as the array the program takes (a key as its key data)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        raise TypeError(
            f"{label} is a jax.ShapeDtypeStruct: save_inputs takes the values to run the "
            "program on, not their shapes"
        )
    if isinstance(leaf, jax.core.Tracer):
        raise TypeError(f"{label} is a JAX tracer: call save_inputs on concrete values")
    if type(leaf) in _PYTHON_SCALARS:
        try:
            aval = jax.typeof(leaf)  # weakly typed, as jax.jit traces it
        except OverflowError as error:
            raise TypeError(f"{label}: {error}") from None
        return np.asarray(leaf, aval.dtype)
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
        raise TypeError(
            f"{label} is {type(leaf).__name__}, which is not an array: a program takes "
            "arrays only (leave out the static arguments of a Pool.function)"
        )
    if key_dtype_of(leaf.dtype) is not None:
        return np.asarray(jax.random.key_data(leaf))
    # As jax.jit converts it: float64 is float32 while jax_enable_x64 is off.
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(leaf.dtype))
    try:
        code_of_dtype(dtype)
    except TypeError as error:
        raise TypeError(f"{label}: {error}") from None
    return np.asarray(leaf, dtype)


def _label(path: Any) -> str:
    """Names a leaf of (args, kwargs) as an argument: "argument 0['w']", "keyword argument 'x'"."""
    if path[0].idx == 0:
        return f"argument {path[1].idx}{jax.tree_util.keystr(path[2:])}"
    return f"keyword argument {jax.tree_util.keystr(path[1:])}"


def save_inputs(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> list[np.ndarray]:
    """Saves the inputs of a program for a call with these arguments, for pjrt-pool run.

    args and kwargs are what the function would be called with: pytrees of
    numpy arrays, JAX arrays, Python scalars and typed PRNG keys. The file,
    written at path as it is named, is the .npz that ``pjrt-pool run
    MANIFEST NAME --inputs path`` reads: the leaves flattened in JAX's order
    (jax.tree_util.tree_leaves of the arguments) as arr_0, arr_1, ...,
    which are the inputs of the program that lower or a warm spec makes of
    the function with arguments of these shapes.

    Each leaf is saved as the type JAX traces it with, as jax.jit converts
    it: a typed key as its key data, a Python scalar as a 0-d array of its
    weak type's dtype, and a 64-bit array as 32-bit while jax_enable_x64 is
    off. A leaf of one of ml_dtypes' types (bfloat16, the float8 types),
    which .npz files cannot name, is saved as raw bytes, which run takes as
    the program's type. Static arguments of a Pool.function are not inputs:
    leave them out.

    Returns the arrays saved, in order, which are also the arguments that
    Executable.run and Manifest.run take. Raises TypeError for a leaf that
    is not an array, naming it.
    """
    leaves = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
    arrays = [_leaf_array(_label(where), leaf) for where, leaf in leaves]
    saved = [a.view(f"V{a.dtype.itemsize}") if a.dtype.isbuiltin != 1 else a for a in arrays]
    with open(path, "wb") as file:  # np.savez given a name would append .npz to it
        np.savez(file, *saved)
    return arrays
