"""Programs over several TPU chips, compiled on a machine without one (CI has none).

libtpu compiles a sharded program for a topology of several chips
(``v5e:2x2``, ``v5e:2x4``, ``v6e:2x2``) with no device: the executable's
fingerprint equals JAX's own deviceless compile of the same jax.jit
(jax.experimental.topologies), as tests/test_tpu_deviceless.py checks for one
chip; a program over more chips than the topology is refused naming both
counts; ``pjrt-pool warm`` of a spec of sharded programs for v5e:2x4 makes a
bundle whose check names each program's mesh and refuses a host of fewer
chips. Running them needs the chips: tools/tpu_sharding_check.py does
that on the TPU host.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from conftest import pjrt_pool, run_python

pytest.importorskip("libtpu", reason="needs libtpu (pip install -e '.[tpu]')")

from worker.plugin import libtpu

if libtpu.attached_chips():
    pytest.skip(
        "a TPU is attached: these tests are about machines without one", allow_module_level=True
    )

DEVICELESS = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "true", "TPU_SKIP_MDS_QUERY": "1"}
"""JAX loads libtpu in the child too: without the host's lock, as compile workers do."""


def in_child(body: str) -> list[str]:
    """Runs a test's body in a fresh process (this one holds the CPU plugin); returns its
    stdout lines. An assertion that fails there fails the test, with the child's output."""
    prelude = """
        import jax, numpy as np, pytest
        from jax.experimental import topologies
        from pool.examples.sharded import make_mesh, mlp_batch, mlp_parameters, mlp_shardings
        from pool.examples.sharded import mlp_step, sharded_cases
        from pool import lower
        from worker import compile_program, get_runtime
        from worker.plugin.topology import parse_topology

        def topology_devices(name):
            spec = parse_topology(name)
            description = topologies.get_topology_desc(spec.name, "tpu", **spec.create_options())
            return spec, description.devices
    """
    code = textwrap.dedent(prelude) + textwrap.dedent(body)
    return run_python(code, env=DEVICELESS, timeout=300).stdout.splitlines()


@pytest.mark.parametrize(
    ("topology", "shape"),
    [("v5e:2x2", (2, 2)), ("v5e:2x4", (2, 4)), ("v6e:2x2", (4,))],
)
@pytest.mark.slow  # 4-15 s each; CI's py311 leg, the one with libtpu, runs the slow tests
def test_a_sharded_deviceless_compile_is_jaxs_own(topology, shape):
    """Each case (jit over a mesh of the topology's chips, shard_map collectives, a sharded
    MLP step over a pytree): JAX's own deviceless compile captured and compiled again by the
    same libtpu, and pjrt-pool's, have one fingerprint."""
    lines = in_child(
        f"""
        from jax._src import compiler
        from jax._src.interpreters import mlir

        captured = {{}}
        original = compiler.backend_compile_and_load

        def capture(backend, module, devices, options, callbacks):
            captured["code"] = mlir.module_to_bytecode(module)
            captured["options"] = options.SerializeAsString()
            return original(backend, module, devices, options, callbacks)

        compiler.backend_compile_and_load = capture

        def global_outputs(function, shapes):  # what the executable gives back: whole arrays
            return tuple((np.dtype(o.dtype), o.shape) for o in jax.tree.leaves(
                jax.eval_shape(function, *shapes)))

        spec, devices = topology_devices({topology!r})
        mesh = make_mesh(devices, {shape!r})
        ins, outs = mlp_shardings(mesh)
        shardings = dict(in_shardings=ins, out_shardings=outs)
        step = (mlp_step, [mlp_parameters(), mlp_batch()], shardings)
        cases = [(c.function, c.shapes, c.jit_shardings()) for c in sharded_cases(mesh)] + [step]
        for function, arguments, shardings in cases:
            shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arguments)
            jax.jit(function, **shardings).trace(*shapes).lower().compile()
            program = lower(function, shapes, platform="tpu", **shardings)
            assert program.partitioning.devices == mesh.size
            ours, _ = compile_program(program, disk_cache=False, topology=spec)
            theirs = get_runtime().topology(spec).compile(captured["code"], captured["options"])
            assert ours.fingerprint() == theirs.fingerprint().hex(), function
            assert ours.output_types == global_outputs(function, shapes)
            print("same", getattr(function, "__name__", function))
        """
    )
    assert sum(line.startswith("same") for line in lines) == 8


@pytest.mark.slow
def test_a_program_over_more_chips_than_the_topology_is_refused_before_it_compiles(tmp_path):
    """In this process and in a compile-only pool's worker, whose refusal the parent raises
    as the same DeviceCountError."""
    lines = in_child(
        f"""
        from worker.errors import DeviceCountError
        spec, devices = topology_devices("v5e:2x4")
        case = sharded_cases(make_mesh(devices, (2, 4)))[0]
        program = lower(case.function, case.shapes, platform="tpu", **case.jit_shardings())
        with pytest.raises(DeviceCountError) as refused:
            compile_program(program, cache_dir={str(tmp_path)!r}, topology="v5e:2x2")
        assert (refused.value.needed, refused.value.available) == (8, 4)
        from pool import Pool
        with Pool(1, platform="tpu", topology="v5e:2x2", cache_dir={str(tmp_path)!r}) as pool:
            with pytest.raises(DeviceCountError) as in_worker:  # the worker's, rebuilt here
                pool.compile(program)
        assert (in_worker.value.needed, in_worker.value.available) == (8, 4)
        print(refused.value)
        """
    )
    assert lines[-1] == (
        "the program needs 8 devices (mesh data=2 x model=4) but the topology v5e:2x2 has 4: "
        "compile it for a topology of 8 devices"
    )


SPEC = """
import jax
from jax.sharding import AbstractMesh
from pool.examples.sharded import mlp_batch, mlp_parameters, mlp_shardings, mlp_step, sharded_cases
from pool.warm import WarmProgram

MESH = AbstractMesh((2, 4), ("data", "model"))  # no device needed: a TPU host's 8 chips


def programs():
    ins, outs = mlp_shardings(MESH)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          [mlp_parameters(), mlp_batch()])
    yield WarmProgram("mlp_step", mlp_step, shapes, in_shardings=ins, out_shardings=outs)
    for case in sharded_cases(MESH)[3:5]:
        yield WarmProgram(case.name, case.function, case.shapes)
"""


@pytest.mark.slow
def test_warm_for_v5e_2x4_then_a_bundle_that_names_each_mesh_and_refuses_fewer_chips(tmp_path):
    (tmp_path / "spec.py").write_text(SPEC)
    env = {"PJRT_POOL_CACHE_DIR": str(tmp_path / "cache")}
    manifest, bundle = tmp_path / "m.json", tmp_path / "app.bundle"
    warm = pjrt_pool(
        "warm", str(tmp_path / "spec.py"), "--platform", "tpu", "--topology", "v5e:2x4",
        "--workers", "2", "--manifest", str(manifest), env=env,
    )  # fmt: skip
    assert warm.returncode == 0, warm.stdout + warm.stderr
    specs = json.loads(manifest.read_text())["programs"]
    assert {s["name"]: s["partitioning"]["mesh"] for s in specs} == {
        name: [["data", 2], ["model", 4]] for name in ("mlp_step", "psum", "all_gather")
    }
    made = pjrt_pool("bundle", "create", str(manifest), "-o", str(bundle), env=env)
    assert made.returncode == 0, made.stderr
    fits = pjrt_pool("bundle", "check", str(bundle), env=env)  # for the host it was built for
    assert fits.returncode == 0, fits.stdout + fits.stderr
    assert "mlp_step: loads (over 8 devices (mesh data=2 x model=4))" in fits.stdout
    small = pjrt_pool("bundle", "check", str(bundle), "--topology", "v5e:2x2", env=env)
    assert small.returncode != 0
    assert "psum: would miss (it needs 8 devices (mesh data=2 x model=4) and v5e:2x2 has 4)" in (
        small.stdout
    )
    assert "0 of 3 programs would load for a host of v5e:2x2" in small.stdout
