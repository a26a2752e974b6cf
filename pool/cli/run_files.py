"""The run command's files: a run's inputs read from .npz or .npy files, its outputs described.

``pjrt-pool run`` (pool.cli.warm) and its cluster batches (pool.cli.cluster_run)
read and report through these, so a batch reads and reports as a single run does.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pool.cli.main import UsageError
from pool.cli.paths import input_file
from worker.compile.arguments import prepare_arguments


def read_inputs(path: str, spec: Any, option: str) -> list[np.ndarray]:
    """A program's inputs from an .npz file (arr_0, arr_1, ...) or an .npy file (its one
    input), checked against its types; UsageError says what is wrong."""
    types = ", ".join(map(str, spec.input_types or ()))
    input_file(path, option)
    try:
        data = np.load(path)
    except (OSError, ValueError) as error:
        raise UsageError(
            f"{option} {path}: cannot read it as an .npz or .npy file ({error})"
        ) from None
    if isinstance(data, np.ndarray):
        inputs = [data]  # an .npy file: one input
    else:
        with data:
            names = [f"arr_{i}" for i in range(len(data.files))]
            if sorted(data.files) != sorted(names):
                raise UsageError(
                    f"{option} {path} holds {', '.join(data.files)}; save the inputs in "
                    f"order as arr_0, arr_1, ... (np.savez(file, *arrays)): {types}"
                )
            inputs = [data[name] for name in names]
    if spec.input_types is not None:
        inputs = _narrow_types(inputs, spec.input_types)
        try:
            prepare_arguments(inputs, spec.input_types)
        except (TypeError, ValueError) as error:
            raise UsageError(f"{option} {path}: {error}; {spec.name} takes {types}") from None
    return inputs


def _narrow_types(inputs: list[np.ndarray], types: Any) -> list[np.ndarray]:
    """The inputs, each array of raw bytes (a void dtype) taken as its input's type of that size.

    An .npz or .npy file cannot name ml_dtypes' types: numpy saves a bfloat16
    array as raw bytes (V2), and pool.save_inputs saves every such type so.
    """
    return [
        array.view(kind.dtype)
        if array.dtype.kind == "V"
        and array.dtype.names is None
        and kind.dtype.isbuiltin != 1
        and kind.dtype.itemsize == array.dtype.itemsize
        else array
        for array, kind in zip(inputs, types, strict=False)
    ] + inputs[len(types) :]


def finite_sums(result: dict[str, Any]) -> dict[str, Any]:
    """A result (of a run: its "outputs" described) with each sum that is NaN or infinite
    as None: JSON has no NaN (null)."""
    outputs = [
        {
            **output,
            "sum": output["sum"] if output["sum"] is None or math.isfinite(output["sum"]) else None,
        }
        for output in result["outputs"]
    ]
    return {**result, "outputs": outputs}


def describe(outputs: list[np.ndarray]) -> list[dict[str, Any]]:
    """Each output's dtype, shape and (for numbers) sum, as run prints and reports them."""
    return [
        {
            "dtype": str(o.dtype),
            "shape": list(o.shape),
            "sum": float(np.asarray(o, dtype=np.float64).sum()) if o.dtype.kind in "biuf" else None,
        }
        for o in outputs
    ]
