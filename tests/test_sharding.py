"""Programs over several devices (SPMD): jax.jit with shardings over a Mesh, and shard_map.

On the CPU plugin with 4 and 8 host devices (a worker's client is given them:
Pool(devices_per_worker=...), the CPU plugin's cpu_device_count), each program
against jax.jit on this process's JAX CPU backend with as many devices
(conftest.JAX_CPU_DEVICES), bit for bit: the same XLA partitioning of the
same program. Through compile_program in this process, Pool.run and
Pool.function; the second CPU plugin in a child; refusals of programs too big
for a worker; the records that carry a program's partitioning.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import SECOND_PLUGIN, run_python
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pool import Pool, lower
from pool.examples.sharded import (
    make_mesh,
    mlp_batch,
    mlp_parameters,
    mlp_shardings,
    mlp_step,
    sharded_cases,
)
from worker import compile_program
from worker.errors import DeviceCountError
from worker.partitioning import Partitioning
from worker.records import ProgramSpec

MESHES = {"4 devices (2x2)": (2, 2), "8 devices (8)": (8,), "8 devices (2x4)": (2, 4)}
"""The meshes each case runs over: two axes (data, model) and one (data)."""


@pytest.fixture(scope="module")
def pool8():
    """One worker holding 8 devices: programs over 4 run on its first 4."""
    with Pool(1, devices_per_worker=8) as pool:
        yield pool


def _cases():
    for mesh_name, shape in MESHES.items():
        mesh = make_mesh(jax.devices(), shape)
        for case in sharded_cases(mesh):
            yield pytest.param(case, id=f"{case.name}-{mesh_name}")


def _expected(case, arguments):
    result = jax.jit(case.function, **case.jit_shardings())(*arguments)
    return [np.asarray(r) for r in jax.tree.leaves(result)]


BITWISE = {"psum", "all_gather", "ppermute", "axis_index", "jit_replicated_output"}
"""Cases whose numbers the plugin's XLA and this process's JAX agree on bit for bit: data
movement and sums. A matmul or tanh may differ in the last bit: the CPU plugin is built from
another XLA than this jaxlib's (docs/facts.md), whatever the partitioning."""


def _assert_same(case, got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    if case.name in BITWISE:
        assert np.array_equal(got, want), case.name
    else:
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7, err_msg=case.name)


def _lowered(case):
    return lower(case.function, case.shapes, **case.jit_shardings())


# -- the reproductions -------------------------------------------------------------


def test_a_shard_map_psum_compiles_and_gives_jax_jits_numbers(pool8):
    """Failed with "No registered implementation for untyped custom call to
    xla.sdy.GlobalToLocalShape for Host" in compile_program, Pool.run and Pool.function."""
    mesh = make_mesh(jax.devices(), (4,))
    f = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(jax.numpy.sum(x, 0, keepdims=True), "data"),
            mesh=mesh,
            in_specs=P("data", None),
            out_specs=P(None, None),
        )
    )
    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    expected = np.asarray(f(x))
    program = lower(f, [jax.ShapeDtypeStruct(x.shape, x.dtype)])
    executable, _ = compile_program(program)
    assert np.array_equal(executable.run([x])[0], expected)
    assert np.array_equal(pool8.run(program, [x])[0], expected)
    assert np.array_equal(pool8.function(f)(x), expected)


def test_a_jit_with_named_shardings_runs_over_its_devices():
    """Lowered with mhlo.num_partitions = 4 and was compiled for one partition: it ran on one
    device, silently. Now its options say 4 partitions, and it runs on 4 devices."""
    mesh = make_mesh(jax.devices(), (4,))
    f = jax.jit(lambda x: x * 2, in_shardings=NamedSharding(mesh, P("data", None)))
    program = lower(f, [jax.ShapeDtypeStruct((8, 4), np.float32)])
    executable, _ = compile_program(program)
    assert program.partitioning is not None and program.partitioning.devices == 4
    assert executable.native.device_ids == [0, 1, 2, 3]
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    assert np.array_equal(executable.run([x])[0], x * 2)


# -- every case against jax.jit ---------------------------------------------------------------


@pytest.mark.parametrize("case", list(_cases()))
def test_a_sharded_program_gives_jax_jits_numbers_through_the_pool(case, pool8):
    arguments = case.arguments()
    program = _lowered(case)
    assert program.partitioning.devices == case.mesh.size
    outputs = pool8.run(program, arguments)
    for got, want in zip(outputs, _expected(case, arguments), strict=True):
        _assert_same(case, got, want)


def test_large_outputs_of_a_sharded_first_run_go_over_its_inputs_copy(pool8):
    # A first run's outputs go over the task's copy of its numpy inputs (Run.spare) when
    # they fit: every device's part has ended before any output is written there.
    # Outputs that reorder the inputs' blocks (a transpose of a row-sharded matrix, a
    # matmul, as many bytes as the inputs) read what the inputs were, on the first run
    # and the next.
    mesh = make_mesh(jax.devices()[:4], (2, 2))
    rows, columns = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P(None, "model"))

    def step(x, w):
        return x.T * 2, x @ w

    f32 = np.float32
    program = lower(
        step,
        [jax.ShapeDtypeStruct((512, 512), f32), jax.ShapeDtypeStruct((512, 256), f32)],
        in_shardings=(rows, columns),
        out_shardings=(columns, NamedSharding(mesh, P("data", "model"))),
    )
    rng = np.random.default_rng(7)
    for _ in range(2):
        x = rng.standard_normal((512, 512)).astype(f32)
        w = rng.standard_normal((512, 256)).astype(f32)
        before = {line for line in _memfds() if "pjrt-pool-outputs" in line}
        transposed, product = pool8.run(program, [x, w])
        assert {line for line in _memfds() if "pjrt-pool-outputs" in line} == before
        assert np.array_equal(transposed, x.T * 2)
        np.testing.assert_allclose(product, x @ w, rtol=1e-4, atol=1e-3)


def _memfds() -> list[str]:
    """This process's shared-memory mappings, by name."""
    with open("/proc/self/maps") as maps:
        return [line.split()[-2] for line in maps if "/memfd:" in line]


def test_each_partition_runs_on_its_own_device(pool8):
    """axis_index: each device's block of the result holds its own place in the mesh."""
    mesh = make_mesh(jax.devices(), (2, 4))
    case = next(c for c in sharded_cases(mesh) if c.name == "axis_index")
    (x,) = case.arguments()
    out = pool8.run(_lowered(case), [x])[0]
    blocks = out.reshape(2, 16 // 2, 4, 8 // 4).transpose(0, 2, 1, 3).reshape(8, -1)
    assert [set(b.tolist()) for b in blocks] == [{float(i)} for i in range(8)]
    executable, _ = compile_program(_lowered(case))
    assert sorted(executable.native.device_ids) == list(range(8))


@pytest.mark.parametrize("shape", [(4,), (2, 2), (2, 4)], ids=str)
def test_a_sharded_training_step_fed_back_for_ten_steps_through_pool_function(shape, pool8):
    mesh = make_mesh(jax.devices(), shape)
    ins, outs = mlp_shardings(mesh)
    step = pool8.function(mlp_step, in_shardings=ins, out_shardings=outs)
    reference = jax.jit(mlp_step, in_shardings=ins, out_shardings=outs)
    params, batch = mlp_parameters(), mlp_batch()
    expected = params
    for _ in range(10):
        params, loss = step(params, batch)
        expected, expected_loss = reference(expected, batch)
        for name in params:
            np.testing.assert_allclose(params[name], expected[name], rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(loss, expected_loss, rtol=2e-6)
    assert isinstance(params["w1"], np.ndarray) and params["w1"].shape == (8, 16)


def test_pool_function_keeps_a_sharded_jits_own_shardings(pool8):
    mesh = make_mesh(jax.devices(), (2, 2))
    ins, outs = mlp_shardings(mesh)
    jitted = jax.jit(mlp_step, in_shardings=ins, out_shardings=outs)
    program = pool8.function(jitted).lower(mlp_parameters(), mlp_batch())
    specs = [s.spec for s in program.partitioning.inputs]
    # Flattened as jax.tree_util does: the parameters' leaves (b1, b2, w1, w2), then x, y.
    assert (
        specs
        == ["P('model',)", "P()", "P(None, 'model')", "P('model', None)"] + ["P('data', None)"] * 2
    )
    _, loss = pool8.function(jitted)(mlp_parameters(), mlp_batch())
    _, expected_loss = jitted(mlp_parameters(), mlp_batch())
    np.testing.assert_allclose(loss, expected_loss, rtol=2e-6)


def test_pool_function_keeps_the_placement_of_arrays_on_a_mesh(pool8):
    """Arrays placed on a mesh (jax.device_put with a NamedSharding) choose the program's
    input shardings, as jax.jit's; another placement is another signature."""
    mesh = make_mesh(jax.devices(), (2, 2))
    x = np.arange(128, dtype=np.float32).reshape(16, 8)
    rows = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    blocks = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    f = pool8.function(lambda a: a * 2 + 1)
    assert [s.spec for s in f.lower(rows).partitioning.inputs] == ["P('data', None)"]
    assert [s.spec for s in f.lower(blocks).partitioning.inputs] == ["P('data', 'model')"]
    assert f.lower(x).partitioning is None  # numpy: a program of one device
    for placed in (rows, blocks):
        assert np.array_equal(f(placed), x * 2 + 1)


# -- refusals ---------------------------------------------------------------------------------


def test_a_program_too_big_for_a_worker_is_refused_naming_both_counts():
    mesh = make_mesh(jax.devices(), (2, 4))
    case = next(c for c in sharded_cases(mesh) if c.name == "psum")
    program = _lowered(case)
    with Pool(1, devices_per_worker=4) as pool:
        with pytest.raises(DeviceCountError, match=r"needs 8 devices \(mesh data=2 x model=4\)"):
            pool.run(program, case.arguments())
        try:
            pool.submit_compile(program)
        except DeviceCountError as error:
            assert (error.needed, error.available) == (8, 4)
            assert "each worker of this pool holds 4" in str(error)
            assert "devices_per_worker=8" in str(error)
        else:
            raise AssertionError("a compile of a program too big for the workers was not refused")
        small = _lowered(sharded_cases(make_mesh(jax.devices(), (4,)))[0])
        assert pool.run(small, sharded_cases(make_mesh(jax.devices(), (4,)))[0].arguments())


def test_a_worker_refuses_a_program_over_more_devices_than_it_was_given(tmp_path):
    """The worker's own check (a pool's parent refuses first): a process told its devices
    (PJRT_POOL_DEVICES, as a pool tells its workers) does not grow them."""
    done = run_python(
        f"""
        import jax
        jax.config.update("jax_num_cpu_devices", 4)
        from pool.examples.sharded import make_mesh, sharded_cases
        from pool import lower
        from worker import compile_program
        from worker.errors import DeviceCountError
        case = sharded_cases(make_mesh(jax.devices(), (4,)))[0]
        program = lower(case.function, case.shapes, **case.jit_shardings())
        try:
            compile_program(program, cache_dir={str(tmp_path)!r})
        except DeviceCountError as error:
            print("refused:", error)
        """,
        env={"PJRT_POOL_DEVICES": "2"},
    )
    assert "refused: the program needs 4 devices (mesh data=4) but this pool worker holds 2" in (
        done.stdout
    )


# -- records ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 4), (4,)], ids=str)
def test_compile_options_are_the_ones_jax_jit_compiles_the_same_program_with(shape, monkeypatch):
    """The serialized options of a sharded program carry the fields jax.jit's compile sets for
    it (captured as JAX hands them to its compiler), with JAX's values, byte for byte."""
    from jax._src import compiler

    captured = []
    original = compiler.backend_compile_and_load

    def capture(backend, module, devices, options, *rest):
        captured.append(options.SerializeAsString())
        return original(backend, module, devices, options, *rest)

    monkeypatch.setattr(compiler, "backend_compile_and_load", capture)
    # A device assignment of its own: devices 0..k-1 backwards (off TPU, other ids are
    # numbered 0..k-1 in the mesh's order, as a worker's devices are: pool.lowering.sharding).
    mesh = make_mesh(list(reversed(jax.devices()[: int(np.prod(shape))])), shape)
    for case in sharded_cases(mesh)[:1] + sharded_cases(mesh)[3:4]:  # a jit, a shard_map
        jitted = jax.jit(case.function, **case.jit_shardings())
        jitted.lower(*case.shapes).compile()
        ours = _fields(_fields(_lowered(case).partitioning.compile_options())[3][0])
        theirs = _fields(_fields(captured[-1])[3][0])
        for field in (4, 5, 6, 9, 19):  # replicas, partitions, SPMD, device assignment, Shardy
            assert ours[field] == theirs[field], (case.name, field)
        # No sharding propagation to parameters or outputs: jax.jit's when all are given.
        assert ours[12] == ours[18] == [b"\x00"]


def _fields(message: bytes) -> dict[int, list[object]]:
    """A protobuf message's fields, by number (varints and length-delimited bytes)."""
    fields: dict[int, list[object]] = {}
    at = 0

    def varint() -> int:
        nonlocal at
        value = shift = 0
        while True:
            byte = message[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while at < len(message):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields.setdefault(number, []).append(varint())
        elif wire == 2:
            length = varint()
            fields.setdefault(number, []).append(message[at : at + length])
            at += length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            fields.setdefault(number, []).append(message[at : at + size])
            at += size
        else:
            raise AssertionError(f"wire type {wire}")
    return fields


def test_keys_differ_per_device_count_and_per_mesh():
    from worker import DiskCache  # noqa: F401  (the cache a key names)
    from worker.compile.compiler import cache_key_of

    keys = set()
    for shape in [(4,), (8,), (2, 2), (2, 4), (4, 2)]:
        mesh = make_mesh(jax.devices(), shape)
        keys.add(cache_key_of(_lowered(sharded_cases(mesh)[1])))
    reordered = make_mesh(list(reversed(jax.devices()[:4])), (4,))
    keys.add(cache_key_of(_lowered(sharded_cases(reordered)[1])))
    assert len(keys) == 6


def test_the_partitioning_travels_in_a_program_spec_and_old_specs_are_one_device():
    case = sharded_cases(make_mesh(jax.devices(), (2, 2)))[2]
    executable, _ = compile_program(_lowered(case))
    spec = ProgramSpec.from_executable("partly", executable)
    again = ProgramSpec.loads(spec.dumps())
    assert again == spec and again.partitioning.mesh == (("data", 2), ("model", 2))
    assert [o.shape for o in again.partitioning.outputs] == [(16, 8), (16,)]
    old = {k: v for k, v in spec.to_json().items() if k != "partitioning"}
    assert ProgramSpec.from_json(old).partitioning is None
    data = spec.to_json()["partitioning"]
    for bad, says in [
        ({**data, "format": 99}, "format 99"),
        ({**data, "device_ids": [0, 1]}, "do not match its 2 device ids"),
        ({**data, "inputs": [{"shape": [16, 8], "blocks": [[[0, 99], [0, 8]]] * 4}]}, "outside"),
    ]:
        with pytest.raises(ValueError, match=says):
            Partitioning.from_json(json.loads(json.dumps(bad)))


# -- the second CPU plugin ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(SECOND_PLUGIN is None, reason="xla-cpu-pjrt is not installed")
def test_sharded_programs_run_on_the_second_cpu_plugin(tmp_path):
    """xla-cpu-pjrt (PJRT API 0.81, StableHLO 1.13.3) takes cpu_device_count and partitions
    Shardy programs too."""
    done = run_python(
        f"""
        import jax, numpy as np
        jax.config.update("jax_num_cpu_devices", 4)
        from pool.examples.sharded import make_mesh, sharded_cases
        from pool import lower
        from worker import compile_program
        for case in sharded_cases(make_mesh(jax.devices(), (2, 2))):
            arguments = case.arguments()
            expected = jax.tree.leaves(jax.jit(case.function, **case.jit_shardings())(*arguments))
            program = lower(case.function, case.shapes, **case.jit_shardings())
            executable, _ = compile_program(program, cache_dir={str(tmp_path)!r})
            got = executable.run(arguments)
            for g, w in zip(got, expected):
                np.testing.assert_allclose(g, np.asarray(w), rtol=2e-6, atol=1e-7)
            print("ok", case.name)
        """,
        env={"PJRT_POOL_PLUGIN_CPU": SECOND_PLUGIN},
    )
    assert done.stdout.count("ok ") == 7


# -- a crash, a cluster, a manifest and a bundle ----------------------------------------------


def test_a_crash_in_one_sharded_run_fails_only_that_run(handlers):
    from pool_helpers import handler_initializer

    from pool.errors import WorkerCrashedError

    mesh = make_mesh(jax.devices(), (4,))

    def crash(x):
        return jax.ffi.ffi_call("null_deref", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    crasher = lower(
        jax.shard_map(crash, mesh=mesh, in_specs=P("data"), out_specs=P("data")),
        [jax.ShapeDtypeStruct((8,), np.float32)],
        custom_calls=["null_deref"],
    )
    case = sharded_cases(mesh)[3]  # psum
    program, arguments = _lowered(case), case.arguments()
    initializer = handler_initializer(handlers)
    with Pool(1, devices_per_worker=4, initializer=initializer, max_crashes=2) as pool:
        before = pool.submit(program, arguments)
        doomed = pool.submit(crasher, [np.ones(8, np.float32)])
        after = pool.submit(program, arguments)
        with pytest.raises(WorkerCrashedError, match="SIGSEGV"):
            doomed.result(timeout=120)
        for future in (before, after):
            (out,) = future.result(timeout=120)
            _assert_same(case, out, _expected(case, arguments)[0])


@pytest.mark.slow
def test_a_cluster_pool_runs_and_refuses_sharded_programs_as_a_pool_does():
    pytest.importorskip("distributed")
    from pool import ClusterPool
    from pool.cluster import local_client

    mesh = make_mesh(jax.devices(), (2, 2))
    ins, outs = mlp_shardings(mesh)
    case = sharded_cases(mesh)[4]  # all_gather
    with local_client(1, threads_per_worker=1) as client:
        with ClusterPool(client, workers_per_node=1, devices_per_worker=4) as cluster:
            (out,) = cluster.run(_lowered(case), case.arguments())
            _assert_same(case, out, _expected(case, case.arguments())[0])
            step = cluster.function(mlp_step, in_shardings=ins, out_shardings=outs)
            _, loss = step(mlp_parameters(), mlp_batch())
            _, expected = jax.jit(mlp_step, in_shardings=ins, out_shardings=outs)(
                mlp_parameters(), mlp_batch()
            )
            np.testing.assert_allclose(loss, expected, rtol=2e-6)
        with (
            ClusterPool(client, workers_per_node=1, devices_per_worker=2) as small,
            pytest.raises(DeviceCountError, match=r"needs 4 devices .* holds 2"),
        ):
            small.submit(_lowered(case), case.arguments())


SPEC = """
import jax
from jax.sharding import AbstractMesh
from pool.examples.sharded import mlp_batch, mlp_parameters, mlp_shardings, mlp_step
from pool.warm import WarmProgram

MESH = AbstractMesh((2, 2), ("data", "model"))  # a mesh without devices: any host's 4


def programs():
    ins, outs = mlp_shardings(MESH)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          [mlp_parameters(), mlp_batch()])
    yield WarmProgram("mlp_step", mlp_step, shapes, in_shardings=ins, out_shardings=outs)
"""


@pytest.mark.slow
def test_a_sharded_training_step_runs_from_a_manifest_and_a_bundle_in_a_fresh_process(tmp_path):
    """Warmed (pjrt-pool warm --devices-per-worker 4), bundled, then fed back for 10 steps in
    a process that never imports JAX itself: from the manifest through a Pool of 4 devices per
    worker (JAX stays out of it), from the bundle in that process; the numbers are
    jax.jit's."""
    from conftest import pjrt_pool

    (tmp_path / "spec.py").write_text(SPEC)
    env = {"PJRT_POOL_CACHE_DIR": str(tmp_path / "cache")}
    manifest, bundle = tmp_path / "m.json", tmp_path / "app.bundle"
    warm = pjrt_pool(
        "warm", str(tmp_path / "spec.py"), "--workers", "1", "--devices-per-worker", "4",
        "--manifest", str(manifest), env=env,
    )  # fmt: skip
    assert warm.returncode == 0, warm.stdout + warm.stderr
    assert pjrt_pool("bundle", "create", str(manifest), "-o", str(bundle), env=env).returncode == 0
    mesh = make_mesh(jax.devices(), (2, 2))
    ins, outs = mlp_shardings(mesh)
    reference = jax.jit(mlp_step, in_shardings=ins, out_shardings=outs)
    params, batch = mlp_parameters(), mlp_batch()
    np.savez(tmp_path / "start.npz", x=batch[0], y=batch[1], **params)
    for _ in range(10):
        params, loss = reference(params, batch)
    np.savez(tmp_path / "expected.npz", loss=loss, **{k: np.asarray(v) for k, v in params.items()})
    done = run_python(
        f"""
        import sys, numpy as np
        from pool import Pool
        from pool.manifest import load_manifest

        expected = np.load({str(tmp_path / "expected.npz")!r})
        start = np.load({str(tmp_path / "start.npz")!r})

        def ten_steps(run):
            params = {{k: start[k] for k in ("b1", "b2", "w1", "w2")}}
            batch = (start["x"], start["y"])
            for _ in range(10):  # flat leaves: b1, b2, w1, w2 (sorted keys), x, y
                leaves = [params[k] for k in sorted(params)] + list(batch)
                *new, loss = run(leaves)
                params = dict(zip(sorted(params), new))
            for name in params:
                np.testing.assert_allclose(params[name], expected[name], rtol=2e-6, atol=1e-7)
            np.testing.assert_allclose(loss, expected["loss"], rtol=2e-6)

        manifest = load_manifest({str(manifest)!r})
        with Pool(1, devices_per_worker=4) as pool:
            ten_steps(lambda leaves: manifest.run("mlp_step", leaves, pool=pool))
        assert "jax" not in sys.modules  # the workers ran it
        bundled = load_manifest({str(bundle)!r})
        ten_steps(lambda leaves: bundled.run("mlp_step", leaves))
        # In this process, on jaxlib's CPU client: splitting the outputs of a program over
        # several devices makes jaxlib import JAX's core (worker.plugin.jaxlib_cpu.calls).
        print("ok")
        """,
        env=env,
    )
    assert done.stdout.strip().endswith("ok")
    for ran in (  # the command line, from the manifest and from the bundle
        pjrt_pool("run", str(manifest), "mlp_step", "--json", env=env),
        pjrt_pool("run", str(bundle), "mlp_step", "--json", env=env),
        pjrt_pool("run", str(manifest), "mlp_step", "--workers", "1", "--json", env=env),
    ):
        assert ran.returncode == 0, ran.stdout + ran.stderr
        shapes = [o["shape"] for o in json.loads(ran.stdout)["outputs"]]
        assert shapes == [[16], [8], [8, 16], [16, 8], []]


@pytest.mark.parametrize(
    "spec", [P("data", "model"), P("model", None), P(("data", "model")), P(None, "data"), P()]
)
def test_an_abstract_meshs_blocks_are_those_jax_gives_a_real_mesh(spec):
    """A program over an AbstractMesh (no devices to ask) gets each device's block from its
    PartitionSpec; JAX's devices_indices_map on a real mesh of that shape gives the same."""
    from jax.sharding import AbstractMesh

    from pool.lowering.sharding import partitioning_of

    real = make_mesh(jax.devices(), (2, 4))
    abstract = AbstractMesh((2, 4), ("data", "model"))
    shape = (16, 8)

    def blocks(mesh):
        sharding = NamedSharding(mesh, spec)
        return partitioning_of(mesh, [(sharding, shape)], [], "cpu", "").inputs[0].blocks

    assert blocks(abstract) == blocks(real)
