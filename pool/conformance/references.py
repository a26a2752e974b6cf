"""``python -m pool.conformance.references PLATFORM OUT.npz NAME...``: jax.jit's answers in a
process of their own.

For a platform whose device one process at a time may hold (TPU), check-plugin
cannot run JAX's side of a case beside the plugin's: its workers hold the chip
while they run the cases, and JAX in the checking process would take it from
them (pool.lowering.devices). So the plugin's side runs first, and then this
module, in a fresh process whose JAX opens the chip the workers let go, runs
each case's function with jax.jit on the same seeded inputs (Case.make_inputs
is a pure function of the case) and writes its outputs: ``OUT.npz`` holds
output j of the i-th case named as ``i/j``, and ``OUT.json`` the cases whose
jax.jit failed, with why.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pool.conformance.case import Case
from pool.errors import describe_exit
from pool.spawn import child_environment, python_command
from worker.plugin.platforms.registry import platform_named

REFERENCE_TIMEOUT = 1800.0
"""Seconds the reference process may take for the whole battery (each case compiles once)."""


def references_elsewhere(
    platform: str, names: Sequence[str], directory: Path
) -> list[list[np.ndarray] | str]:
    """jax.jit's outputs of the named cases on the platform's JAX device, computed in a child
    process; per case its outputs, or the text of why jax.jit failed on it."""
    out = directory / "references.npz"
    try:
        done = subprocess.run(
            python_command("pool.conformance.references", platform, str(out), *names),
            env=child_environment(),
            capture_output=True,
            text=True,
            timeout=REFERENCE_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        message = f"jax.jit's side of the check took over {REFERENCE_TIMEOUT:.0f} s"
        return [message] * len(names)
    if done.returncode != 0:
        message = (
            f"the process that runs jax.jit's side {describe_exit(done.returncode)}: "
            + (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        )
        return [message] * len(names)
    failed = json.loads(out.with_suffix(".json").read_text())
    with np.load(out) as stored:
        found: list[list[np.ndarray] | str] = []
        for index in range(len(names)):
            if str(index) in failed:
                found.append(failed[str(index)])
                continue
            outputs = []
            while f"{index}/{len(outputs)}" in stored:
                outputs.append(stored[f"{index}/{len(outputs)}"])
            found.append(outputs)
    return found


def reference(case: Case, inputs: Sequence[np.ndarray], device: Any) -> list[np.ndarray]:
    """jax.jit's outputs of a case's function on a device."""
    placed = [jax.device_put(a, device) for a in inputs]
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.jit(case.function)(*placed))]


def reference_device(platform: str) -> Any:
    """JAX's own device for the platform if it has one (by any of its JAX names), else its
    CPU."""
    for name in platform_named(platform).jax_names:
        with contextlib.suppress(RuntimeError):
            return jax.devices(name)[0]
    return jax.devices("cpu")[0]


def main(argv: list[str]) -> int:
    """Runs jax.jit of each named case on JAX's device for the platform (see the module)."""
    from pool.conformance.battery import battery

    platform, out, names = argv[0], Path(argv[1]), argv[2:]
    cases = {case.name: case for case in battery()}
    device = reference_device(platform)
    arrays: dict[str, np.ndarray] = {}
    failed: dict[str, str] = {}
    for index, name in enumerate(names):
        case = cases[name]
        try:
            with jax.enable_x64(case.x64):
                outputs = reference(case, case.make_inputs(), device)
        except Exception as error:  # that case's failure, said in the report
            failed[str(index)] = f"{type(error).__name__}: {str(error).splitlines()[0][:500]}"
            continue
        for position, output in enumerate(outputs):
            arrays[f"{index}/{position}"] = output
    np.savez(out, **arrays)
    out.with_suffix(".json").write_text(json.dumps(failed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
