"""Custom-call handlers: the user's, and the kernel libraries JAX lowers to.

JAX lowers ``jnp.linalg`` (and a few other functions) to custom calls whose
handlers live in jaxlib, not in the plugin: ``lapack_*_ffi`` on CPU, and
``cusolver_*``, ``cu_*``, ``cuhybrid_*`` from the jax-cuda plugin package of
the plugin's CUDA version (jax_cuda12_plugin or jax_cuda13_plugin) on CUDA. A
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
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from worker.errors import PjrtError
from worker.plugins import cuda_major
from worker.runtime import Runtime, get_runtime

logger = logging.getLogger("pjrt_pool.kernels")


@dataclass(frozen=True)
class _KernelLibrary:
    platform: str
    markers: tuple[bytes, ...]  # substrings of any program or executable that calls it
    modules: tuple[tuple[str, bool], ...]  # (module of the package, all its targets are FFI)
    description: str


_LIBRARIES = (
    _KernelLibrary("cpu", (b"lapack_",), (("_lapack", False),), "jaxlib's LAPACK kernels"),
    _KernelLibrary(
        "cuda",
        (b"cusolver_", b"cublas_", b"cu_", b"cusparse_", b"cuhybrid_"),
        # _linalg (cu_lu_pivots_to_permutation) and _hybrid (cuhybrid_eig_*) name
        # FFI targets without the "_ffi" suffix; the other modules use it.
        (
            ("_solver", False),
            ("_hybrid", True),
            ("_linalg", True),
            ("_prng", False),
            ("_sparse", False),
        ),
        "the jax-cuda plugin's cuSOLVER/cuSPARSE kernels",
    ),
)

# What a CUDA client reports as its platform version: "cuda 13.0.0", or "cuda 12030" from older XLA.
_CUDA_PLATFORM_VERSION = re.compile(r"cuda\s+(\d+)(\.\d+)?")


def kernel_package(
    platform: str, plugin_path: str, platform_version: str | None = None
) -> str | None:
    """Returns the package whose modules hold the kernels for a plugin, or None if unknown.

    For "cpu" it is jaxlib's ("jaxlib.cpu"). For "cuda" it is the jax-cuda
    plugin package of the CUDA version the plugin was built for: the
    plugin's own package decides (jax-cuda13-pjrt, installed as
    jax_plugins/xla_cuda13, goes with jax_cuda13_plugin), else the CUDA
    version its client reports ("cuda 13.0.0"). Kernels of another CUDA
    version must never be registered: they are built for another CUDA, and
    the plugin accepts a second handler for a target without a word, so
    which one runs would be left to the order of registration.
    """
    if platform == "cpu":
        return "jaxlib.cpu"
    if platform != "cuda":
        return None
    major = cuda_major(plugin_path)
    if major is None:
        match = _CUDA_PLATFORM_VERSION.match((platform_version or "").strip())
        if match is None:
            return None
        number = int(match.group(1))
        # "12030" (CUDART_VERSION) means 12.3; "13.0.0" and "13" mean 13.
        major = number if match.group(2) or number < 100 else number // 1000
    return f"jax_cuda{major}_plugin"


def _distribution(package: str) -> str:
    """The pip distribution of a kernel package (jax_cuda13_plugin: jax-cuda13-plugin)."""
    return "jaxlib" if package.startswith("jaxlib") else package.replace("_", "-")


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


def _ffi_handlers(module_name: str, all_ffi: bool) -> dict[str, Any]:
    """The FFI handlers (name: PyCapsule) that a kernel module registers.

    Legacy custom calls among them (no "_ffi" suffix, in a module whose
    targets are not all FFI) are left out: they take another calling
    convention, and an FFI registration would call them wrongly.
    """
    module = importlib.import_module(module_name)
    if hasattr(module, "initialize"):
        module.initialize()  # LAPACK, hybrid: binds the kernels to SciPy's LAPACK
    handlers = {}
    for name, value in module.registrations().items():
        capsule, ffi = value, all_ffi or name.endswith("_ffi")
        if isinstance(value, (tuple, list)):  # (capsule, api_version) from older jaxlibs
            capsule, ffi = value[0], value[-1] == 1
        if ffi:
            handlers[name] = capsule
    return handlers


def register_kernels(
    plugin: Any, ffi_platform: str, package: str, modules: Sequence[tuple[str, bool]]
) -> dict[str, list[str]]:
    """Registers the FFI handlers of a kernel package's modules with a plugin.

    modules are (module name within the package, whether all its targets are
    FFI). Returns the registered target names by module; a module that
    cannot be imported is left out (a program that needs it then fails to
    compile, and explain_missing_handler says what to install).
    """
    registered: dict[str, list[str]] = {}
    for module, all_ffi in modules:
        module_name = f"{package}.{module}"
        try:
            handlers = _ffi_handlers(module_name, all_ffi)
        except ImportError as error:
            logger.debug("no kernels from %s: %s", module_name, error)
            continue
        for name, capsule in handlers.items():
            plugin.register_ffi_handler(name, capsule, ffi_platform, 0)
        registered[module_name] = list(handlers)
        logger.debug("registered %d handlers from %s", len(handlers), module_name)
    return registered


def _runtime_package(runtime: Runtime) -> str | None:
    return kernel_package(runtime.platform, runtime.location.path, runtime.client.platform_version)


def ensure_kernels_for(runtime: Runtime, blob: bytes | memoryview) -> None:
    """Registers the kernel library that a program or serialized executable may call.

    A cheap substring test of the bytes decides. The library comes from the
    one package that matches the loaded plugin (kernel_package), never from
    another; registering it twice is avoided, and a library that cannot be
    imported is left to the compile error, which explain_missing_handler
    then makes clear.
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
            package = _runtime_package(runtime)
            if package is None:
                logger.warning(
                    "not registering %s: cannot tell which CUDA version the plugin %s was "
                    "built for",
                    library.description,
                    runtime.location.path,
                )
            else:
                registered = register_kernels(
                    runtime.plugin, runtime.ffi_platform, package, library.modules
                )
                for names in registered.values():
                    runtime.registered_targets.update(names)
            runtime.registered_targets.add(library.description)


def _library_for(runtime: Runtime, target: str) -> _KernelLibrary | None:
    return next(
        (
            library
            for library in _LIBRARIES
            if library.platform == runtime.platform
            and any(target.startswith(marker.decode()) for marker in library.markers)
        ),
        None,
    )


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
    library = _library_for(runtime, target)
    package = _runtime_package(runtime)
    if target in runtime.registered_targets:
        text = (
            f"{where} has no handler for custom call {target!r} although one was registered: "
            "the plugin dropped the registration, which happens when its XLA FFI is older "
            "than the library that made the handler. "
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
    elif library is not None and package is None:
        text = (
            f"{where} has no handler for custom call {target!r}: it comes from "
            f"{library.description}, but the plugin's path names no jax_plugins/xla_cudaNN "
            f"package and its platform version ({runtime.client.platform_version!r}) no CUDA "
            "version, so which jax-cuda plugin package matches it is unknown; register the "
            "handlers with register_custom_call."
        )
    elif library is not None:
        text = (
            f"{where} has no handler for custom call {target!r}: it comes from "
            f"{library.description} in the package {package}, which matches this plugin; "
            f"install it ('pip install {_distribution(package)}', the version of the plugin)."
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
