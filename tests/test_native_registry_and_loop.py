"""The native module's invariants, through its Python API (issue 29's items 12 and 13).

12: one registry of FFI target -> handler in the native module: a second,
different handler for a registered target is refused naming both (the
plugin's XLA would keep the first and report success); the same handler
again gets its first registration back. 13: a HotLoop's slots may be set
and dropped from another thread while a run uses them: the run keeps the
slot it began with.

The native module runs a PJRT plugin's executables (the cpu platform's own
runtime, jaxlib's client, is not the native module's), so each test runs in a
child whose cpu platform is the default CPU plugin (PJRT_POOL_PLUGIN_CPU).
"""

from __future__ import annotations

import json

import pytest
from conftest import DEFAULT_PLUGIN, child

pytestmark = pytest.mark.skipif(DEFAULT_PLUGIN is None, reason="lammps-jax-pjrt-cpu is needed")

ON_THE_PLUGIN = f"""
        os.environ["PJRT_POOL_PLUGIN_CPU"] = {DEFAULT_PLUGIN!r}
        import ctypes, json, jax, jax.numpy as jnp
        from worker import get_runtime
        plugin = get_runtime("cpu").plugin
        library = ctypes.CDLL(handlers)
        address_of = lambda symbol: ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value
"""
"""A child's prelude: the plugin's handle, and the test library's handlers by address."""


def test_a_target_registered_again_with_another_handler_is_refused_naming_both(
    handlers: str,
) -> None:
    done = child(
        ON_THE_PLUGIN
        + """
        target = "pjrt_pool_test_registry_dupt"
        plus_one = address_of("add_one")
        other = address_of("add_one_reporting_0_5")  # would take an adapter
        first = plugin.register_ffi_handler(target, plus_one, "Host")
        refusals = []
        for platform in ("Host", "host"):  # one platform, however spelled
            try:
                plugin.register_ffi_handler(target, other, platform)
            except PjrtError as error:
                refusals.append([str(error), error.code_name])
        # The same handler again is the first registration, and the program runs the first.
        again = plugin.register_ffi_handler(target, plus_one, "Host")
        program = lower(
            lambda x: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x),
            [jax.ShapeDtypeStruct((2,), jnp.float32)],
            custom_calls=[target],
        )
        executable, _ = compile_program(program, disk_cache=False)
        out = executable.run([np.zeros(2, np.float32)])[0].tolist()
        print(json.dumps({"first": first, "again": again, "refusals": refusals, "out": out}))
        """,
        handlers=handlers,
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["first"]["adapted"] is False and found["again"] == found["first"]
    assert len(found["refusals"]) == 2
    message, code = found["refusals"][0]
    assert "registered already" in message and code == "ALREADY_EXISTS"
    assert "add_one in " in message and "add_one_reporting_0_5 in " in message
    assert "registered already" in found["refusals"][1][0]
    assert found["out"] == [1.0, 1.0]


def test_registering_an_adapted_handler_again_takes_no_adapter(handlers: str) -> None:
    # 512 adapters serve the process: re-registrations past that many must still work.
    done = child(
        ON_THE_PLUGIN
        + """
        target = "pjrt_pool_test_registry_adapted"
        handler = address_of("add_one_reporting_0_5")
        first = plugin.register_ffi_handler(target, handler, "Host")
        same = all(plugin.register_ffi_handler(target, handler, "Host") == first
                   for _ in range(600))
        print(json.dumps({"adapted": first["adapted"], "same": same}))
        """,
        handlers=handlers,
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"adapted": True, "same": True}


def test_dropping_and_replacing_a_slot_while_it_runs_keeps_the_run_whole(handlers: str) -> None:
    # The slot holds the only reference to its executable: freed under a run,
    # the run used freed memory. In a child, so that a crash fails this test only.
    done = child(
        f"""
        os.environ["PJRT_POOL_PLUGIN_CPU"] = {DEFAULT_PLUGIN!r}
        import gc, mmap, socket, threading
        from worker import _pjrt, compile_program, register_custom_call
        from worker.wire import protocol, shm
        from worker.serve.server import register_slot
        import ctypes
        library = ctypes.CDLL(handlers)
        register_custom_call(
            "sleep_ms", ctypes.cast(library.sleep_ms, ctypes.c_void_p).value
        )
        ours, theirs = socket.socketpair()
        size = 4096
        arena = mmap.mmap(-1, size + protocol.CONTROL_BYTES)
        loop = _pjrt.HotLoop(theirs.fileno(), arena, size, 0.0)
        sleeper, _ = compile_program(sleep_program(4), disk_cache=False)
        other, _ = compile_program(scale_program(3.0, 4), disk_cache=False)
        types = sleeper.input_types
        inputs, end = shm.layout(types)
        outputs, _ = shm.layout(sleeper.output_types, end)
        register_slot(loop, 1, sleeper, types, inputs, outputs)
        view = shm.views(arena, types, inputs)[0]
        view[:] = milliseconds(400, 4)
        del sleeper
        gc.collect()  # the slot holds the sleeping program's only reference now
        errors = []
        def run():
            try:
                loop.run(7, 1, False)
            except Exception as error:
                errors.append(error)
        runner = threading.Thread(target=run)
        runner.start()
        time.sleep(0.15)
        loop.drop_slot(1)
        register_slot(loop, 1, other, other.input_types, inputs, outputs)
        loop.drop_slot(1)
        gc.collect()
        runner.join(30)
        result = shm.views(arena, types, outputs)[0]
        print("errors", errors, "result", result.tolist(), "slot", loop.has_slot(1))
        """,
        handlers=handlers,
    )
    assert "errors [] result [400.0, 400.0, 400.0, 400.0] slot False" in done.stdout
