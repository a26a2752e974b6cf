"""Compiling for a TPU without one: libtpu's deviceless compiles, as a CI machine makes them.

Everything here runs on a machine without a TPU (CI has none), with the
libtpu the ``tpu`` extra installs: compile_program for a topology, the cache
entry it publishes and a second process's hit, pjrt-pool warm, a bundle made
and checked for a topology, a compile-only Pool beside a process that holds
libtpu's host lock, and the executable compared with JAX's own deviceless
compile of the same function. Running what they compiled needs the chip:
tools/tpu_check.py does that through the device tool.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, pjrt_pool, run_python
from tpu_programs import NARROW

pytest.importorskip("libtpu", reason="needs libtpu (pip install -e '.[tpu]')")

from pool import Pool, lower
from pool.errors import PoolError
from worker.plugin import libtpu
from worker.plugin.topology import derived_options, parse_topology

EXAMPLES = "pool.examples:programs"

if libtpu.attached_chips():
    pytest.skip(
        "a TPU is attached: these tests are about machines without one", allow_module_level=True
    )


def in_child(body: str, env: dict[str, str] | None = None) -> list[str]:
    """Runs a test's body in a fresh process (this one may hold the CPU plugin, and a
    process holds one plugin), with the test programs importable; returns its stdout lines.
    An assertion that fails there fails the test, with the child's output."""
    prelude = f"""
        import json, sys
        import jax, numpy as np, pytest
        sys.path.insert(0, {str(REPO / "tests")!r})
        from tpu_programs import NARROW, f32
        from pool import lower
        from worker import compile_program
    """
    code = textwrap.dedent(prelude) + textwrap.dedent(body)
    return run_python(code, env=env).stdout.splitlines()


# -- topology names ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("v5e:1x1", {"chips_per_host_bounds": (1, 1, 1)}),
        ("v5e:2x2", {"chips_per_host_bounds": (2, 2, 1)}),
        ("v6e:2x4", {"chips_per_host_bounds": (2, 4, 1)}),
        ("v5e:4x4", {}),
        ("v4:2x2x1", {}),
        ("v5p:1x1x1", {"chips_per_host_bounds": (1, 1, 1)}),
    ],
)
def test_a_topology_name_gets_the_host_bounds_libtpu_needs(name, options):
    assert derived_options(name) == options
    spec = parse_topology(name, {"chips_per_host_bounds": [4, 4, 1]} if name == "v5e:4x4" else None)
    assert spec.name == name
    if name == "v5e:4x4":  # given options win over derived ones
        assert dict(spec.options) == {"chips_per_host_bounds": (4, 4, 1)}


@pytest.mark.parametrize("bad", ["v5e", "v5e:", "bogus name", "v5e-4x4"])
def test_a_name_that_is_not_a_topology_is_refused_naming_the_form(bad):
    with pytest.raises(ValueError, match="GENERATION:AxB"):
        parse_topology(bad)
    with pytest.raises(ValueError, match="every axis of a topology needs at least one chip"):
        parse_topology("v5e:0x2")


def test_a_topology_the_plugin_cannot_make_is_a_topology_error(tmp_path):
    in_child(
        f"""
        from worker.errors import TopologyError
        program = lower(lambda x: x + 1, [f32(4)], platform="tpu")
        with pytest.raises(TopologyError, match="cannot make the topology v9z:2x2"):
            compile_program(program, cache_dir={str(tmp_path)!r}, topology="v9z:2x2")
        """
    )


# -- compile_program for a topology -----------------------------------------------------


def test_a_deviceless_compile_publishes_the_plugins_own_bytes_and_does_not_run(tmp_path):
    in_child(
        f"""
        from worker.cache import open_cache
        from worker.compile.executable import TopologyExecutable
        from worker.errors import NotLoadedError
        function, shapes = NARROW["mul_32x16"]
        program = lower(function, shapes, platform="tpu")
        executable, statistics = compile_program(
            program, cache_dir={str(tmp_path)!r}, topology="v5e:1x1"
        )
        assert isinstance(executable, TopologyExecutable) and statistics.compiled == 1
        assert executable.topology == "v5e:1x1" and executable.platform == "tpu"
        assert executable.output_types == ((np.dtype(np.float32), (32, 16)),)
        with pytest.raises(NotLoadedError, match="compiled for the topology v5e:1x1 without"):
            executable.run([np.ones((32, 16), np.float32)])
        with pytest.raises(NotLoadedError):
            executable.prime()
        # The entry holds exactly what PJRT_Executable_Serialize gave: no stamp, which
        # libtpu refuses ("found leftover bytes after parsing all submessages").
        entry, _ = open_cache({str(tmp_path)!r}).read(executable.key)
        assert entry.payload == executable.serialize()
        assert entry.parts["platform"] == "tpu"
        topology = entry.parts["topology"]
        assert (topology["name"], topology["chips"], topology["devices"]) == ("v5e:1x1", "1x1x1", 1)
        assert topology["device_kind"] == "TPU v5 lite"
        assert entry.metadata["topology"] == "v5e:1x1"
        """
    )


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    script = f"""
        import json, jax, jax.numpy as jnp
        from pool import lower
        from worker import compile_program
        program = lower(lambda a, b: jnp.tanh(a @ b), [jax.ShapeDtypeStruct((128, 64), "float32"),
                        jax.ShapeDtypeStruct((64, 32), "float32")], platform="tpu")
        executable, statistics = compile_program(program, cache_dir={str(tmp_path)!r},
                                                 topology="v5e:1x1")
        print(json.dumps([executable.key, statistics.compiled, statistics.loaded]))
    """
    first = json.loads(run_python(script).stdout.splitlines()[-1])
    second = json.loads(run_python(script).stdout.splitlines()[-1])
    assert first[1:] == [1, 0] and second[1:] == [0, 1]
    assert first[0] == second[0]


def test_topologies_and_libtpu_flags_make_their_own_keys(tmp_path):
    body = f"""
        program = lower(lambda x: x * 3, [f32(8, 128)], platform="tpu")
        for topology in ("v5e:1x1", "v5e:2x2"):
            print(compile_program(program, cache_dir={str(tmp_path)!r}, topology=topology)[0].key)
    """
    one, four = in_child(body)[-2:]
    assert one != four
    flags = "--xla_tpu_enable_latency_hiding_scheduler=false"
    assert in_child(body, env={"LIBTPU_INIT_ARGS": flags})[-2] not in (one, four)
    # Flags that change no code change no key: a dump, and the launch barrier JAX adds
    # to LIBTPU_INIT_ARGS on every Cloud TPU VM (measured: the same executables).
    quiet = f"--xla_jf_dump_to={tmp_path}/dumps --xla_tpu_use_enhanced_launch_barrier=true"
    assert in_child(body, env={"LIBTPU_INIT_ARGS": quiet})[-2:] == [one, four]


def test_a_deviceless_compile_is_the_executable_jax_compiles_for_the_topology():
    """pjrt-pool's module and options give the executable jax.jit's deviceless compile gives:
    the plugin's fingerprints are equal (JAX's own compile captured and compiled again)."""
    in_child(
        """
        from jax._src import compiler
        from jax._src.interpreters import mlir
        from jax.experimental import topologies
        from jax.sharding import SingleDeviceSharding
        from worker import get_runtime
        from worker.plugin.topology import parse_topology

        captured = {}
        original = compiler.backend_compile_and_load

        def capture(backend, module, devices, options, callbacks):
            captured["code"] = mlir.module_to_bytecode(module)
            captured["options"] = options.SerializeAsString()
            return original(backend, module, devices, options, callbacks)

        spec = parse_topology("v5e:1x1")
        devices = topologies.get_topology_desc(spec.name, "tpu", **spec.create_options()).devices
        sharding = SingleDeviceSharding(devices[0])
        compiler.backend_compile_and_load = capture
        for name, (function, shapes) in NARROW.items():
            placed = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in shapes]
            jax.jit(function).trace(*placed).lower().compile()
            ours, _ = compile_program(
                lower(function, shapes, platform="tpu"), disk_cache=False, topology=spec
            )
            theirs = get_runtime().topology(spec).compile(captured["code"], captured["options"])
            assert ours.fingerprint() == theirs.fingerprint().hex(), name
        """,
        # JAX loads libtpu itself here: without the host's lock, as compile workers do.
        env={"ALLOW_MULTIPLE_LIBTPU_LOAD": "true", "TPU_SKIP_MDS_QUERY": "1"},
    )


# -- a compile-only Pool -----------------------------------------------------------------


def _holds_lockfile(pid: int) -> bool:
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == "/tmp/libtpu_lockfile":
                return True
        except OSError:
            continue
    return False


def test_a_compile_only_pool_compiles_beside_the_process_that_holds_libtpus_lock(tmp_path):
    """A process that loaded libtpu as a chip's holder does (here without a chip) holds the
    host's lock; the pool's workers compile anyway, without it. The holder is a child, or
    this process when its JAX loaded libtpu first (JAX_PLATFORMS unset)."""
    if _holds_lockfile(os.getpid()):
        _compiles_beside_the_lock(tmp_path)
        return
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import sys, libtpu
                from worker import _pjrt
                _pjrt.Plugin.load(libtpu.get_library_path())  # takes /tmp/libtpu_lockfile
                print("holding", flush=True)
                sys.stdin.read()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "TPU_SKIP_MDS_QUERY": "1"},
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        assert _holds_lockfile(holder.pid)
        _compiles_beside_the_lock(tmp_path)
    finally:
        holder.communicate("", timeout=30)


def _compiles_beside_the_lock(cache: Path) -> None:
    programs = [lower(function, shapes, platform="tpu") for function, shapes in NARROW.values()]
    with Pool(2, platform="tpu", topology="v5e:1x1", cache_dir=cache) as pool:
        assert [w["role"] for w in pool.worker_info] == ["compile", "compile"]
        specs = pool.compile_many(programs)
        assert all(spec.platform == "tpu" for spec in specs)
        assert pool.statistics.compiled == len(programs)
        assert not any(_holds_lockfile(w["pid"]) for w in pool.worker_info)
        with pytest.raises(PoolError, match="cannot run programs"):
            pool.submit(programs[0], [np.ones((32, 16), np.float32)])


def test_a_tpu_pool_on_a_machine_without_one_needs_a_topology():
    from worker.errors import DeviceUnavailableError

    with pytest.raises(DeviceUnavailableError, match="no TPU is attached to this machine"):
        Pool(1, platform="tpu")


def test_lowering_for_tpu_leaves_the_parents_jax_on_the_cpu():
    """A parent whose JAX is still unset lowers for "tpu" on the CPU: on a TPU host its JAX
    would otherwise open the chip the pool's device worker needs."""
    done = run_python(
        """
        import jax
        from pool import lower
        lower(lambda x: x + 1, [jax.ShapeDtypeStruct((4,), "float32")], platform="tpu")
        print(jax.config.jax_platforms, [d.platform for d in jax.devices()])
        """,
        env={"JAX_PLATFORMS": ""},
    )
    assert done.stdout.split()[-2:] == ["cpu", "['cpu']"]


# -- warm and bundles for a TPU made here ---------------------------------------------------


@pytest.mark.slow
def test_warm_bundle_and_check_for_a_tpu_on_a_machine_without_one(tmp_path):
    cache = tmp_path / "cache"
    warmed = pjrt_pool(
        "warm",
        EXAMPLES,
        "--platform",
        "tpu",
        "--topology",
        "v5e:1x1",
        "--cache-dir",
        str(cache),
        "--manifest",
        str(tmp_path / "m.json"),
        cwd=tmp_path,
    )
    assert warmed.returncode == 0, warmed.stderr
    assert "33 compiled" in warmed.stdout
    # Run here, by key, a program compiled for a TPU: said in one line, and its entry
    # stays in the cache (a CPU plugin once judged it damaged and removed it).
    ran = pjrt_pool("run", str(tmp_path / "m.json"), "tiny_add_one")
    assert ran.returncode == 2
    (line,) = ran.stderr.strip().splitlines()
    assert "no tpu device is attached to this machine" in line
    assert len(list((cache / "entries").glob("*.pjx"))) == 33
    made = pjrt_pool(
        "bundle", "create", str(tmp_path / "m.json"), "-o", str(tmp_path / "tpu.bundle")
    )
    assert made.returncode == 0, made.stderr
    checked = pjrt_pool("bundle", "check", str(tmp_path / "tpu.bundle"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "33 of 33 programs would load for a host of v5e:1x1" in checked.stdout
    assert "TPU v5 lite, 1x1x1 chips" in checked.stdout and "TFRT TPU v5 lite" in checked.stdout
    # For another topology, or with other libtpu flags, every program is refused, naming
    # the part that differs.
    other = pjrt_pool(
        "bundle", "check", str(tmp_path / "tpu.bundle"), "--topology", "v5e:2x2", "--json"
    )
    assert other.returncode == 1
    report = json.loads(other.stdout)
    assert report["would_miss"] == 33
    differences = report["programs"][0]["elsewhere"][0]["differences"]
    assert "topology.name: built with 'v5e:1x1', here 'v5e:2x2'" in differences
    flagged = pjrt_pool(
        "bundle",
        "check",
        str(tmp_path / "tpu.bundle"),
        "--json",
        env={"LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=false"},
    )
    assert flagged.returncode == 1
    (line,) = json.loads(flagged.stdout)["programs"][0]["elsewhere"][0]["differences"]
    assert line.startswith("environment.libtpu_init_args: built with None")
    # A second warm of another topology into the same cache: its own entries, all compiled.
    again = pjrt_pool(
        "warm",
        EXAMPLES,
        "--platform",
        "tpu",
        "--topology",
        "v5e:2x2",
        "--cache-dir",
        str(cache),
        "--json",
        cwd=tmp_path,
    )
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["statistics"]["compiled"] == 33


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["--topology", "v5e"], "--topology: 'v5e' is not a topology name"),
        (
            ["--topology-option", "chips_per_host_bounds=1,1,1"],
            "--topology-option needs --topology",
        ),
        (["--topology", "v5e:1x1", "--topology-option", "nonsense"], "write KEY=VALUE"),
    ],
)
def test_a_topology_the_command_line_cannot_use_is_one_line_and_exit_2(tmp_path, arguments, says):
    done = pjrt_pool(
        "warm", EXAMPLES, "--platform", "tpu", *arguments, "--cache-dir", str(tmp_path)
    )
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert says in line


@pytest.mark.slow
def test_the_type_probe_finds_the_types_libtpu_does_not_compile(tmp_path):
    """check-plugin probes each element type once in a worker before any case needs it:
    libtpu aborts compiling a conversion to complex128 ("Unsupported CVT X{64|128} expansion
    ... to c128"), which crashes that probe's compile worker alone and makes complex128
    unsupported; float32, and float64 (which libtpu emulates), compile."""
    from pool.conformance.runner import describe_failure
    from pool.conformance.type_probe import TypeProbe

    with Pool(2, platform="tpu", topology="v5e:1x1", cache_dir=tmp_path) as pool:
        probe = TypeProbe(pool, "tpu", 120, lambda error: describe_failure(error)[1])
        probe.ask([np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.complex128)])
        found = {support.name: support for support in probe.outcomes()}
        assert pool.statistics.compiled == 2  # the two that compile
    assert found["float32"].supported and found["float64"].supported
    refused = found["complex128"]
    assert not refused.supported
    assert "was killed by SIGABRT (signal 6)" in refused.why, refused.why
    assert "c128" in refused.why  # libtpu's own line, from the worker's output
