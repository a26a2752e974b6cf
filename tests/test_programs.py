"""The Programs API (seed/programs.md) end to end, in this process, on one CPU runtime.

Everything runs on the runtime this process's cpu platform loads: jaxlib's own
client, or the CPU plugin PJRT_POOL_PLUGIN_CPU names. tests/test_second_plugin.py
runs this whole file again under each CPU plugin (lammps-jax-pjrt-cpu, and
xla-cpu-pjrt, PJRT API 0.81), so the few behaviours that differ between
runtimes ask ON_SECOND_PLUGIN (or PLUGIN).
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import ml_dtypes
import numpy as np
import pytest
from conftest import DEFAULT_PLUGIN, SECOND_PLUGIN, run_python

import pool
import worker
from pool import (
    ArrayType,
    CompileStatistics,
    Executable,
    FfiVersionError,
    ForeignExecutableError,
    LoweredProgram,
    MissingCustomCallError,
    PjrtError,
    PlatformMismatchError,
    ProgramSpec,
    compile_options,
    compile_program,
    lower,
)

PLUGIN = (
    os.path.realpath(os.environ["PJRT_POOL_PLUGIN_CPU"])
    if os.environ.get("PJRT_POOL_PLUGIN_CPU")
    else None
)
"""The CPU plugin this process loads for the cpu platform, or None: jaxlib's own client."""

ON_SECOND_PLUGIN = SECOND_PLUGIN is not None and os.path.realpath(SECOND_PLUGIN) == PLUGIN
"""True when this file runs against xla-cpu-pjrt (API 0.81), which cannot run jnp.linalg."""

OTHER_PLUGIN = SECOND_PLUGIN if PLUGIN is not None and not ON_SECOND_PLUGIN else DEFAULT_PLUGIN
"""A CPU plugin other than this process's runtime, for executables from another build."""

SAME_RUNTIME = {"PJRT_POOL_PLUGIN_CPU": PLUGIN or ""}
"""A child's environment for this process's cpu runtime."""

F32 = jnp.float32


def sds(shape: tuple[int, ...], dtype=F32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.fixture(scope="module", autouse=True)
def loaded_plugin(tmp_path_factory: pytest.TempPathFactory):
    """Loads this process's plugin before anything lowers, and checks it is the expected one.

    With the plugin loaded, lower() asks it for its StableHLO window instead
    of probing it in a child process.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PJRT_POOL_CACHE_DIR", str(tmp_path_factory.mktemp("module-cache")))
        patch.setenv("PJRT_POOL_PLUGIN_CPU", PLUGIN or "")
        runtime = worker.get_runtime("cpu")
    if PLUGIN is None:
        assert not runtime.runs_natively, "the cpu platform runs on jaxlib's client by default"
    else:
        assert os.path.realpath(runtime.location.path) == PLUGIN
    assert not jax.config.jax_enable_x64, "these tests expect JAX's default (x64 off)"
    return runtime


def affine(x, y):
    return x * 2.0 + y


@pytest.fixture(scope="module")
def affine_program() -> LoweredProgram:
    return lower(affine, [sds((2, 3)), sds((2, 3))])


@pytest.fixture(scope="module")
def affine_executable(affine_program: LoweredProgram) -> Executable:
    executable, _ = compile_program(affine_program, disk_cache=False)
    return executable


X = np.arange(6, dtype=np.float32).reshape(2, 3)
Y = np.full((2, 3), 0.5, dtype=np.float32)


# -- names ---------------------------------------------------------------------

SEED_NAMES = (
    "lower",
    "ArrayType",
    "LoweredProgram",
    "compile_program",
    "CompileStatistics",
    "compile_options",
    "Executable",
)
WORKER_NAMES = (
    *SEED_NAMES[1:],  # all but lower
    "ProgramSpec",
    "register_custom_call",
    "PjrtError",
    "PluginLoadError",
    "PluginNotFoundError",
    "PlatformMismatchError",
    "MissingCustomCallError",
    "FfiVersionError",
    "ForeignExecutableError",
)


def test_seed_names_import_from_pool_and_worker_names_from_worker():
    for name in SEED_NAMES + WORKER_NAMES:
        assert name in pool.__all__, name
        assert getattr(pool, name) is not None
    for name in WORKER_NAMES:
        assert name in worker.__all__, name
        assert getattr(pool, name) is getattr(worker, name), name
    assert "lower" not in worker.__all__  # the worker side never imports jax


# -- lower -----------------------------------------------------------------------


def test_lower_records_types_platform_and_code(affine_program: LoweredProgram):
    program = affine_program
    assert isinstance(program, LoweredProgram)
    assert isinstance(program.code, bytes) and program.code.startswith(b"ML\xefR")
    assert "func.func public @main" in program.text
    assert "loc(" not in program.text  # the cache key text leaves source locations out
    assert program.input_types == (ArrayType(np.dtype(np.float32), (2, 3)),) * 2
    assert program.platform == jax.devices()[0].platform == "cpu"
    assert pool.lowering_platform([sds((2, 3))]) == "cpu"


def test_lower_takes_arrays_as_shapes():
    numpy_arg = np.zeros((4,), np.int32)
    jax_arg = jax.device_put(jnp.ones((2, 2), jnp.float16), jax.devices("cpu")[0])
    program = lower(lambda a, b: (a + 1, b * 2), [numpy_arg, jax_arg])
    assert program.input_types == (
        ArrayType(np.dtype(np.int32), (4,)),
        ArrayType(np.dtype(np.float16), (2, 2)),
    )
    assert program.platform == "cpu"  # the committed array's platform
    executable, _ = compile_program(program)
    a, b = executable.run([numpy_arg, np.asarray(jax_arg)])
    np.testing.assert_array_equal(a, np.ones(4, np.int32))
    assert b.dtype == np.float16
    np.testing.assert_array_equal(b, np.full((2, 2), 2, np.float16))


def test_lower_keeps_unused_arguments():
    program = lower(
        lambda x, unused, also_unused: x + 1, [sds((2,)), sds((3,)), sds((), jnp.int32)]
    )
    assert len(program.input_types) == 3
    assert "%arg2" in program.text
    executable, _ = compile_program(program)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        executable.run([np.zeros(2)])
    (out,) = executable.run([np.zeros(2), np.zeros(3), 7])
    np.testing.assert_array_equal(out, [1.0, 1.0])


def test_lower_records_a_named_platform():
    assert lower(affine, [sds((2,)), sds((2,))], platform="cpu").platform == "cpu"
    # Lowering needs no device of the platform; compiling does (see the mismatch test).
    program = lower(affine, [sds((2,)), sds((2,))], platform="cuda")
    assert program.platform == "cuda"
    assert program.input_types == (ArrayType(np.dtype(np.float32), (2,)),) * 2


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.uint64, np.complex128])
def test_lower_refuses_64_bit_types_without_x64(dtype):
    with pytest.raises(TypeError, match=rf"shapes\[1\] is {np.dtype(dtype).name}.*jax_enable_x64"):
        lower(affine, [sds((2,)), sds((2,), dtype)])


def test_lower_refuses_a_float64_numpy_array_without_x64():
    with pytest.raises(TypeError, match=r"shapes\[0\] is float64.*jax_enable_x64"):
        lower(lambda x: x, [np.ones(3)])


def test_lower_with_x64_on_traces_64_bit_types():
    # A child process, so that the setting does not leak into this one.
    done = run_python(
        """
        import json
        import jax
        jax.config.update("jax_enable_x64", True)
        import numpy as np
        import pool

        program = pool.lower(
            lambda x, n: (x + 1e-12, n * 3),
            [jax.ShapeDtypeStruct((2,), np.float64), jax.ShapeDtypeStruct((), np.int64)],
        )
        executable, _ = pool.compile_program(program)
        x, n = executable.run([np.ones(2), 2**40])
        print(json.dumps({
            "inputs": [str(t) for t in program.input_types],
            "outputs": [str(t) for t in executable.output_types],
            "x_moved": bool((x != 1.0).all()),
            "n": int(n),
        }))
        """,
        env=SAME_RUNTIME,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "inputs": ["float64[2]", "int64[]"],
        "outputs": ["float64[2]", "int64[]"],
        "x_moved": True,  # 1 + 1e-12 is 1.0 in float32
        "n": 3 * 2**40,  # overflows int32
    }


@pytest.mark.parametrize(
    ("function", "shapes", "kwargs", "message"),
    [
        (42, [sds((2,))], {}, "function must be callable, not int"),
        (affine, sds((2,)), {}, "shapes must be a sequence"),
        (affine, [sds((2,)), "3"], {}, r"shapes\[1\] must be a jax.ShapeDtypeStruct, an array"),
        (affine, [sds((2,)), sds((2,))], {"custom_calls": "my_target"}, "not one str"),
        (lambda s: s, [np.array(["a", "b"])], {}, r"shapes\[0\]: dtype <U1 is not supported"),
    ],
    ids=["not-callable", "one-shape", "not-a-shape", "custom-calls-str", "string-dtype"],
)
def test_lower_bad_input_raises_type_error(function, shapes, kwargs, message):
    with pytest.raises(TypeError, match=message):
        lower(function, shapes, **kwargs)


def test_lower_passes_on_jax_errors_for_wrong_argument_counts():
    with pytest.raises(TypeError, match="positional argument"):
        lower(lambda x: x, [sds((2,)), sds((2,))])


def test_custom_calls_names_the_targets_lower_lets_through():
    target = "pjrt_pool_programs_test_target"

    def function(x):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    with pytest.raises(ValueError, match="no compatibility guarantees"):
        lower(function, [sds((3,))])
    program = lower(function, [sds((3,))], custom_calls=[target])
    assert f"stablehlo.custom_call @{target}" in program.text
    # Nothing registered a handler for it in this process.
    with pytest.raises(MissingCustomCallError, match=f"no handler for custom call '{target}'"):
        compile_program(program)


def test_linalg_needs_no_custom_call_entry():
    program = lower(
        lambda a, b: (jnp.linalg.solve(a, b), jnp.linalg.cholesky(a)), [sds((3, 3)), sds((3,))]
    )
    assert "lapack_" in program.text
    a = np.array([[4.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]], np.float32)
    b = np.array([1.0, 2.0, 3.0], np.float32)
    if ON_SECOND_PLUGIN:
        # jaxlib's LAPACK kernels (XLA FFI 0.3 and later) are newer than this
        # plugin's XLA (0.2): refused before compiling, with one clear error.
        with pytest.raises(FfiVersionError) as caught:
            compile_program(program)
        message = str(caught.value)
        assert "lapack_" in message and "PJRT API 0.81, XLA FFI 0.2" in message
        assert "takes handlers of XLA FFI 0.2 or older" in message
        assert f"jaxlib {jaxlib.__version__}" in message
        assert "unset PJRT_POOL_PLUGIN_CPU to run on" in message  # jaxlib's own client instead
        assert caught.value.code_name == "FAILED_PRECONDITION"
        assert isinstance(caught.value, MissingCustomCallError)
        return
    executable, _ = compile_program(program)
    x, chol = executable.run([a, b])
    np.testing.assert_allclose(x, np.linalg.solve(a, b), rtol=1e-5)
    np.testing.assert_allclose(chol, np.linalg.cholesky(a), rtol=1e-5)


@pytest.mark.skipif(ON_SECOND_PLUGIN, reason="the 0.81 plugin cannot run jnp.linalg")
def test_a_cached_linalg_executable_loads_in_a_fresh_process_without_jax(tmp_path: Path):
    program = lower(jnp.linalg.inv, [sds((3, 3))])
    assert compile_program(program)[1].compiled == 1
    saved = tmp_path / "program.pickle"
    saved.write_bytes(pickle.dumps(program))
    done = run_python(
        f"""
        import json, pickle, sys
        import numpy as np
        from worker import compile_program
        program = pickle.loads(open({str(saved)!r}, "rb").read())
        executable, stats = compile_program(program)
        (out,) = executable.run([np.eye(3) * 2])
        print(json.dumps({{"loaded": stats.loaded, "out": out.tolist(),
                          "jax": "jax" in sys.modules}}))
        """,
        env=SAME_RUNTIME,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"loaded": 1, "out": (np.eye(3) / 2).tolist(), "jax": False}


# -- ArrayType and LoweredProgram ---------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "shape", "size", "nbytes"),
    [
        (np.float32, (2, 3), 6, 24),
        (np.float64, (), 1, 8),
        (np.int8, (0, 5), 0, 0),
        (ml_dtypes.bfloat16, (4,), 4, 8),
        (np.bool_, (3, 1), 3, 3),
        (np.complex64, (2,), 2, 16),
    ],
)
def test_array_type_size_and_nbytes(dtype, shape, size, nbytes):
    array_type = ArrayType(np.dtype(dtype), shape)
    assert (array_type.size, array_type.nbytes) == (size, nbytes)
    assert isinstance(array_type.size, int) and isinstance(array_type.nbytes, int)
    assert array_type.nbytes == np.zeros(shape, dtype).nbytes
    assert array_type.dtype == array_type[0] and array_type.shape == array_type[1]


def test_lowered_program_fields_and_defaults(affine_program: LoweredProgram):
    # The seed's four fields first and in order; fields added since come after them.
    assert LoweredProgram._fields == (
        "code",
        "text",
        "input_types",
        "platform",
        "partitioning",
        "compile_options",
    )
    bare = LoweredProgram(affine_program.code, affine_program.text)
    assert bare.input_types is None and bare.platform is None and bare.partitioning is None
    assert bare.compile_options is None
    # Without input types the executable takes arguments as they come.
    executable, _ = compile_program(bare)
    assert executable.input_types is None
    (out,) = executable.run([X, Y])
    np.testing.assert_array_equal(out, X * 2 + Y)
    with pytest.raises(PjrtError, match="size"):  # float64 is not converted: the plugin refuses
        executable.run([X.astype(np.float64), Y.astype(np.float64)])


# -- compile_program, CompileStatistics, compile_options ----------------------------


def test_compile_program_compiles_then_loads_from_the_disk_cache(
    affine_program: LoweredProgram, cache_dir: Path
):
    first, stats = compile_program(affine_program)
    assert (stats.compiled, stats.loaded) == (1, 0)
    assert stats.compile_seconds > 0 and stats.load_seconds == 0
    assert (cache_dir / "entries" / f"{first.key}.pjx").is_file()

    second, stats = compile_program(affine_program)
    assert (stats.compiled, stats.loaded) == (0, 1)
    assert stats.load_seconds > 0 and stats.compile_seconds == 0
    assert second.key == first.key
    assert second.input_types == affine_program.input_types
    for executable in (first, second):
        (out,) = executable.run([X, Y])
        np.testing.assert_array_equal(out, X * 2 + Y)


def test_disk_cache_false_always_compiles(affine_program: LoweredProgram, cache_dir: Path):
    for _ in range(2):
        executable, stats = compile_program(affine_program, disk_cache=False)
        assert (stats.compiled, stats.loaded) == (1, 0)
    assert not list(cache_dir.glob("entries/*.pjx"))
    compile_program(affine_program)  # now an entry exists ...
    _, stats = compile_program(affine_program, disk_cache=False)
    assert (stats.compiled, stats.loaded) == (1, 0)  # ... and is still not used
    np.testing.assert_array_equal(executable.run([X, Y])[0], X * 2 + Y)


def test_cache_dir_argument_names_the_cache(
    affine_program: LoweredProgram, cache_dir: Path, tmp_path: Path
):
    mine = tmp_path / "mine"
    executable, stats = compile_program(affine_program, cache_dir=str(mine))
    assert stats.compiled == 1
    assert (mine / "entries" / f"{executable.key}.pjx").is_file()
    assert not list(cache_dir.glob("entries/*.pjx"))  # not the environment's directory
    assert compile_program(affine_program, cache_dir=str(mine))[1].loaded == 1
    assert compile_program(affine_program)[1].compiled == 1  # the default cache is empty


def test_compile_program_converts_arguments_to_the_program_types(affine_executable: Executable):
    assert affine_executable.input_types == (ArrayType(np.dtype(np.float32), (2, 3)),) * 2
    (out,) = affine_executable.run([X.astype(np.float64), [[1, 1, 1], [1, 1, 1]]])
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, X * 2 + 1)


@pytest.mark.parametrize("program", [b"code", ("code", "text"), None, {"code": b"x"}])
def test_compile_program_takes_only_lowered_programs(program):
    with pytest.raises(TypeError, match="takes a LoweredProgram.*not " + type(program).__name__):
        compile_program(program)


def test_compile_program_rejects_empty_code_and_text(affine_program: LoweredProgram):
    with pytest.raises(ValueError, match="code is empty"):
        compile_program(affine_program._replace(code=b""))
    with pytest.raises(ValueError, match="text is empty"):
        compile_program(affine_program._replace(text=""))


def test_compile_program_for_another_platform_raises_platform_mismatch():
    program = lower(affine, [sds((2,)), sds((2,))], platform="cuda")
    with pytest.raises(PlatformMismatchError, match=r"platform 'cuda'.*'cpu' plugin loaded"):
        compile_program(program)


def test_garbage_bytecode_raises_pjrt_error_with_a_code(affine_program: LoweredProgram):
    for call in (
        lambda: Executable.compile(b"this is not StableHLO", compile_options()),
        lambda: compile_program(affine_program._replace(code=b"ML\xefR garbage")),
    ):
        # The failing call is named: a plugin's C API function, or jaxlib's binding.
        with pytest.raises(PjrtError, match=r"PJRT_Client_Compile|compile_and_load") as caught:
            call()
        assert isinstance(caught.value.code, int) and caught.value.code != 0
        assert isinstance(caught.value.code_name, str) and caught.value.code_name.isupper()


def test_executable_compile_refuses_empty_or_non_bytes_input(affine_program: LoweredProgram):
    with pytest.raises(ValueError, match="code is empty"):
        Executable.compile(b"", compile_options())
    with pytest.raises(TypeError, match="code must be bytes, not str"):
        Executable.compile(affine_program.text, compile_options())
    with pytest.raises(TypeError, match="compile_options must be bytes, not NoneType"):
        Executable.compile(affine_program.code, None)


def test_compile_statistics_defaults_and_add():
    assert CompileStatistics() == (0.0, 0.0, 0, 0)
    assert CompileStatistics._fields == ("compile_seconds", "load_seconds", "compiled", "loaded")
    total = CompileStatistics(1.5, 0.25, 2, 1).add(CompileStatistics(0.5, 0.5, 1, 3))
    assert isinstance(total, CompileStatistics)
    assert total == CompileStatistics(compile_seconds=2.0, load_seconds=0.75, compiled=3, loaded=4)


def test_compile_options_are_the_six_bytes_and_cached():
    options = compile_options()
    assert options == bytes.fromhex("1a0420012801")
    assert compile_options() is options


# -- Executable ----------------------------------------------------------------------


def many_outputs(x, n):
    return x.T, jnp.sum(x), n > 0, x[:0]


@pytest.fixture(scope="module")
def many_outputs_executable() -> Executable:
    program = lower(many_outputs, [sds((2, 3)), sds((4,), jnp.int32)])
    return compile_program(program, disk_cache=False)[0]


def test_executable_reports_outputs(many_outputs_executable: Executable):
    executable = many_outputs_executable
    assert executable.num_outputs == 4
    assert executable.output_types == (
        ArrayType(np.dtype(np.float32), (3, 2)),
        ArrayType(np.dtype(np.float32), ()),
        ArrayType(np.dtype(np.bool_), (4,)),
        ArrayType(np.dtype(np.float32), (0, 3)),
    )
    assert executable.output_bytes == (24, 4, 4, 0)
    assert executable.input_types == (
        ArrayType(np.dtype(np.float32), (2, 3)),
        ArrayType(np.dtype(np.int32), (4,)),
    )


def test_run_returns_multiple_scalar_and_empty_outputs(many_outputs_executable: Executable):
    transposed, total, positive, empty = many_outputs_executable.run([X, [1, -1, 0, 5]])
    np.testing.assert_array_equal(transposed, X.T)
    assert total.shape == () and total.dtype == np.float32 and float(total) == 15.0
    np.testing.assert_array_equal(positive, [True, False, False, True])
    assert empty.shape == (0, 3) and empty.dtype == np.float32


def test_zero_size_inputs_and_outputs():
    program = lower(lambda a, b: (a * 2, jnp.sum(a), b), [sds((0, 4)), sds((3, 0), jnp.int32)])
    executable, _ = compile_program(program)
    doubled, total, same = executable.run([np.zeros((0, 4)), np.zeros((3, 0), np.int32)])
    assert doubled.shape == (0, 4) and same.shape == (3, 0) and same.dtype == np.int32
    assert float(total) == 0.0
    assert executable.output_bytes == (0, 4, 0)


@pytest.mark.parametrize(
    ("dtype", "values", "expected"),
    [
        (np.bool_, [True, False, True], [False, True, False]),
        (np.int8, [-128, 0, 126], [-127, 1, 127]),
        (np.uint8, [0, 1, 254], [1, 2, 255]),
        (np.int16, [-5, 0, 5], [-4, 1, 6]),
        (np.int32, [-(2**31), 0, 2**30], [-(2**31) + 1, 1, 2**30 + 1]),
        (np.uint32, [0, 7, 2**32 - 2], [1, 8, 2**32 - 1]),
        (np.float16, [0.5, -1.0, 2.0], [1.5, 0.0, 3.0]),
        (ml_dtypes.bfloat16, [0.5, -1.0, 128.0], [1.5, 0.0, 129.0]),
        (np.complex64, [1 + 2j, 0, -1j], [2 + 2j, 1, 1 - 1j]),
    ],
    ids=lambda v: np.dtype(v).name if isinstance(v, type) else None,
)
def test_run_round_trips_dtypes(dtype, values, expected):
    def step(x):
        return jnp.logical_not(x) if x.dtype == jnp.bool_ else x + jnp.ones((), x.dtype)

    program = lower(step, [sds((3,), dtype)])
    executable, _ = compile_program(program)
    assert executable.output_types == (ArrayType(np.dtype(dtype), (3,)),)
    arguments = [np.array(values, dtype)]
    if np.dtype(dtype).kind != "u":  # see test_run_takes_python_ints_for_unsigned_inputs
        arguments.append(values)  # a list converts to the program's dtype
    for argument in arguments:
        (out,) = executable.run([argument])
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out, np.array(expected, dtype))


def test_run_takes_python_ints_for_unsigned_inputs_by_value():
    program = lower(lambda x: x + jnp.ones((), x.dtype), [sds((3,), jnp.uint8)])
    executable, _ = compile_program(program)
    (out,) = executable.run([[0, 1, 254]])
    np.testing.assert_array_equal(out, np.array([1, 2, 255], np.uint8))


def test_run_refuses_python_ints_that_do_not_fit():
    program = lower(lambda x: x + jnp.ones((), x.dtype), [sds((1,), jnp.int8)])
    executable, _ = compile_program(program)
    with pytest.raises(TypeError, match="does not fit int8"):
        executable.run([[1000]])


def test_run_refuses_complex_for_bfloat16_inputs():
    program = lower(lambda x: x * 2, [sds((2,), jnp.bfloat16)])
    executable, _ = compile_program(program)
    with pytest.raises(TypeError, match="imaginary part would be lost"):
        executable.run([np.array([1 + 2j, 3j])])


def test_run_with_and_without_zero_copy_gives_the_same_results():
    program = lower(lambda x, y: (x * 3 + y, x[::-1]), [sds((4096,)), sds((4096,))])
    executable, _ = compile_program(program)
    # Small integers: exact in float32 whether or not the plugin fuses multiply-add.
    x = np.arange(-2048, 2048, dtype=np.float32)
    y = np.arange(4096, dtype=np.float32) * 0.5
    storage = np.zeros(4096 + 1, np.float32)
    misaligned = storage[1:]  # 4 bytes off any 64-byte boundary: PJRT must copy it
    misaligned[:] = x
    strided = np.repeat(x, 2)[::2]  # not contiguous
    expected = [x * 3 + y, x[::-1]]
    for zero_copy in (True, False):
        for argument in (x, misaligned, strided):
            outputs = executable.run([argument, y], zero_copy=zero_copy)
            for out, want in zip(outputs, expected, strict=True):
                np.testing.assert_array_equal(out, want)


def test_outputs_do_not_alias_inputs():
    program = lower(lambda x: x, [sds((1024,))])
    executable, _ = compile_program(program)
    x = np.ones(1024, np.float32)
    (out,) = executable.run([x], zero_copy=True)
    x[:] = 7.0
    np.testing.assert_array_equal(out, np.ones(1024, np.float32))
    out[:] = 3.0  # the outputs are the caller's own, writable arrays
    np.testing.assert_array_equal(x, np.full(1024, 7.0, np.float32))


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ([], TypeError, r"takes 2 arguments \(float32\[2,3\], float32\[2,3\]\) but 0 were given"),
        ([X, Y, Y], TypeError, "takes 2 arguments .* but 3 were given"),
        ([X, Y.T], ValueError, r"argument 1 has shape \(3, 2\) but the program takes"),
        ([X, 1.0], ValueError, r"argument 1 has shape \(\) but the program takes"),
        ([X + 1j, Y], TypeError, "argument 0 is complex .complex64. but the program takes float32"),
        ([X, np.full((2, 3), "a")], TypeError, "argument 1 has dtype <U1, which does not convert"),
        ([X, np.full((2, 3), None)], TypeError, "argument 1 has dtype object"),
        (X, TypeError, "arguments must be a sequence .* not ndarray"),
        ("xy", TypeError, "arguments must be a sequence .* not str"),
        (None, TypeError, "arguments must be a sequence .* not NoneType"),
    ],
    ids=[
        "none",
        "too-many",
        "wrong-shape",
        "scalar-for-array",
        "complex",
        "strings",
        "objects",
        "one-array",
        "str",
        "None",
    ],
)
def test_run_refuses_bad_arguments(affine_executable: Executable, arguments, error, message):
    with pytest.raises(error, match=message):
        affine_executable.run(arguments)


def test_run_refuses_ragged_nested_lists(affine_executable: Executable):
    with pytest.raises((TypeError, ValueError), match="argument 1"):
        affine_executable.run([X, [[1.0, 2.0], [3.0]]])


def test_executable_compile_takes_arguments_as_they_come(affine_program: LoweredProgram):
    executable = Executable.compile(affine_program.code, compile_options())
    assert executable.input_types is None and executable.key is None
    assert executable.num_outputs == 1
    assert executable.output_types == (ArrayType(np.dtype(np.float32), (2, 3)),)
    assert executable.output_bytes == (24,)
    np.testing.assert_array_equal(executable.run([X, Y])[0], X * 2 + Y)


def test_serialize_and_deserialize_round_trip(many_outputs_executable: Executable):
    serialized = many_outputs_executable.serialize()
    assert isinstance(serialized, bytes) and len(serialized) > 100
    loaded = Executable.deserialize(serialized)
    assert loaded.input_types is None  # the bytes carry no argument types
    assert loaded.num_outputs == 4
    assert loaded.output_types == many_outputs_executable.output_types
    n = np.array([3, 0, -2, 1], np.int32)
    for got, want in zip(loaded.run([X, n]), many_outputs_executable.run([X, n]), strict=True):
        np.testing.assert_array_equal(got, want)
    assert Executable.deserialize(bytearray(serialized)).num_outputs == 4


def test_deserialize_refuses_bad_bytes():
    with pytest.raises(PjrtError, match=r"Deserialize|deserialize_executable") as caught:
        Executable.deserialize(b"not an executable")
    assert isinstance(caught.value.code, int) and isinstance(caught.value.code_name, str)
    with pytest.raises(ValueError, match="serialized is empty"):
        Executable.deserialize(b"")
    with pytest.raises(TypeError, match="serialized must be bytes, not str"):
        Executable.deserialize("bytes please")


@pytest.mark.skipif(OTHER_PLUGIN is None, reason="needs both CPU plugins installed")
def test_deserialize_refuses_an_executable_from_another_plugin(tmp_path: Path):
    # Serialized bytes are the plugin's own now (libtpu refuses any extra field): the
    # default plugin refuses the other build's executable itself. (The 0.81 plugin loads
    # the 0.115 plugin's and computes wrongly: the cache's and bundles' keys, which name
    # the plugin build, keep that from ever happening through them.)
    if ON_SECOND_PLUGIN:
        pytest.skip("the 0.81 plugin does not refuse another build's executable")
    # jaxlib's client refuses it at its metadata, or at the proto after it (as its build reads it)
    refusal = (
        "Invalid target machine features"
        if PLUGIN is not None
        else "ExecutableMetadata|DeserializeExecutable proto deserialization failed"
    )
    path = tmp_path / "foreign.bin"
    run_python(
        f"""
        import jax, pool
        program = pool.lower(lambda x: x + 1, [jax.ShapeDtypeStruct((3,), "float32")])
        executable, _ = pool.compile_program(program, disk_cache=False)
        open({str(path)!r}, "wb").write(executable.serialize())
        """,
        env={"PJRT_POOL_PLUGIN_CPU": OTHER_PLUGIN},
    )
    with pytest.raises(PjrtError, match=refusal):
        Executable.deserialize(path.read_bytes())


def test_serialize_gives_exactly_the_plugins_bytes(many_outputs_executable: Executable):
    from worker.compile.stamp import read_stamp

    serialized = many_outputs_executable.serialize()
    assert read_stamp(serialized) is None  # nothing appended to what the plugin gave
    if not ON_SECOND_PLUGIN:  # (the 0.81 plugin's serializations of one executable differ)
        assert serialized == many_outputs_executable.native.serialize()


def test_bytes_an_older_version_stamped_for_another_build_are_refused(
    many_outputs_executable: Executable,
):
    from worker.compile.stamp import stamp

    serialized = many_outputs_executable.serialize()
    foreign = stamp(serialized, {"plugin_sha256": "0" * 64})
    with pytest.raises(ForeignExecutableError, match="another PJRT plugin build") as caught:
        Executable.deserialize(foreign)
    assert "compile the program again" in str(caught.value)
    # Stamped for this build, they load without the stamp (the plugin sees its own bytes).
    runtime = worker.get_runtime()
    own = stamp(serialized, runtime.identity())
    assert Executable.deserialize(own).num_outputs == many_outputs_executable.num_outputs


# -- ProgramSpec --------------------------------------------------------------------


def test_program_spec_from_executable_and_json_round_trips(many_outputs_executable: Executable):
    spec = ProgramSpec.from_executable("many", many_outputs_executable)
    assert spec.name == "many" and spec.platform == "cpu"
    assert spec.key == many_outputs_executable.key and len(spec.key) == 64
    assert spec.input_types == many_outputs_executable.input_types
    assert spec.output_types == many_outputs_executable.output_types
    assert spec.output_bytes == (24, 4, 4, 0)
    data = spec.to_json()
    assert json.loads(json.dumps(data)) == data  # plain JSON
    assert ProgramSpec.from_json(data) == spec
    text = spec.dumps()
    assert json.loads(text)["output_bytes"] == [24, 4, 4, 0]
    assert ProgramSpec.loads(text) == spec


def test_program_spec_round_trips_unknown_inputs_and_narrow_dtypes():
    spec = ProgramSpec(
        name="narrow",
        platform="cpu",
        key="ab" * 32,
        input_types=None,
        output_types=(ArrayType(np.dtype(ml_dtypes.bfloat16), (2, 2)),),
        output_bytes=(8,),
    )
    again = ProgramSpec.loads(spec.dumps())
    assert again == spec and again.input_types is None
    assert again.output_types[0].dtype == np.dtype(ml_dtypes.bfloat16)


def test_program_spec_needs_an_executable_from_compile_program(affine_program: LoweredProgram):
    executable = Executable.compile(affine_program.code, compile_options())
    with pytest.raises(ValueError, match="no cache key: make it with compile_program"):
        ProgramSpec.from_executable("affine", executable)


GOOD_SPEC = {
    "name": "f",
    "platform": "cpu",
    "key": "00" * 32,
    "input_types": [{"dtype": "float32", "shape": [2]}],
    "output_types": [{"dtype": "float32", "shape": [2]}],
    "output_bytes": [8],
}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "invalid literal"),
        ("{}", "not a ProgramSpec record: KeyError"),
        (json.dumps({**GOOD_SPEC, "output_types": None}), "not a ProgramSpec record"),
        (
            json.dumps({**GOOD_SPEC, "input_types": [{"dtype": "float99", "shape": [2]}]}),
            "not a ProgramSpec record.*float99",
        ),
        (
            json.dumps({**GOOD_SPEC, "output_types": [{"dtype": "float32", "shape": [-1]}]}),
            "not a ProgramSpec record.*non-negative",
        ),
        (json.dumps({**GOOD_SPEC, "output_bytes": ["many"]}), "not a ProgramSpec record"),
    ],
    ids=["not-json", "empty", "null-outputs", "bad-dtype", "negative-axis", "bad-bytes"],
)
def test_program_spec_refuses_bad_json(text, message):
    assert ProgramSpec.loads(json.dumps(GOOD_SPEC)).output_bytes == (8,)
    with pytest.raises(ValueError, match=message):
        ProgramSpec.loads(text)


# -- the GIL ---------------------------------------------------------------------


def longest_stall(call) -> tuple[float, float]:
    """Runs call() here while another thread ticks; returns (call seconds, longest tick gap).

    If call() held the GIL for its native part, the ticking thread would stall
    for about that long.
    """
    stop = threading.Event()
    gaps: list[float] = [0.0]
    started = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        started.set()
        while not stop.is_set():
            now = time.perf_counter()
            gaps[0] = max(gaps[0], now - last)
            last = now

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    started.wait()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    stop.set()
    ticker.join()
    return seconds, gaps[0]


def test_compile_releases_the_gil():
    def big(x):
        for i in range(30):
            x = jnp.sin(x @ x.T + i) * jnp.cos(x[::-1] + i)
        return x

    program = lower(big, [sds((16, 16))])
    seconds, stall = longest_stall(lambda: compile_program(program, disk_cache=False))
    assert seconds > 0.2, "the program compiled too fast to tell"
    assert stall < seconds / 2, f"another thread stalled {stall:.3f} s of a {seconds:.3f} s compile"


def test_execute_releases_the_gil():
    program = lower(
        lambda x, n: jax.lax.fori_loop(0, n, lambda i, v: v * 0.999 + 0.001, x),
        [sds((1024,)), sds((), jnp.int32)],
    )
    executable, _ = compile_program(program)
    x = np.ones(1024, np.float32)
    seconds, stall = longest_stall(lambda: executable.run([x, 4_000_000]))
    assert seconds > 0.2, "the program ran too fast to tell"
    assert stall < seconds / 2, f"another thread stalled {stall:.3f} s of a {seconds:.3f} s run"
