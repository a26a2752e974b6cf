"""Third-party custom calls: typed XLA FFI handlers from a library built for the tests.

The library (tests/ffi/handlers.cc, built once per session by the
ffi_library fixture) exports ``add_one`` and ``null_deref``, which report XLA
FFI 0.1, and add_one reporting 0.5 and 0.9. Handlers are registered with this
process's runtime, jaxlib's own CPU client (the cpu platform's), under target
names unique to each test, since the registry lasts as long as the process.

Every registration is checked against the XLA FFI version of the runtime's
XLA (issue 20): jaxlib's refuses a newer handler itself; a PJRT plugin's
would drop it without an error, so pjrt-pool reads both versions and refuses
it, except an FFI 0.5 handler on an FFI 0.4 plugin, which runs through an
adapter. The plugins' side runs in children (a process holds one runtime):
the default CPU plugin (lammps-jax-pjrt-cpu, FFI 0.4) and xla-cpu-pjrt
(FFI 0.2).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from conftest import DEFAULT_PLUGIN, SECOND_PLUGIN, run_python

import pool
from pool import (
    FfiVersionError,
    MissingCustomCallError,
    PjrtError,
    compile_program,
    lower,
    register_custom_call,
)


def calls(target: str):
    """A function whose result is target(x), same shape and dtype as x."""

    def function(x):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    return function


def address_of(library: Path, symbol: str) -> int:
    return ctypes.cast(getattr(ctypes.CDLL(str(library)), symbol), ctypes.c_void_p).value


def capsule_of(address: int) -> object:
    """A PyCapsule holding the handler, as FFI libraries' registrations() return them."""
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(address, b"xla._CUSTOM_CALL_TARGET", None)


@pytest.fixture(scope="module", autouse=True)
def runtime(tmp_path_factory: pytest.TempPathFactory):
    """These tests register with the cpu platform's runtime, jaxlib's own client."""
    import pool as _pool  # noqa: F401  (jax first, as a user would)
    from worker import get_runtime

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PJRT_POOL_CACHE_DIR", str(tmp_path_factory.mktemp("module-cache")))
        patch.delenv("PJRT_POOL_PLUGIN_CPU", raising=False)
        loaded = get_runtime("cpu")
    assert not loaded.runs_natively, "this process's cpu runtime is not jaxlib's client"
    return loaded


def test_handler_registered_by_address_runs(ffi_library: Path):
    register_custom_call("pjrt_pool_test_add_one_address", address_of(ffi_library, "add_one"))
    program = lower(
        calls("pjrt_pool_test_add_one_address"),
        [jax.ShapeDtypeStruct((5,), jnp.float32)],
        custom_calls=["pjrt_pool_test_add_one_address"],
    )
    assert "custom_call @pjrt_pool_test_add_one_address" in program.text
    executable, _ = compile_program(program)
    (out,) = executable.run([np.arange(5)])
    np.testing.assert_array_equal(out, np.arange(1, 6, dtype=np.float32))


def test_handler_registered_as_a_capsule_runs(ffi_library: Path):
    target = "pjrt_pool_test_add_one_capsule"
    register_custom_call(target, capsule_of(address_of(ffi_library, "add_one")))
    # The custom call inside a larger program, with other inputs and outputs around it.
    program = lower(
        lambda x, y: (calls(target)(x * 2) + y, y),
        [jax.ShapeDtypeStruct((2, 3), jnp.float32), jax.ShapeDtypeStruct((2, 3), jnp.float32)],
        custom_calls=[target],
    )
    executable, _ = compile_program(program)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = np.full((2, 3), 10, np.float32)
    out, same = executable.run([x, y])
    np.testing.assert_array_equal(out, x * 2 + 1 + y)
    np.testing.assert_array_equal(same, y)
    # A cached executable that calls the handler loads and runs too.
    loaded, stats = compile_program(program)
    assert stats.loaded == 1
    np.testing.assert_array_equal(loaded.run([x, y])[0], x * 2 + 1 + y)


def test_a_handler_given_the_wrong_dtype_fails_at_run_time(ffi_library: Path):
    target = "pjrt_pool_test_add_one_typed"
    register_custom_call(target, address_of(ffi_library, "add_one"))
    program = lower(calls(target), [jax.ShapeDtypeStruct((3,), jnp.int32)], custom_calls=[target])
    executable, _ = compile_program(program)
    with pytest.raises(PjrtError, match="add_one: wrong buffer dtype: expected F32"):
        executable.run([np.arange(3)])


def test_an_unregistered_target_raises_missing_custom_call():
    target = "pjrt_pool_test_never_registered"
    program = lower(calls(target), [jax.ShapeDtypeStruct((3,), jnp.float32)], custom_calls=[target])
    with pytest.raises(MissingCustomCallError) as caught:
        compile_program(program)
    message = str(caught.value)
    assert f"no handler for custom call {target!r}" in message
    assert "register_custom_call" in message  # what to do
    assert isinstance(caught.value, PjrtError) and caught.value.code_name == "NOT_FOUND"


def test_an_unlisted_third_party_target_fails_in_lower():
    target = "pjrt_pool_test_unlisted"
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility") as e:
        lower(calls(target), [jax.ShapeDtypeStruct((3,), jnp.float32)])
    assert f"@{target}" in str(e.value)


@pytest.mark.parametrize(
    ("name", "handler", "error", "message"),
    [
        ("", 1234, TypeError, "non-empty str"),
        (b"add_one", 1234, TypeError, "non-empty str"),
        ("pjrt_pool_test_bad", "add_one", TypeError, "PyCapsule or an integer address, not str"),
        ("pjrt_pool_test_bad", None, TypeError, "PyCapsule or an integer address, not NoneType"),
        ("pjrt_pool_test_bad", 0, ValueError, "address is 0"),
    ],
    ids=["empty-name", "bytes-name", "str-handler", "None-handler", "null-address"],
)
def test_register_custom_call_refuses_bad_input(name, handler, error, message):
    with pytest.raises(error, match=message):
        register_custom_call(name, handler)


def test_null_deref_handler_kills_its_process(ffi_library: Path):
    # Only ever in a child: the crash is real (the Pool isolates it in a worker).
    done = run_python(
        f"""
        import ctypes, sys
        import jax, numpy as np
        import pool
        library = ctypes.CDLL({str(ffi_library)!r})
        address = ctypes.cast(library.null_deref, ctypes.c_void_p).value
        pool.register_custom_call("null_deref", address)
        f = lambda x: jax.ffi.ffi_call("null_deref", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
        shape = jax.ShapeDtypeStruct((4,), np.float32)
        program = pool.lower(f, [shape], custom_calls=["null_deref"])
        executable, _ = pool.compile_program(program)
        print("compiled", flush=True)
        executable.run([np.zeros(4)])
        print("survived", flush=True)
        """,
        check=False,
    )
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["compiled"]


# The XLA FFI version of jaxlib's handlers (and of its XLA), by jaxlib's minor version.
JAXLIB_FFI = {"0.10": (0, 3), "0.11": (0, 4), "0.12": (0, 5)}
THIS_JAXLIB_FFI = JAXLIB_FFI[".".join(jaxlib.__version__.split(".")[:2])]


def test_jaxlibs_own_kernels_run_on_its_client_as_jax_jit_runs_them(runtime):
    assert runtime.plugin.ffi_api_version("Host") == THIS_JAXLIB_FFI
    assert runtime.ffi_version == "{}.{}".format(*THIS_JAXLIB_FFI)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 5)).astype(np.float32) + 5 * np.eye(5, dtype=np.float32)
    b = rng.standard_normal((5, 2)).astype(np.float32)

    def function(a, b):
        return jnp.linalg.solve(a, b), jnp.linalg.eigh(a @ a.T)[0], jnp.linalg.svd(a)[1]

    executable, _ = compile_program(lower(function, [a, b]))
    for got, expected in zip(executable.run([a, b]), jax.jit(function)(a, b), strict=True):
        assert got.tobytes() == np.asarray(expected).tobytes()  # the same kernels, bit for bit


def test_a_handler_newer_than_jaxlibs_xla_is_refused_when_registered(ffi_library: Path):
    target = "pjrt_pool_test_add_one_0_9"
    with pytest.raises(FfiVersionError) as caught:
        register_custom_call(target, address_of(ffi_library, "add_one_reporting_0_9"))
    error = caught.value
    message = str(error)
    jaxlib_ffi = "{}.{}".format(*THIS_JAXLIB_FFI)
    assert (error.handler_version, error.plugin_version) == ("0.9", jaxlib_ffi)
    assert isinstance(error, MissingCustomCallError) and error.code_name == "FAILED_PRECONDITION"
    assert f"cannot take the handler for {target!r}: it is built for XLA FFI 0.9" in message
    assert f"jaxlib {jaxlib.__version__}'s own CPU client (XLA FFI {jaxlib_ffi})" in message
    # Nothing was registered: a program calling the target says so, before or at compile.
    program = lower(calls(target), [jax.ShapeDtypeStruct((3,), jnp.float32)], custom_calls=[target])
    with pytest.raises(MissingCustomCallError, match="no handler for custom call"):
        compile_program(program)


@pytest.mark.skipif(DEFAULT_PLUGIN is None, reason="lammps-jax-pjrt-cpu is not installed")
def test_on_the_default_plugin_versions_are_read_adapted_and_refused(ffi_library: Path):
    # The default CPU plugin is built from the XLA of jaxlib 0.11.2: XLA FFI 0.4. Its
    # registration drops a newer handler without an error: pjrt-pool reads the plugin's
    # version and each handler's, runs an FFI 0.5 handler through an adapter, refuses 0.9,
    # and registers jaxlib's LAPACK kernels whatever their version (0.5's adapted).
    done = run_python(
        f"""
        import ctypes, json
        import jax, jax.numpy as jnp, numpy as np
        import pool
        from jaxlib.cpu import _lapack
        from worker import get_runtime
        runtime = get_runtime("pjrt_cpu")
        library = ctypes.CDLL({str(ffi_library)!r})
        address = lambda name: ctypes.cast(getattr(library, name), ctypes.c_void_p).value
        plugin = runtime.plugin
        result = {{"plugin": plugin.ffi_api_version("Host"), "ffi": runtime.ffi_version}}
        result["handlers"] = [
            plugin.handler_ffi_version(address(name), "Host")
            for name in ("add_one", "add_one_reporting_0_5", "add_one_reporting_0_9")
        ]
        _lapack.initialize()
        capsule = _lapack.registrations()["lapack_sgetrf_ffi"]
        result["lapack"] = plugin.handler_ffi_version(capsule, "Host")
        def calls(target):
            return lambda x: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
        target = "pjrt_pool_test_add_one_0_5"
        handler = address("add_one_reporting_0_5")
        pool.register_custom_call(target, handler, platform="pjrt_cpu")
        shapes = [jax.ShapeDtypeStruct((4,), np.float32)]
        program = pool.lower(calls(target), shapes, custom_calls=[target], platform="pjrt_cpu")
        result["adapted"] = pool.compile_program(program)[0].run([np.arange(4)])[0].tolist()
        result["again"] = plugin.register_ffi_handler(target + "_again", handler, "Host")
        try:
            pool.register_custom_call("pjrt_pool_test_0_9", address("add_one_reporting_0_9"),
                                      platform="pjrt_cpu")
        except pool.FfiVersionError as error:
            result["refused"] = [error.handler_version, error.plugin_version, str(error)]
        rng = np.random.default_rng(0)
        a = rng.standard_normal((5, 5)).astype(np.float32) + 5 * np.eye(5, dtype=np.float32)
        b = rng.standard_normal((5, 2)).astype(np.float32)
        function = lambda a, b: (jnp.linalg.solve(a, b), jnp.linalg.eigh(a @ a.T)[0])
        executable, _ = pool.compile_program(pool.lower(function, [a, b], platform="pjrt_cpu"))
        result["linalg"] = all(
            np.allclose(got, want, rtol=1e-5, atol=1e-5)
            for got, want in zip(executable.run([a, b]), jax.jit(function)(a, b))
        )
        print(json.dumps(result))
        """
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["plugin"] == [0, 4] and result["ffi"] == "0.4"
    assert result["handlers"] == [[0, 1], [0, 5], [0, 9]]
    assert tuple(result["lapack"]) == THIS_JAXLIB_FFI
    assert result["adapted"] == [1.0, 2.0, 3.0, 4.0]
    assert result["again"] == {"plugin_version": [0, 4], "handler_version": [0, 5], "adapted": True}
    handler, plugin, message = result["refused"]
    assert (handler, plugin) == ("0.9", "0.4")
    assert "takes handlers of XLA FFI 0.4 or older" in message
    assert os.path.realpath(DEFAULT_PLUGIN) in message
    assert f"installed jaxlib, {jaxlib.__version__}" in message
    assert "lammps-jax-pjrt-cpu" not in message.split("cannot take")[1]  # never the loaded one
    assert result["linalg"] is True


@pytest.mark.skipif(SECOND_PLUGIN is None, reason="xla-cpu-pjrt is not installed")
def test_on_the_older_plugin_the_suites_handlers_run_and_jaxlibs_are_refused(ffi_library: Path):
    # xla-cpu-pjrt's XLA is FFI 0.2: the suite's handlers (0.1) run on it; jaxlib's
    # LAPACK handlers (0.3 in jaxlib 0.10, 0.4 in 0.11, 0.5 in 0.12) and an FFI 0.5
    # handler are refused when registered, where XLA would have dropped them.
    done = run_python(
        f"""
        import ctypes, json
        import jax, numpy as np
        import jaxlib
        import pool
        from jaxlib.cpu import _lapack
        library = ctypes.CDLL({str(ffi_library)!r})
        address = lambda name: ctypes.cast(getattr(library, name), ctypes.c_void_p).value
        pool.register_custom_call("add_one", address("add_one"))
        f = lambda x: jax.ffi.ffi_call("add_one", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
        program = pool.lower(f, [jax.ShapeDtypeStruct((4,), np.float32)], custom_calls=["add_one"])
        executable, _ = pool.compile_program(program)
        result = {{"out": executable.run([np.arange(4)])[0].tolist(), "refused": {{}}}}
        _lapack.initialize()
        capsule = _lapack.registrations()["lapack_sgetrf_ffi"]
        for name, handler in [("getrf", capsule), ("v05", address("add_one_reporting_0_5"))]:
            try:
                pool.register_custom_call("pjrt_pool_test_" + name, handler)
            except pool.FfiVersionError as error:
                result["refused"][name] = [error.handler_version, error.plugin_version, str(error)]
        result["jaxlib"] = jaxlib.__version__
        print(json.dumps(result))
        """,
        env={"PJRT_POOL_PLUGIN_CPU": SECOND_PLUGIN},
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["out"] == [1.0, 2.0, 3.0, 4.0]  # the plugin named for the cpu platform ran it
    assert sorted(result["refused"]) == ["getrf", "v05"]
    handler, plugin, message = result["refused"]["getrf"]
    assert plugin == "0.2" and handler in ("0.3", "0.4", "0.5")
    assert f"XLA FFI {handler}" in message and "XLA FFI 0.2 or older" in message
    assert "PJRT API 0.81" in message and os.path.realpath(SECOND_PLUGIN) in message
    assert f"installed jaxlib, {result['jaxlib']}" in message
    # What to do names jaxlib's own client, the cpu platform's when no plugin is named.
    assert "unset PJRT_POOL_PLUGIN_CPU to run on the installed jaxlib's own client" in message
    assert result["refused"]["v05"][:2] == ["0.5", "0.2"]


def test_pool_reexports_register_custom_call():
    assert pool.register_custom_call is register_custom_call


def test_a_target_takes_one_handler_per_process(ffi_library: str) -> None:
    target = "pjrt_pool_test_registered_once"
    register_custom_call(target, address_of(ffi_library, "add_one"))
    register_custom_call(target, address_of(ffi_library, "add_one"))  # the same: accepted
    with pytest.raises(ValueError, match="already has another handler"):
        register_custom_call(target, address_of(ffi_library, "null_deref"))
