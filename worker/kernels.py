"""Custom-call handlers: the user's, and the kernel libraries JAX lowers to.

JAX lowers ``jnp.linalg`` (and a few other functions) to custom calls whose
handlers live in jaxlib, not in the plugin: ``lapack_*_ffi`` on CPU. A
standalone plugin compiles such programs only after those handlers are
registered through its FFI extension. Registration is done lazily, the first
time a program that names the library's targets is compiled or loaded, so
that workers that never run linalg do not import jaxlib's LAPACK (and SciPy,
which it loads).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from dataclasses import dataclass
from typing import Any

from worker.errors import PjrtError
from worker.runtime import Runtime, get_runtime

logger = logging.getLogger("pjrt_pool.kernels")


@dataclass(frozen=True)
class _KernelLibrary:
    platform: str
    markers: tuple[bytes, ...]  # substrings of any program or executable that calls it
    modules: tuple[str, ...]  # modules with registrations(); the first importable is used
    description: str


_LIBRARIES = (
    _KernelLibrary("cpu", (b"lapack_",), ("jaxlib.cpu._lapack",), "jaxlib's LAPACK kernels"),
    _KernelLibrary(
        "cuda",
        (b"cusolver_", b"cublas_", b"cu_", b"cusparse_"),
        (
            "jax_cuda13_plugin._solver",
            "jax_cuda12_plugin._solver",
            "jax_cuda13_plugin._linalg",
            "jax_cuda12_plugin._linalg",
            "jax_cuda13_plugin._prng",
            "jax_cuda12_plugin._prng",
        ),
        "the jax-cuda plugin's cuSOLVER/cuBLAS kernels",
    ),
)


class MissingCustomCallError(PjrtError):
    """A program calls a custom-call target that the loaded plugin has no handler for."""


def register_custom_call(
    name: str, handler: Any, platform: str | None = None, traits: int = 0
) -> None:
    """Registers an XLA FFI handler for a custom-call target with this process's plugin.

    handler is a PyCapsule holding an ``XLA_FFI_Handler*`` (as jaxlib's and
    most FFI libraries' ``registrations()`` return them) or the handler's
    address as an int. platform names the plugin to register with; by default
    the loaded one, or the default platform's, which then loads. Register
    before compiling programs that call the target; in a Pool, register from
    the worker initializer. Programs that call the target must be lowered with
    it in ``custom_calls``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"a custom-call target name must be a non-empty str, not {name!r}")
    runtime = get_runtime(platform)
    address = _handler_address(handler)
    with runtime.lock:
        previous = _user_handlers.get(name)
        if previous is not None:
            if previous == address:
                return  # registering the same handler again (an initializer run twice)
            raise ValueError(
                f"custom-call target {name!r} already has another handler in this process; "
                "XLA keeps the first registration, so register each target once"
            )
        runtime.plugin.register_ffi_handler(name, handler, runtime.ffi_platform, traits)
        _user_handlers[name] = address
        runtime.registered_targets.add(name)


_user_handlers: dict[str, int] = {}


def _handler_address(handler: Any) -> int:
    """The XLA_FFI_Handler* of a PyCapsule or int, for telling handlers apart."""
    if isinstance(handler, int) and not isinstance(handler, bool):
        return handler
    if type(handler).__name__ == "PyCapsule":
        api = ctypes.pythonapi
        api.PyCapsule_GetName.restype = ctypes.c_char_p
        api.PyCapsule_GetName.argtypes = [ctypes.py_object]
        api.PyCapsule_GetPointer.restype = ctypes.c_void_p
        api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        return int(api.PyCapsule_GetPointer(handler, api.PyCapsule_GetName(handler)) or 0)
    raise TypeError(
        f"an FFI handler must be a PyCapsule or an integer address, not {type(handler).__name__}"
    )


def _registrations(module_name: str) -> dict[str, Any]:
    module = importlib.import_module(module_name)
    if hasattr(module, "initialize"):
        module.initialize()  # LAPACK: binds the kernels to SciPy's LAPACK
    handlers = {}
    for name, value in module.registrations().items():
        capsule = value
        if isinstance(value, (tuple, list)):  # GPU modules: (capsule, api_version)
            capsule, api_version = value[0], value[-1]
            if api_version != 1:
                continue  # a legacy custom call, not an FFI handler
        handlers[name] = capsule
    return handlers


def ensure_kernels_for(runtime: Runtime, blob: bytes | memoryview) -> None:
    """Registers the kernel libraries that a program or serialized executable may call.

    A cheap substring test of the bytes decides; registering a library twice
    is avoided, and a library that cannot be imported is left to the compile
    error, which explains_missing_handler then makes clear.
    """
    data = bytes(blob) if isinstance(blob, memoryview) else blob
    for library in _LIBRARIES:
        if (
            library.platform != runtime.platform
            or library.description in runtime.registered_targets
        ):
            continue
        if not any(marker in data for marker in library.markers):
            continue
        with runtime.lock:
            if library.description in runtime.registered_targets:
                continue
            for module_name in library.modules:
                try:
                    handlers = _registrations(module_name)
                except ImportError:
                    continue
                for name, capsule in handlers.items():
                    runtime.plugin.register_ffi_handler(name, capsule, runtime.ffi_platform, 0)
                    runtime.registered_targets.add(name)
                logger.debug("registered %d handlers from %s", len(handlers), module_name)
            runtime.registered_targets.add(library.description)


def explain_missing_handler(error: PjrtError, runtime: Runtime) -> PjrtError:
    """Returns a clearer error for "No FFI handler registered for X", else `error` itself."""
    message = str(error)
    marker = "No FFI handler registered for "
    if marker not in message:
        return error
    target = message.split(marker, 1)[1].split()[0]
    where = (
        f"the {runtime.platform} plugin {runtime.location.path} (PJRT API {runtime.api_version})"
    )
    if target in runtime.registered_targets:
        text = (
            f"{where} has no handler for custom call {target!r} although one was registered: "
            "the plugin dropped the registration, which happens when its XLA FFI is older "
            "than the library that made the handler. "
        )
        library = next(
            (
                lib
                for lib in _LIBRARIES
                if lib.platform == runtime.platform
                and any(target.startswith(m.decode()) for m in lib.markers)
            ),
            None,
        )
        if library is not None:
            text += (
                f"Programs that use {library.description} (jnp.linalg) need a newer plugin"
                + (
                    " such as lammps-jax-pjrt-cpu, the default CPU plugin"
                    if runtime.platform == "cpu"
                    else ""
                )
                + "."
            )
    else:
        text = (
            f"{where} has no handler for custom call {target!r}: register one with "
            "register_custom_call (in a Pool, from the worker initializer) before compiling."
        )
    explained = MissingCustomCallError(f"{text}\n(PJRT said: {message})")
    explained.code = getattr(error, "code", 5)
    explained.code_name = getattr(error, "code_name", "NOT_FOUND")
    return explained
