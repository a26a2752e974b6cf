"""What the plugin reads from the environment is in the cache key: XLA_FLAGS and thread counts.

Two real processes with different XLA_FLAGS, on both CPU plugins: under
``--xla_cpu_enable_fast_math=true --xla_cpu_fast_math_honor_nans=false``
XLA folds isnan to false, so the program below returns [0 0 0 0] where
[11 0 11 0] is right; an entry compiled so must never be loaded without them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from cache_helpers import compile_in_child, cpu_plugin_params, save_program

import pool
import worker
from worker.cache import explain_key
from worker.identity.environment import codegen_environment, normalized_xla_flags, parse_xla_flags

FAST_MATH = "--xla_cpu_enable_fast_math=true --xla_cpu_fast_math_honor_nans=false"
NAN = float("nan")
X = [NAN, 1.0, NAN, 2.0]
RIGHT = [11, 0, 11, 0]
FAST = [0, 0, 0, 0]
PLUGINS = cpu_plugin_params()


@functools.cache
def isnan_program() -> pool.LoweredProgram:
    worker.get_runtime("cpu")
    return pool.lower(
        lambda x: jnp.where(jnp.isnan(x), 11, 0), [jax.ShapeDtypeStruct((4,), jnp.float32)]
    )


def run(program: str, plugin: str | None, xla_flags: str, **env: str) -> dict:
    environment = {"XLA_FLAGS": xla_flags, **env}
    if plugin:
        environment["PJRT_POOL_PLUGIN_CPU"] = plugin
    return compile_in_child({"programs": [program], "inputs": [X]}, environment)


@pytest.mark.parametrize("plugin", PLUGINS)
def test_an_entry_compiled_under_other_xla_flags_is_not_loaded(tmp_path, plugin):
    # Without the compile options lower() records (jax.jit's, whose debug options JAX read
    # from XLA_FLAGS where it lowered, and which a plugin takes over its own flags): the
    # compiling process's XLA_FLAGS decide the code, as for a program made by other tools.
    bare = isnan_program()._replace(compile_options=None)
    program = str(save_program(bare, tmp_path / "isnan.json"))

    fast = run(program, plugin, FAST_MATH)
    assert fast["stats"][0]["compiled"] == 1 and fast["outputs"] == [[FAST]]

    plain = run(program, plugin, "")
    assert plain["stats"][0]["compiled"] == 1, "loaded the fast-math executable"
    assert plain["outputs"] == [[RIGHT]]
    assert plain["keys"] != fast["keys"]

    # The same flags in another order, with dump flags added: the same code, the same key.
    reordered = (
        "--xla_cpu_fast_math_honor_nans=false --xla_dump_to=/tmp/nowhere "
        "--xla_cpu_enable_fast_math=false --xla_cpu_enable_fast_math=true"
    )
    again = run(program, plugin, reordered)
    assert again["keys"] == fast["keys"]
    assert again["stats"][0]["loaded"] == 1 and again["outputs"] == [[FAST]]


def test_thread_count_variables_are_in_the_key(tmp_path):
    program = str(save_program(isnan_program(), tmp_path / "isnan.json"))
    default = run(program, None, "", PJRT_NPROC="", NPROC="")
    threads = run(program, None, "", PJRT_NPROC="8", NPROC="")
    assert threads["keys"] != default["keys"] and threads["stats"][0]["compiled"] == 1


def test_explain_key_shows_the_flags_and_client_options(cache_dir, monkeypatch):
    runtime = worker.get_runtime("cpu")
    _, parts = worker.program_key(isnan_program(), runtime, None)
    assert parts["client_options"] == runtime.client_options == {}
    text = explain_key(parts, {**parts, "environment": {"xla_flags": ["xla_foo=1"]}})
    flags = runtime.codegen_environment["xla_flags"]
    assert f"environment.xla_flags = {flags!r}   <- differs: ['xla_foo=1']" in text

    # The plugin read XLA_FLAGS when it loaded; changing it later changes nothing,
    # so neither does it change the key.
    monkeypatch.setenv("XLA_FLAGS", FAST_MATH)
    assert worker.program_key(isnan_program(), runtime, None)[1] == parts


def test_flags_parse_as_xla_parses_them(tmp_path):
    assert parse_xla_flags('  --a=1 --b\t--c="x y\\"z" --d=\'q w\' -e=3 --a=2 stop --f') == {
        "a": "2",
        "b": "true",
        "c": 'x y"z',
        "d": "q w",
        "e": "3",
    }
    assert normalized_xla_flags(
        "--xla_dump_to=/d --xla_gpu_dump_llvmir --xla_gpu_per_fusion_autotune_cache_dir=/c "
        "--xla_log_anything=1 --xla_enable_dumping --xla_cpu_enable_fast_math=true --xla_b=2"
    ) == ["xla_b=2", "xla_cpu_enable_fast_math=true"]
    assert normalized_xla_flags("") == normalized_xla_flags(None) == []

    flag_file = tmp_path / "flags"  # XLA reads a value that does not start with "-" as a file
    flag_file.write_text("--xla_cpu_enable_fast_math=true\n")
    assert normalized_xla_flags(str(flag_file)) == ["xla_cpu_enable_fast_math=true"]
    assert "unreadable" in normalized_xla_flags(str(tmp_path / "missing"))[0]

    found = codegen_environment({"XLA_FLAGS": FAST_MATH, "NPROC": "4", "OTHER": "x"})
    assert found == {
        "xla_flags": ["xla_cpu_enable_fast_math=true", "xla_cpu_fast_math_honor_nans=false"],
        "NPROC": "4",
    }
