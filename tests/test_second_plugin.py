"""The Programs API on the second CPU plugin, xla-cpu-pjrt (PJRT API 0.81, StableHLO 1.13.3).

A process holds one plugin, so these tests run children with
PJRT_POOL_PLUGIN_CPU naming the second plugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import DEFAULT_PLUGIN, REPO, SECOND_PLUGIN, run_python

pytestmark = pytest.mark.skipif(SECOND_PLUGIN is None, reason="xla-cpu-pjrt is not installed")


@pytest.mark.slow
@pytest.mark.parametrize("plugin", ["second", "default"])
def test_programs_api_passes_on_the_second_plugin(tmp_path, plugin):
    """Runs all of tests/test_programs.py in a child whose cpu platform's runtime is a CPU
    plugin: xla-cpu-pjrt, and the default one, lammps-jax-pjrt-cpu (this process's is
    jaxlib's own client, on which the suite runs it too)."""
    if plugin == "default" and DEFAULT_PLUGIN is None:
        pytest.skip("lammps-jax-pjrt-cpu is not installed")
    environment = dict(os.environ)
    environment["PJRT_POOL_PLUGIN_CPU"] = SECOND_PLUGIN if plugin == "second" else DEFAULT_PLUGIN
    environment["PJRT_POOL_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/test_programs.py",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
        ],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    assert " passed" in done.stdout and " failed" not in done.stdout


def test_lower_serializes_new_ops_for_the_older_plugin():
    """lax.top_k lowers to an op newer than StableHLO 1.13.3; lower() must downgrade it.

    The child lowers before any plugin is loaded, so lower() learns the
    plugin's StableHLO window from a probe process. jax.export's own artifact
    is the control: the older plugin cannot parse it.
    """
    done = run_python(
        """
        import json
        import jax
        import numpy as np
        import pool, worker

        f = lambda x: jax.lax.top_k(x, 2)
        shape = jax.ShapeDtypeStruct((5,), np.float32)
        program = pool.lower(f, [shape])
        assert worker.loaded_runtime() is None  # lowering loaded no plugin here
        executable, _ = pool.compile_program(program)
        values, indices = executable.run([np.array([3, 1, 4, 1, 5], np.float32)])

        exported = jax.export.export(jax.jit(f), platforms=["cpu"])(shape)
        try:
            pool.Executable.compile(exported.mlir_module_serialized, pool.compile_options())
            control = "compiled"
        except pool.PjrtError as error:
            control = str(error)
        print(json.dumps({
            "window": worker.get_runtime().stablehlo_window,
            "api": worker.get_runtime().api_version,
            "values": values.tolist(),
            "indices": indices.tolist(),
            "control": control,
        }))
        """,
        env={"PJRT_POOL_PLUGIN_CPU": SECOND_PLUGIN},
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["api"] == "0.81" and result["window"][1] == "1.13.3"
    assert result["values"] == [5.0, 4.0] and result["indices"] == [4, 2]
    assert "Failed to parse using StableHLO v1.13.3" in result["control"]
