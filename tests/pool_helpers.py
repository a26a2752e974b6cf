"""Helpers for the worker-pool tests: programs, crash sources and leak checks."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pool import LoweredProgram, Pool, lower
from worker import _pjrt
from worker.compile.executable import Executable
from worker.identity.options import compile_options
from worker.plugin.locate import find_plugin
from worker.plugin.runtime import Runtime

F32 = jnp.float32


def sds(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, F32)


def scale_program(factor: float, size: int = 8, platform: str | None = None) -> LoweredProgram:
    """x * factor + 1: distinct programs for distinct factors (lowered for `platform`)."""
    return lower(lambda x: x * factor + 1.0, [sds(size)], platform=platform)


def spin_program() -> LoweredProgram:
    """A program that runs for hours: loops XLA cannot shorten.

    One loop of 2e9 steps finishes in 10-20 s on a CPU, so a test that
    expects its task to be killed would see it end (with the loop's fixed
    point, 0.1818...) if the kill missed; the outer loop makes that a hang
    the test's timeout reports instead.
    """

    def steps(_: object, v: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, 2_000_000_000, lambda i, u: jnp.sin(u) + 1e-3, v)

    return lower(lambda x: jax.lax.fori_loop(0, 1000, steps, x), [sds(1)])


def wait_until_started(pool: Pool, task: str, seconds: float = 60.0) -> int:
    """The pid of the worker that has begun the task named `task`, once one has.

    A worker is given a task (worker_info's "task") before it begins it
    ("started"); one killed in between sends the task to another worker.
    """
    deadline = time.monotonic() + seconds
    while True:
        for info in pool.worker_info:
            if info["task"] == task and info["started"]:
                return info["pid"]
        assert time.monotonic() < deadline, f"no worker began task {task!r} in {seconds:g} s"
        time.sleep(0.005)


def custom_call_program(target: str) -> LoweredProgram:
    """y = target(x) for an FFI handler target taking and returning f32[8]."""

    def call(x):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    return lower(call, [sds(8)], custom_calls=[target])


def sleep_program(size: int = 1, platform: str | None = None) -> LoweredProgram:
    """y = x after sleeping x[0] milliseconds (the test library's sleep_ms handler)."""

    def call(x):
        return jax.ffi.ffi_call("sleep_ms", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    return lower(call, [sds(size)], custom_calls=["sleep_ms"], platform=platform)


def milliseconds(ms: float, size: int = 1) -> np.ndarray:
    """The argument of sleep_program that makes it sleep `ms` milliseconds."""
    return np.full(size, ms, np.float32)


def isnan_program() -> LoweredProgram:
    """11 where x is NaN, else 0: fast-math compile options fold it to all zeros."""
    return lower(lambda x: jnp.where(jnp.isnan(x), 11, 0), [sds(4)])


def fast_math_options() -> bytes:
    """CompileOptionsProto (one replica and partition) that lets XLA:CPU assume no NaNs.

    Built with jaxlib's own CompileOptions, so that every other DebugOptions
    field keeps its default; fast math that honours NaNs would not change
    isnan_program's result.
    """
    from jax._src.lib import xla_client

    options = xla_client.CompileOptions()
    options.num_replicas = options.num_partitions = 1
    debug = options.executable_build_options.debug_options
    debug.xla_cpu_enable_fast_math = True
    debug.xla_cpu_fast_math_honor_nans = False
    return options.SerializeAsString()


_plugin: list[Runtime] = []


def plugin_executable(program: LoweredProgram) -> Executable:
    """A program (lowered for platform="pjrt_cpu") compiled on the CPU plugin, which is loaded
    in this process beside the process's own runtime (jaxlib's client), not through it: what
    a pool worker's native hot loop runs, for tests of that loop in this process."""
    if not _plugin:
        location = find_plugin("pjrt_cpu")
        _plugin.append(Runtime(location, _pjrt.Plugin.load(location.path), None))
    runtime = _plugin[0]
    native = runtime.client.compile(program.code, compile_options())
    return Executable(native, runtime, program.input_types)


def handler_initializer(library: str):
    """An initializer (for Pool) that registers the test library's FFI handlers."""

    def register() -> None:
        import ctypes as worker_ctypes

        from worker import register_custom_call

        handlers = worker_ctypes.CDLL(library)
        for name in ("add_one", "null_deref", "sleep_ms", "device_error"):
            register_custom_call(
                name, worker_ctypes.cast(getattr(handlers, name), worker_ctypes.c_void_p).value
            )

    return register


def warmed_pool(library: str) -> tuple[Pool, LoweredProgram, LoweredProgram, np.ndarray]:
    """A Pool of one worker with the test library's handlers, that has already run
    sleep_program() and scale_program(2.0) on x (so neither compiles again): the scenario
    the interrupt and reply-read tests start from. Returns pool, sleeper, quick and x."""
    sleeper, quick = sleep_program(), scale_program(2.0)
    x = np.ones(8, np.float32)
    pool = Pool(workers=1, initializer=handler_initializer(library))
    pool.run(sleeper, [milliseconds(1)])
    pool.run(quick, [x])
    return pool, sleeper, quick, x


def take_every_descriptor() -> list[int]:
    """Opens /dev/null until the process has no descriptor left (EMFILE); returns them."""
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        return held


def give_back_descriptors(held: list[int]) -> None:
    """Closes what take_every_descriptor opened."""
    for fd in held:
        os.close(fd)


def memfds_of(pid: int | str = "self") -> list[str]:
    """The memfd descriptors and mappings a process holds."""
    found = []
    with os.scandir(f"/proc/{pid}/fd") as entries:
        for entry in entries:
            try:
                target = os.readlink(entry.path)
            except OSError:
                continue
            if target.startswith("/memfd:"):
                found.append(f"fd {entry.name}: {target}")
    maps = Path(f"/proc/{pid}/maps").read_text()
    found += [line for line in maps.splitlines() if "/memfd:" in line]
    return found


def memfd_bytes(name: str, pid: int | str = "self") -> int:
    """Bytes of the memfds whose name starts with `name` that a process holds.

    Held by a descriptor or a mapping (the memory stays allocated while
    either exists); each memfd counts once, at its size.
    """
    sizes: dict[int, int] = {}
    with os.scandir(f"/proc/{pid}/fd") as entries:
        for entry in entries:
            try:
                if os.readlink(entry.path).startswith(f"/memfd:{name}"):
                    status = os.stat(entry.path)
                    sizes[status.st_ino] = status.st_size
            except OSError:
                continue
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith(f"/memfd:{name}"):
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            sizes.setdefault(int(fields[4]), end - start)
    return sum(sizes.values())


def shm_entries() -> set[str]:
    """Names in /dev/shm that a pool could have made (it must never make any).

    All but multiprocessing's named semaphores (``sem.mp-*``): /dev/shm is the
    machine's, and other processes (another CI leg's ProcessPoolExecutor) make and
    remove those at any time, which once failed a comparison here on a test that
    made none; the pool never uses multiprocessing.
    """
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return set()
    return {name for name in names if not name.startswith("sem.mp-")}


def children_of(pid: int) -> list[int]:
    """Pool worker processes (``python -m worker``) that are children of a process.

    Zombies count: they are leaks too. Other children (a multiprocessing
    resource tracker started by an earlier test) do not.
    """
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) != pid:
            continue
        try:
            command = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            command = []
        # A zombie has an empty command line; it can only be a worker we lost.
        if not any(command) or b"worker" in command:
            children.append(int(entry))
    return children


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def handler_address(library: str, name: str) -> int:
    return ctypes.cast(getattr(ctypes.CDLL(library), name), ctypes.c_void_p).value


def expected_scale(factor: float, x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32) * np.float32(factor) + np.float32(1.0)).astype(np.float32)
