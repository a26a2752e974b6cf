"""The cpu platform's runtime: the installed jaxlib's own CPU client (worker.plugin.jaxlib_cpu).

What it is (its identity, its devices, its options), and that every path a
user reaches works on it: compiling, the disk cache (its entries apart from a
plugin's), loading, running with inputs read where they lie and outputs
written where the parent says, values kept in a worker, programs over several
devices, a crash of the runtime isolated in its worker; and that a worker on
it imports jaxlib but never jax.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from conftest import DEFAULT_PLUGIN, JAX_CPU_DEVICES, run_python

from pool import Pool, WorkerCrashedError, compile_program, lower
from worker import get_runtime
from worker.cache import open_cache
from worker.errors import TopologyError
from worker.identity.options import compile_options, debug_options_of
from worker.plugin.jaxlib_cpu.client import jax_devices
from worker.plugin.locate import RuntimeKind


def test_the_runtime_is_jaxlibs_named_by_its_record():
    runtime = get_runtime("cpu")
    assert runtime.kind is RuntimeKind.JAXLIB and not runtime.runs_natively
    record = Path(runtime.location.path)
    assert record.name == "RECORD"
    assert record.parent.name == f"jaxlib-{jaxlib.__version__}.dist-info"
    assert runtime.plugin_sha256() == hashlib.sha256(record.read_bytes()).hexdigest()
    assert runtime.api_version == f"jaxlib {jaxlib.__version__}"
    described = runtime.describe()
    assert described["runtime"] == "jaxlib" and described["platform_version"] == runtime.api_version
    from jaxlib.mlir.dialects import stablehlo

    assert described["stablehlo_current_version"] == str(stablehlo.get_current_version())
    with pytest.raises(TopologyError, match="compiles for its own devices"):
        runtime.topology(None)  # type: ignore[arg-type]


def test_its_client_has_jaxs_devices():
    # This process's JAX has JAX_CPU_DEVICES (conftest.py), which jaxlib's client follows.
    assert jax_devices() == len(jax.devices("cpu")) == JAX_CPU_DEVICES
    assert get_runtime("cpu").client.num_devices == JAX_CPU_DEVICES


def test_a_fresh_process_follows_jaxs_variable_and_flag():
    code = """
        import json
        from worker import get_runtime
        print(json.dumps(get_runtime("cpu").client.num_devices))
    """
    for env, count in (
        ({}, 1),
        ({"JAX_NUM_CPU_DEVICES": "3"}, 3),
        ({"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, 2),
    ):
        done = run_python(code, env={"JAX_NUM_CPU_DEVICES": "", "XLA_FLAGS": "", **env})
        assert json.loads(done.stdout.strip().splitlines()[-1]) == count, env


def test_options_without_debug_options_compute_as_jaxs():
    # compile_options()'s six bytes carry no debug options: XLA would compile with all of
    # them at zero (max ignoring NaN); jaxlib's defaults go under them, as under JAX's.
    assert debug_options_of(compile_options()) is None
    x = np.array([1.0, np.nan, 3.0], np.float32)
    program = lower(lambda x: (jnp.max(x), jnp.minimum(x, 2.0)), [x])
    executable, _ = compile_program(program, compile_options=compile_options())
    got = executable.run([x])
    for out, want in zip(got, jax.jit(lambda x: (jnp.max(x), jnp.minimum(x, 2.0)))(x), strict=True):
        assert out.tobytes() == np.asarray(want).tobytes()


def test_its_entries_are_apart_from_a_plugins(tmp_path):
    """One program, one cache: jaxlib's client and the CPU plugin write two entries, each
    naming its runtime, and each runs where it was built."""
    program = lower(lambda x: jnp.sin(x) * 2, [np.zeros(8, np.float32)])
    executable, statistics = compile_program(program, cache_dir=tmp_path)
    assert statistics.compiled == 1 and executable.key is not None
    parts = open_cache(tmp_path).read_header(executable.key).fields["parts"]
    assert parts["plugin"]["api_version"] == f"jaxlib {jaxlib.__version__}"
    assert parts["platform"] == "cpu" and "cpu_features" in parts["host"]
    again, statistics = compile_program(program, cache_dir=tmp_path)
    assert statistics.loaded == 1 and not again.runs_natively
    x = np.linspace(0, 1, 8, dtype=np.float32)
    np.testing.assert_array_equal(again.run([x])[0], executable.run([x])[0])
    if DEFAULT_PLUGIN is None:
        return
    with Pool(1, platform="pjrt_cpu", cache_dir=tmp_path) as pool:
        spec = pool.compile(pool.function(lambda x: jnp.sin(x) * 2).lower(x))
        got = pool.submit_spec(spec, [x]).result()[0]
        np.testing.assert_allclose(got, np.sin(x) * 2, rtol=1e-6)
    assert spec.key != executable.key
    assert len(open_cache(tmp_path).list_entries()) == 2


def test_a_pool_serves_every_kind_of_run(tmp_path):
    """Hot runs (the arena's), runs whose inputs are kept values or whose outputs are kept,
    puts and fetches, outputs laid out in a segment of their own, and inputs of other types
    than the program's: all served from Python, each as jax.jit computes it."""
    step = jax.jit(lambda w, x: (w - 0.1 * (w @ x), (w * x).sum()))
    w = np.arange(16, dtype=np.float32).reshape(4, 4) / 16
    x = np.eye(4, dtype=np.float32)
    with Pool(1, cache_dir=tmp_path) as pool:
        run = pool.function(step)
        for _ in range(3):  # the first a Run, then hot runs of its slot
            got = run(w, x)
            for out, want in zip(got, step(w, x), strict=True):
                assert np.asarray(out).tobytes() == np.asarray(want).tobytes()
        kept = pool.function(step, keep=(0,))
        value, expected = pool.put(w), w
        for _ in range(3):
            value, total = kept(value, x)
            expected, want_total = step(expected, x)
            assert np.asarray(total).tobytes() == np.asarray(want_total).tobytes()
        assert value.fetch().tobytes() == np.asarray(expected).tobytes()
        big = np.ones((1024, 1024), np.float32)  # 4 MiB out: past the arena's share
        (doubled,) = pool.run(lower(lambda a: a * 2, [big]), [big])
        np.testing.assert_array_equal(doubled, big * 2)
        spec = pool.compile(lower(lambda a: a + 1, [np.zeros(3, np.float32)]))
        (added,) = pool.submit_spec(spec, [np.arange(3, dtype=np.float64)]).result()  # to f32
        np.testing.assert_array_equal(added, [1, 2, 3])


def test_a_worker_imports_jaxlib_but_never_jax(tmp_path):
    # An initializer made here, not imported (cloudpickle sends it by value): at exit the
    # worker writes which of jax and jaxlib it imported.
    namespace: dict = {"__name__": "made_for_the_worker"}
    exec(
        "def record(path):\n"
        "    import atexit, json, sys\n"
        "    def write():\n"
        "        names = sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib'})\n"
        "        open(path, 'w').write(json.dumps(names))\n"
        "    atexit.register(write)\n",
        namespace,
    )
    written = tmp_path / "modules.json"
    record = namespace["record"]
    with Pool(1, cache_dir=tmp_path, initializer=record, initargs=(str(written),)) as pool:
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        (out,) = pool.run(lower(lambda a: jnp.linalg.norm(a, axis=1), [a]), [a])
        np.testing.assert_allclose(out, np.linalg.norm(a, axis=1), rtol=1e-6)
    assert json.loads(written.read_text()) == ["jaxlib"]


def test_an_empty_compile_options_proto_aborts_jaxlibs_client_in_its_worker_only():
    # The README's crash example: jaxlib's XLA aborts on it as a plugin's does.
    x = np.linspace(0, 1, 16, dtype=np.float32)
    program = lower(lambda x: jnp.sin(x) * 2, [x])
    with Pool(1, task_timeout=120) as pool:
        with pytest.raises(WorkerCrashedError, match="SIGABRT"):
            pool.run(program, [x], compile_options=b"")
        (out,) = pool.run(program, [x])
    np.testing.assert_array_equal(out, np.asarray(jax.jit(lambda x: jnp.sin(x) * 2)(x)))


def test_its_serialized_executables_load_in_jaxs_own_client():
    """What JAX's persistent cache stores: bytes JAX's CPU backend loads and runs (warming
    JAX's cache builds on this)."""
    from jax._src import xla_bridge
    from jaxlib import xla_client

    from worker.plugin.jaxlib_cpu.client import serialized_for_jax

    x = np.linspace(-2, 2, 64, dtype=np.float32).reshape(8, 8)
    program = lower(lambda x: jnp.tanh(x @ x.T), [x])
    serialized = serialized_for_jax(program.code, compile_options(), JAX_CPU_DEVICES)
    backend = xla_bridge.get_backend("cpu")
    device = backend.local_devices()[0]
    loaded = backend.deserialize_executable(serialized, xla_client.DeviceList((device,)), None)
    (out,) = loaded.execute_sharded(
        [jax.device_put(x, device)]
    ).disassemble_into_single_device_arrays()
    expected = jax.jit(lambda x: jnp.tanh(x @ x.T))(x)
    assert np.asarray(out[0]).tobytes() == np.asarray(expected).tobytes()


def test_jaxlib_s_client_starts_without_xla_s_info_lines_on_stderr() -> None:
    """A process that runs on jaxlib's client (a bundle's program run in the caller's process,
    a worker) keeps XLA's INFO lines (the client's device count) off stderr, as JAX does;
    without TF_CPP_MIN_LOG_LEVEL (which this test process's JAX set, and children inherit)."""
    import os
    import subprocess
    import sys

    environment = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    code = "from worker.plugin.jaxlib_cpu import calls; calls.make_client(2); print('made')"
    done = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert done.stdout.strip() == "made", done.stderr
    assert "pjrt_client.cc" not in done.stderr and "PjRt-IFRT" not in done.stderr, done.stderr
