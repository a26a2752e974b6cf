"""Arguments at the boundaries: the native checks, values that do not fit, and every dtype.

- The native module checks each input's byte size against dims x element
  size and its element type before any PJRT call (ValueError), whatever the
  Python side did.
- Values that do not fit the program's dtype are refused for arrays and
  numpy scalars as for lists; converting with .astype first is the way to
  ask for numpy's wrapping and rounding.
- Every dtype the runtime lists round-trips through Executable.run and a Pool.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from cache_helpers import save_program
from conftest import run_python

import pool
import worker
from pool import Pool
from worker.compile.arguments import random_inputs
from worker.dtypes import code_of_dtype, supported_dtypes


def program(dtype, shape=(8,), function=lambda x: x) -> pool.LoweredProgram:
    worker.get_runtime("cpu")
    with jax.enable_x64(True):  # int64, uint64, float64 and complex128 need it
        return pool.lower(function, [jax.ShapeDtypeStruct(shape, dtype)])


@functools.cache
def executable(dtype, shape=(8,)) -> worker.Executable:
    return worker.compile_program(program(dtype, shape, lambda x: x + x), disk_cache=False)[0]


# -- the native checks -----------------------------------------------------------------


def test_run_into_refuses_an_argument_of_another_size():
    f32 = executable(np.float32)
    out = [np.empty(8, np.float32)]
    with pytest.raises(ValueError, match="need 32 bytes, but its buffer has 16 bytes"):
        f32.run_into([np.arange(8, dtype=np.float16)], out)  # float16[8] for f32[8]


def test_execute_refuses_an_element_type_that_does_not_match_the_buffer():
    native = executable(np.float32)._native
    out = [np.empty(8, np.float32)]
    f64 = code_of_dtype(np.float64)
    with pytest.raises(ValueError, match=r"element type 12 .8 bytes each.* buffer has 32 bytes"):
        native.execute([np.arange(8, dtype=np.float32)], [f64], out, True)
    native.execute([np.arange(8, dtype=np.float32)], [code_of_dtype(np.float32)], out, True)
    np.testing.assert_array_equal(out[0], np.arange(8) * 2)


def test_execute_refuses_unknown_element_types_without_crashing(tmp_path):
    # Before the native check, the plugin aborted the process on these codes.
    saved = save_program(program(np.float32, (8,), lambda x: x + x), tmp_path / "f32.json")
    done = run_python(
        f"""
        import sys
        import numpy as np
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import worker
        from cache_helpers import load_program

        executable, _ = worker.compile_program(load_program({str(saved)!r}), disk_cache=False)
        for code in (0, 99, 23, 21):  # INVALID, unknown, TOKEN, S4 (packed)
            try:
                executable._native.execute(
                    [np.zeros(8, np.float32)], [code], [np.empty(8, np.float32)], True
                )
                print(code, "accepted")
            except ValueError as error:
                print(code, "ValueError", error)
        """,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["0", "ValueError"],
        ["99", "ValueError"],
        ["23", "ValueError"],
        ["21", "ValueError"],
    ]
    assert "input 0 has element type 99, which is not a PJRT_Buffer_Type" in lines[1]


# -- values that do not fit ------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "value", "fragment"),
    [
        (np.int8, np.array([1000, 300, -129]), "values range from -129 to 1000"),
        (np.int8, [1000, 300, -129], "values range from -129 to 1000"),
        (np.int8, np.int64(1000), "values range from 1000 to 1000"),
        (np.uint32, np.array([2**40], np.uint64), "and uint32 holds 0 to 4294967295"),
        (np.uint8, np.array([-1, 3]), "values range from -1 to 3"),
        (np.float16, 1e6, "become inf or nan in float16"),
        (np.float16, np.array([1.0, 1e6]), "such as 1000000.0, become inf"),
        (np.float32, np.array([1e300]), "become inf or nan in float32"),
    ],
)
def test_values_that_do_not_fit_are_refused_as_for_lists(dtype, value, fragment):
    shape = np.shape(value)
    target = executable(dtype, shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy overflow warning on the way
        with pytest.raises(TypeError, match=f"argument 0 does not fit {np.dtype(dtype)}") as caught:
            target.run([value])
    assert fragment in str(caught.value) and ".astype" in str(caught.value)


def test_converting_first_is_how_to_ask_for_numpy_conversion():
    int8 = executable(np.int8, (3,))
    wrapped = np.array([1000, 300, -129]).astype(np.int8)  # the caller's explicit choice
    np.testing.assert_array_equal(int8.run([wrapped])[0], wrapped * 2)
    np.testing.assert_array_equal(int8.run([np.array([1, -2, 60])])[0], [2, -4, 120])
    f16 = executable(np.float16, (3,))
    np.testing.assert_array_equal(
        f16.run([np.array([1.5, np.inf, 65504.0])])[0], np.float16([3.0, np.inf, np.inf])
    )


# -- every dtype -------------------------------------------------------------------------


def identity_programs() -> dict[str, pool.LoweredProgram]:
    return {str(dtype): program(dtype, (3, 5)) for dtype in supported_dtypes()}


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()  # NaN-proof, and exact


def test_every_dtype_round_trips_through_executable_run():
    for name, lowered in identity_programs().items():
        (argument,) = random_inputs(lowered.input_types, seed=1)
        identity, _ = worker.compile_program(lowered, disk_cache=False)
        (out,) = identity.run([argument])
        assert_same_bits(out, argument), name


def test_every_dtype_round_trips_through_a_pool_which_refuses_what_does_not_fit():
    programs = identity_programs()
    with Pool(workers=1) as workers:
        for name, lowered in programs.items():
            (argument,) = random_inputs(lowered.input_types, seed=2)
            (out,) = workers.run(lowered, [argument])
            assert_same_bits(out, argument), name
        with pytest.raises(TypeError, match="argument 0 does not fit int8"):
            workers.submit(programs["int8"], [np.full((3, 5), 1000)])


def test_every_entry_point_refuses_arguments_that_are_not_a_sequence():
    # Pool.submit(program, None) raised AttributeError: 'NoneType' object has no
    # attribute 'fd' (an internal error) where Pool.run raised a clear TypeError.
    program = pool.lower(lambda x: x + 1.0, [jax.ShapeDtypeStruct((4,), np.float32)])
    with Pool(1) as workers:
        spec = workers.compile(program)
        for call in (
            lambda: workers.run(program, None),
            lambda: workers.submit(program, None),
            lambda: workers.submit_spec(spec, None),
        ):
            with pytest.raises(TypeError, match="arguments must be a sequence"):
                call()
        assert workers.run(program, [np.zeros(4, np.float32)])[0].tolist() == [1.0] * 4
