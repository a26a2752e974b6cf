"""Results equal JAX's where a plugin's defaults differ: max and min propagate NaN.

Both CPU plugins default to XLA's fast min/max, which returns x for
max(x, NaN) where JAX returns NaN; worker.plugin.xla_flags turns it off while the
plugin loads. jaxlib's own client (the cpu platform's runtime) computes as JAX
does with no flag added. Each case runs in a fresh process, since a plugin reads
its flags once, when it loads.
"""

from __future__ import annotations

import json

import pytest
from conftest import DEFAULT_PLUGIN, SECOND_PLUGIN, run_python

PLUGINS = [
    "jaxlib",
    pytest.param(
        "default",
        marks=pytest.mark.skipif(DEFAULT_PLUGIN is None, reason="lammps-jax-pjrt-cpu is needed"),
    ),
    pytest.param(
        "second",
        marks=pytest.mark.skipif(SECOND_PLUGIN is None, reason="xla-cpu-pjrt is not installed"),
    ),
]
"""The cpu platform's runtimes: its own (jaxlib's client), and each CPU plugin named."""

SCRIPT = """
    import json, os
    import numpy as np, jax, jax.numpy as jnp
    from pool import Pool, compile_program, lower
    from worker import loaded_runtime

    before = os.environ.get("XLA_FLAGS")

    def function(a, b):
        return jnp.maximum(a, b), jnp.minimum(a, b), jnp.max(a), jnp.hypot(a, b)

    program = lower(function, [jax.ShapeDtypeStruct((4,), jnp.float32)] * 2)
    a = np.array([1.0, np.nan, 3.0, 4.0], np.float32)
    b = np.array([np.nan, 2.0, 1.0, 5.0], np.float32)
    executable, _ = compile_program(program)
    ours = [o.tolist() for o in executable.run([a, b])]
    with Pool(workers=1) as pool:
        pooled = [o.tolist() for o in pool.run(program, [a, b])]
    reference = [np.asarray(o).tolist() for o in jax.jit(function)(a, b)]
    print(json.dumps({
        "ours": ours, "pooled": pooled, "jax": reference,
        "environment_unchanged": os.environ.get("XLA_FLAGS") == before,
        "key_flags": loaded_runtime().codegen_environment["xla_flags"],
    }, default=str))
"""


def run(plugin: str, xla_flags: str | None = None) -> dict:
    named = {"default": DEFAULT_PLUGIN, "second": SECOND_PLUGIN}.get(plugin)
    env = {"PJRT_POOL_PLUGIN_CPU": named or ""}
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    done = run_python(SCRIPT, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def same(first: list, second: list) -> bool:
    return json.dumps(first) == json.dumps(second)  # NaN spelled the same way on both sides


@pytest.mark.parametrize("plugin", PLUGINS)
def test_max_and_min_propagate_nan_as_in_jax(plugin: str) -> None:
    found = run(plugin)
    assert same(found["ours"], found["jax"]), found
    assert same(found["pooled"], found["jax"]), found
    assert found["ours"][0][0] != found["ours"][0][0]  # max(1, NaN) is NaN
    assert found["environment_unchanged"]
    if plugin == "jaxlib":
        assert found["key_flags"] == []  # nothing added: jaxlib's XLA is JAX's
    else:
        assert "xla_cpu_enable_fast_min_max=false" in found["key_flags"]


@pytest.mark.parametrize("plugin", PLUGINS[:2])
def test_a_user_s_own_flags_reach_the_program_as_they_reach_jax_jit(plugin: str) -> None:
    # A program compiles with the options jax.jit compiles it with (pool.lowering.options),
    # whose debug options this process's jaxlib made from XLA_FLAGS: the results are
    # jax.jit's under the same flags, whatever this jaxlib's XLA makes of the flag.
    found = run(plugin, "--xla_cpu_enable_fast_min_max=true")
    assert same(found["ours"], found["jax"]), found
    assert same(found["pooled"], found["jax"]), found
    assert found["key_flags"] == ["xla_cpu_enable_fast_min_max=true"]
    assert found["environment_unchanged"]
