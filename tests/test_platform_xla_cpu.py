"""The xla_cpu platform: the second CPU plugin build by its own name (platforms/xla_cpu.py).

Pool(platform="xla_cpu") loads xla-cpu-pjrt beside a pool of the pjrt_cpu
platform's plugin (lammps-jax-pjrt-cpu), with the CPU's facts (JAX's "cpu" to
lower for, its flags, the host in its keys) and keys of its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_PLUGIN, SECOND_PLUGIN

from pool import Pool
from worker.cache import open_cache
from worker.plugin.locate import find_plugin

pytestmark = pytest.mark.skipif(SECOND_PLUGIN is None, reason="xla-cpu-pjrt is not installed")


def test_xla_cpu_finds_the_second_plugin_whichever_cpu_finds():
    location = find_plugin("xla_cpu")
    assert (location.path, location.source) == (SECOND_PLUGIN, "package xla-cpu-pjrt")
    if DEFAULT_PLUGIN is not None:
        assert find_plugin("pjrt_cpu").path == DEFAULT_PLUGIN


def test_a_pool_of_xla_cpu_beside_a_pool_of_cpu(tmp_path):
    """Both plugins in one parent, one cache: each runs what JAX computes (NaN propagates
    through max: the CPU's flag is in force on both), and their keys differ."""

    def function(a, b):
        return jnp.maximum(a, b), jax.lax.top_k(a, 2)[0]

    a = np.array([1.0, np.nan, 3.0, 4.0], np.float32)
    b = np.array([np.nan, 2.0, 1.0, 5.0], np.float32)
    expected = [np.asarray(out) for out in jax.jit(function)(a, b)]
    with (
        Pool(1, platform="xla_cpu", cache_dir=tmp_path) as second,
        Pool(1, platform="pjrt_cpu", cache_dir=tmp_path) as default,
    ):
        for pool in (second, default):
            outputs = pool.function(function)(a, b)
            for output, want in zip(outputs, expected, strict=True):
                np.testing.assert_array_equal(np.asarray(output), want)
        plugin = second.worker_info[0]["plugin"]
        assert (second.platform, default.platform) == ("xla_cpu", "pjrt_cpu")
        assert plugin["path"] == SECOND_PLUGIN and plugin["api_version"] == "0.81"
        program = second.function(function).lower(a, b)
        assert program.platform == "xla_cpu"
        specs = {
            "xla_cpu": second.compile(program),
            "pjrt_cpu": default.compile(default.function(function).lower(a, b)),
        }
    assert specs["xla_cpu"].key != specs["pjrt_cpu"].key
    parts = open_cache(tmp_path).read_header(specs["xla_cpu"].key).fields["parts"]
    assert parts["platform"] == "xla_cpu" and "cpu_features" in parts["host"]
    # The CPU's flag, added as the plugin loaded, and so in its key.
    assert parts["environment"]["xla_flags"] == ["xla_cpu_enable_fast_min_max=false"]
