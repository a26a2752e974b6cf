"""Custom-call handlers: the user's, and the kernel libraries JAX lowers to.

JAX lowers ``jnp.linalg`` (and a few other functions) to custom calls whose
handlers live in jaxlib, not in the plugin: ``lapack_*_ffi`` on CPU, and
``cusolver_*``, ``cu_*``, ``cuhybrid_*`` from the jax-cuda plugin package of
the plugin's CUDA version (jax_cuda12_plugin or jax_cuda13_plugin) on CUDA;
each platform names its kernel libraries and the package that matches a
plugin (worker.plugin.platforms: Platform.kernels, Platform.kernel_package). A
standalone plugin compiles such programs only after those handlers are
registered through its FFI extension. Registration is done lazily, the first
time a program that names the library's targets is compiled or loaded, so
that workers that never run linalg do not import jaxlib's LAPACK (and SciPy,
which it loads).

Every registration is checked against the plugin's XLA FFI version first
(native/ffi.h): XLA drops a handler built for a newer XLA FFI than its own
without an error, so such a handler is refused with FfiVersionError instead,
or, across the one step known to be safe (FFI 0.5 handlers on an FFI 0.4
runtime, as jaxlib 0.12's on the XLA of jaxlib 0.11), runs through an
adapter.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from worker import _pjrt
from worker.errors import PjrtError
from worker.log import get_logger
from worker.plugin.locate import newer_plugin_hint, plugin_jax_version
from worker.plugin.platforms.platform import KernelLibrary
from worker.plugin.platforms.registry import platform_named
from worker.plugin.runtime import Runtime, get_runtime

logger = get_logger("pjrt_pool.kernels")


def kernel_package(
    platform: str, plugin_path: str, platform_version: str | None = None
) -> str | None:
    """Returns the package whose modules hold the kernels for a plugin of a platform (whose
    client reports platform_version), or None if unknown (Platform.kernel_package): for "cpu"
    jaxlib's ("jaxlib.cpu"), for "cuda" the jax-cuda plugin package of the plugin's CUDA
    version, never another's."""
    return platform_named(platform).kernel_package(plugin_path, platform_version)


def _distribution(package: str) -> str:
    """The pip distribution of a kernel package (jax_cuda13_plugin: jax-cuda13-plugin)."""
    return "jaxlib" if package.startswith("jaxlib") else package.replace("_", "-")


class MissingCustomCallError(PjrtError):
    """A program calls a custom-call target that the loaded plugin has no handler for."""


class FfiVersionError(MissingCustomCallError):
    """An FFI handler is built for a newer XLA FFI API than the plugin's XLA takes.

    Raised by register_custom_call for such a handler, and before compiling a
    program that calls a kernel library's handler the plugin could not take.
    `handler_version` and `plugin_version` are "major.minor".
    """

    handler_version: str
    plugin_version: str


def _version_text(version: tuple[int, int] | None) -> str:
    return "unknown" if version is None else f"{version[0]}.{version[1]}"


def _describe(runtime: Runtime) -> str:
    ffi = runtime.ffi_version
    shown = ffi if ffi is not None else "not shown"
    if not runtime.runs_natively:  # jaxlib's own client: no plugin, no PJRT API
        return f"the {runtime.platform} platform's {runtime.location.source} (XLA FFI {shown})"
    return (
        f"the {runtime.platform} plugin {runtime.location.path} (PJRT API "
        f"{runtime.api_version}, XLA FFI {shown})"
    )


class _Refusal(NamedTuple):
    """A handler the plugin's XLA could not take: what FfiVersionError says, each time."""

    text: str
    code: int
    code_name: str
    handler_version: str
    plugin_version: str

    @classmethod
    def of(cls, text: str, refusal: _pjrt.HandlerVersionError) -> _Refusal:
        return cls(
            text,
            refusal.code,
            refusal.code_name,
            _version_text(refusal.handler_version),
            _version_text(refusal.plugin_version),
        )

    def error(self) -> FfiVersionError:
        error = FfiVersionError(self.text)
        error.code, error.code_name = self.code, self.code_name
        error.handler_version, error.plugin_version = self.handler_version, self.plugin_version
        return error


def _installed_version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "(version unknown)"


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
        try:
            registration = runtime.plugin.register_ffi_handler(
                name, handler, runtime.ffi_platform, traits
            )
        except _pjrt.HandlerVersionError as refusal:
            raise _Refusal.of(_refused_handler(runtime, name, refusal), refusal).error() from None
        _log_registration(name, registration)
        _user_handlers[name] = address
        runtime.registered_targets.add(name)


def _refused_handler(runtime: Runtime, name: str, refusal: _pjrt.HandlerVersionError) -> str:
    handler, plugin = (_version_text(v) for v in (refusal.handler_version, refusal.plugin_version))
    return (
        f"{_describe(runtime)} cannot take the handler for {name!r}: it is built for XLA FFI "
        f"{handler}, and the plugin's XLA takes handlers of XLA FFI {plugin} or older (it would "
        f"drop this one without an error). Build the handler against the XLA FFI headers of a "
        f"jaxlib whose XLA has FFI {plugin} or older (jax.ffi.include_dir() gives those of the "
        f"installed jaxlib, {_installed_version('jaxlib')}), or "
        f"{newer_plugin_hint(runtime.location)}."
    )


def _log_registration(name: str, registration: dict[str, Any]) -> None:
    if registration["adapted"]:
        logger.debug(
            "%s: an XLA FFI %s handler on an XLA FFI %s plugin, through an adapter",
            name,
            _version_text(registration["handler_version"]),
            _version_text(registration["plugin_version"]),
        )


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


class KernelRegistration(NamedTuple):
    """What registering a kernel package's handlers did."""

    registered: dict[str, list[str]]
    """The registered target names by module (a module that cannot be imported is left out)."""

    refused: dict[str, _pjrt.HandlerVersionError]
    """The targets the plugin's XLA cannot take, with the plugin's refusal."""


def register_kernels(
    plugin: Any, ffi_platform: str, package: str, modules: Sequence[tuple[str, bool]]
) -> KernelRegistration:
    """Registers the FFI handlers of a kernel package's modules with a plugin.

    modules are (module name within the package, whether all its targets are
    FFI). A module that cannot be imported is left out (a program that needs
    it then fails to compile, and explain_missing_handler says what to
    install); a handler the plugin's XLA cannot take is left unregistered and
    reported in `refused`.
    """
    result = KernelRegistration({}, {})
    for module, all_ffi in modules:
        module_name = f"{package}.{module}"
        try:
            handlers = _ffi_handlers(module_name, all_ffi)
        except ImportError as error:
            logger.debug("no kernels from %s: %s", module_name, error)
            continue
        names = []
        for name, capsule in handlers.items():
            try:
                registration = plugin.register_ffi_handler(name, capsule, ffi_platform, 0)
            except _pjrt.HandlerVersionError as refusal:
                result.refused[name] = refusal
                continue
            _log_registration(name, registration)
            names.append(name)
        result.registered[module_name] = names
        logger.debug("registered %d handlers from %s", len(names), module_name)
    return result


def _runtime_package(runtime: Runtime) -> str | None:
    return kernel_package(runtime.platform, runtime.location.path, runtime.client.platform_version)


def ensure_kernels_for(runtime: Runtime, blob: bytes | memoryview) -> None:
    """Registers the kernel library that a program or serialized executable may call.

    A cheap substring test of the bytes decides. The library comes from the
    one package that matches the loaded plugin (kernel_package), never from
    another; registering it twice is avoided, and a library that cannot be
    imported is left to the compile error, which explain_missing_handler
    then makes clear. Raises FfiVersionError, before anything compiles, when
    the bytes name a target whose handler the plugin's XLA could not take.
    """
    libraries = runtime.facts.kernels
    if not libraries:
        return  # no copy of the bytes: a TPU entry's are tens of MB (docs/facts.md)
    data = bytes(blob) if isinstance(blob, memoryview) else blob
    for library in libraries:
        if not any(marker in data for marker in library.markers):
            continue
        if library.description not in runtime.registered_targets:
            with runtime.lock:
                if library.description not in runtime.registered_targets:
                    _register_library(runtime, library)
        for target, refusal in runtime.refused_targets.items():
            if target.encode() in data:
                raise refusal.error()


def _register_library(runtime: Runtime, library: KernelLibrary) -> None:
    package = _runtime_package(runtime)
    if package is None:
        logger.warning(
            "not registering %s: cannot tell which package's kernels match the plugin %s",
            library.description,
            runtime.location.path,
        )
    else:
        registration = register_kernels(
            runtime.plugin, runtime.ffi_platform, package, library.modules
        )
        for names in registration.registered.values():
            runtime.registered_targets.update(names)
        if registration.refused:
            text = _refused_library(runtime, library, package, registration.refused)
            for target, refusal in registration.refused.items():
                runtime.refused_targets[target] = _Refusal.of(text, refusal)
            logger.warning("%s", text)
    runtime.registered_targets.add(library.description)


def _refused_library(
    runtime: Runtime,
    library: KernelLibrary,
    package: str,
    refused: dict[str, _pjrt.HandlerVersionError],
) -> str:
    first = next(iter(refused.values()))
    handler, plugin = (_version_text(v) for v in (first.handler_version, first.plugin_version))
    distribution = _distribution(package)
    version = _installed_version(distribution)
    built_from = plugin_jax_version(runtime.location)
    if built_from is not None:
        older = (
            f"install the {distribution} the plugin's XLA comes from, {built_from}, or an older "
            f"one (\"pip install 'jax=={built_from}' '{distribution}=={built_from}'\"), or "
        )
    else:
        older = f"install a {distribution} whose XLA has FFI {plugin} or older, or "
    return (
        f"{_describe(runtime)} cannot take {library.description} from {distribution} "
        f"{version}: {len(refused)} of them are built for XLA FFI {handler} (for example "
        f"{next(iter(refused))!r}), and the plugin's XLA takes handlers of XLA FFI {plugin} or "
        f"older, so programs that call them (jnp.linalg) cannot compile on this plugin. To run "
        f"them, {older}{newer_plugin_hint(runtime.location)}."
    )


def _library_for(runtime: Runtime, target: str) -> KernelLibrary | None:
    return next(
        (
            library
            for library in runtime.facts.kernels
            if any(target.startswith(marker.decode()) for marker in library.markers)
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
    where = _describe(runtime)
    library = _library_for(runtime, target)
    package = _runtime_package(runtime)
    if target in runtime.refused_targets:
        return runtime.refused_targets[target].error()
    if target in runtime.registered_targets:
        text = (
            f"{where} has no handler for custom call {target!r} although one was registered: "
            "the plugin dropped the registration without an error. Its XLA does not show its "
            "XLA FFI version, so the handler could not be checked against it; XLA drops "
            "handlers built for a newer XLA FFI than its own."
        )
        if library is not None:
            text += (
                f" To run programs that use {library.description} (jnp.linalg), "
                f"{newer_plugin_hint(runtime.location)}."
            )
    elif library is not None and package is None:
        text = (
            f"{where} has no handler for custom call {target!r}: it comes from "
            f"{library.description}, but neither the plugin's path (no package directory "
            f"such as jax_plugins/xla_{runtime.platform}NN) nor its platform version "
            f"({runtime.client.platform_version!r}) says which package of them matches it; "
            "register the handlers with register_custom_call."
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
