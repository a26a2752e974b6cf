"""Finding the PJRT plugin library for a platform.

A plugin is found, in order:

1. at the path in the environment variable ``PJRT_POOL_PLUGIN_<PLATFORM>``
   (for example ``PJRT_POOL_PLUGIN_CPU=/opt/xla/pjrt_cpu.so``);
2. for a platform that runs on the installed jaxlib's own client
   (Platform.runs_on_jaxlib: ``cpu``), that client: not a PJRT plugin, but
   the XLA that ``jax.jit`` uses (worker.plugin.jaxlib_cpu), found as the
   library of the installed jaxlib (RuntimeKind.JAXLIB);
3. in the first installed default package for the platform, as its module
   lists them (worker.plugin.platforms: Platform.packages): for
   ``pjrt_cpu``, ``lammps-jax-pjrt-cpu`` (the extra ``pjrt-pool[cpu]``) and
   then ``xla-cpu-pjrt``; for ``cuda``, ``jax-cuda13-pjrt`` and then
   ``jax-cuda12-pjrt`` (``pjrt-pool[cuda13]``, ``pjrt-pool[cuda12]``); for
   ``tpu``, ``libtpu`` (``pjrt-pool[tpu]``, which brings the libtpu of the
   installed jax, as ``jax[tpu]`` does).

Packages are located without being imported, so finding a plugin costs no
imports (the CUDA packages import JAX, jaxlib's extension takes a tenth of a
second).
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

from worker.errors import PluginNotFoundError
from worker.extras import install_extra_command
from worker.identity.build import dist_info_of
from worker.plugin.platforms.platform import PluginPackage
from worker.plugin.platforms.registry import known_platforms, platform_named

ENV_PREFIX = "PJRT_POOL_PLUGIN_"


def _install_command(default: PluginPackage) -> str:
    """The pip command that installs a default plugin: its pjrt-pool extra, if it has one."""
    if default.extra is None:
        return f"pip install {default.distribution}"
    return install_extra_command(default.extra)


def _install_hint(default: PluginPackage) -> str:
    command = _install_command(default)
    return command if default.extra is None else f"{command} for {default.distribution}"


class RuntimeKind(enum.Enum):
    """What runs a platform's programs in a process."""

    PLUGIN = "plugin"
    """A PJRT plugin, loaded through the native module."""

    JAXLIB = "jaxlib"
    """The installed jaxlib's own CPU client, through jaxlib's Python bindings
    (worker.plugin.jaxlib_cpu): the XLA jax.jit runs on."""


JAXLIB_LIBRARIES = ("libjax_common.so", "_jax.so")
"""The files of jaxlib's package that hold its XLA, the first found being its library."""

JAXLIB_RECORD = "RECORD"
"""jaxlib's installed RECORD, which names every file of the installed jaxlib (its XLA's
library among them) with its SHA-256: the path of jaxlib's runtime, so that its identity
(the file's SHA-256) changes whenever jaxlib does, and hashing it costs a millisecond where
jaxlib's library (350 MB) takes seconds."""


class PluginLocation(NamedTuple):
    """Where the plugin (or jaxlib runtime) for a platform lives, and how it was chosen."""

    platform: str
    """The platform the plugin serves ("cpu", "cuda", ...)."""

    path: str
    """Absolute path of the plugin's shared library."""

    source: str
    """How it was found: the environment variable or the package that gave it."""

    kind: RuntimeKind = RuntimeKind.PLUGIN
    """A PJRT plugin, or jaxlib's own client (path is then jaxlib's RECORD, JAXLIB_RECORD,
    or where jaxlib has none, its library)."""


def env_var(platform: str) -> str:
    """Returns the environment variable that names the plugin for a platform."""
    return ENV_PREFIX + platform.upper()


@contextlib.contextmanager
def environment_variables(values: Mapping[str, str | None]) -> Iterator[None]:
    """Sets (or, for None, removes) environment variables for the with-block, then puts them
    back as they were.

    For what a plugin reads once, as it loads or as a worker starts.
    """
    before = {name: os.environ.get(name) for name in values}
    _set_environment(values)
    try:
        yield
    finally:
        _set_environment(before)


def _set_environment(values: Mapping[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _package_dir(package: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _library_of(default: PluginPackage) -> Path | None:
    directory = _package_dir(default.package)
    return None if directory is None else directory / default.library


def find_plugin(platform: str) -> PluginLocation:
    """Returns the plugin library for a platform.

    Raises PluginNotFoundError naming the environment variable to set and the
    packages to install when there is none.
    """
    variable = env_var(platform)
    explicit = os.environ.get(variable)
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise PluginNotFoundError(
                f"{variable}={explicit} does not name a file; point it at the PJRT plugin "
                f"library (.so) for {platform!r} or unset it to use an installed package"
            )
        own = jaxlib_location(platform)
        if own is not None and str(path.resolve()) in (own.path, _jaxlib_library()):
            return own  # jaxlib's own client, named as its location names it
        return PluginLocation(platform, str(path.resolve()), f"environment variable {variable}")

    facts = platform_named(platform)
    if facts.runs_on_jaxlib:
        found = jaxlib_location(platform)
        if found is not None:
            return found
    defaults = facts.packages
    for default in defaults:
        library = _library_of(default)
        if library is not None and library.is_file():
            return PluginLocation(
                platform, str(library.resolve()), f"package {default.distribution}"
            )
    if defaults:
        packages = " or ".join(_install_hint(d) for d in defaults)
        hint = f"install one ({packages}) or set {variable} to the plugin's .so"
    else:
        hint = f"set {variable} to the path of a PJRT plugin library for {platform!r}"
    raise PluginNotFoundError(f"no PJRT plugin found for platform {platform!r}: {hint}")


def _jaxlib_library() -> str | None:
    """The resolved path of the installed jaxlib's library (JAXLIB_LIBRARIES), or None."""
    directory = _package_dir("jaxlib")
    for name in JAXLIB_LIBRARIES:
        library = None if directory is None else directory / name
        if library is not None and library.is_file():
            return str(library.resolve())
    return None


def jaxlib_location(platform: str) -> PluginLocation | None:
    """The installed jaxlib's own client for a platform, or None where jaxlib (or its library)
    is not installed. Its path is jaxlib's RECORD (JAXLIB_RECORD), else its library. Nothing
    is imported."""
    library = _jaxlib_library()
    if library is None:
        return None
    site = Path(library).parent.parent
    dist_info = dist_info_of(site, "jaxlib")
    record = None if dist_info is None else dist_info / JAXLIB_RECORD
    path = str(record.resolve()) if record is not None and record.is_file() else library
    source = f"jaxlib {_distribution_version('jaxlib')}'s own CPU client"
    return PluginLocation(platform, path, source, RuntimeKind.JAXLIB)


def _distribution_version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "(version unknown)"


def default_plugin_of(location: PluginLocation) -> PluginPackage | None:
    """The default package whose library a plugin is (however it was found), or None."""
    for default in platform_named(location.platform).packages:
        library = _library_of(default)
        if library is not None and library.is_file() and str(library.resolve()) == location.path:
            return default
    return None


def plugin_jax_version(location: PluginLocation) -> str | None:
    """The jax version whose XLA a plugin is built from, when its package says, else None.

    lammps-jax-pjrt-cpu and jax-cudaNN-pjrt carry the version of the jaxlib
    whose XLA they are built from; jaxlib's own client is the installed
    jaxlib's; a plugin named by its path says nothing.
    """
    from importlib import metadata

    if location.kind is RuntimeKind.JAXLIB:
        return _distribution_version("jaxlib")
    default = default_plugin_of(location)
    if default is None or not default.versioned_as_jax:
        return None
    try:
        return metadata.version(default.distribution)
    except metadata.PackageNotFoundError:
        return None


def jit_xla_note(location: PluginLocation) -> str | None:
    """Where a CPU platform's programs do not run on the XLA jax.jit uses here (the installed
    jaxlib's own client): which XLA each side is, and that results may differ in the last
    bits; None for jaxlib's own client and for platforms JAX runs on the plugin itself
    (GPUs, TPUs)."""
    platform = platform_named(location.platform)
    if location.kind is RuntimeKind.JAXLIB or "cpu" not in platform.jax_names:
        return None
    jaxlib_version = _distribution_version("jaxlib")
    built_from = plugin_jax_version(location)
    if built_from == jaxlib_version:
        sides = f"the XLA of jaxlib {built_from}, jax.jit's release here, built apart"
    elif built_from is not None:
        sides = f"the XLA of jaxlib {built_from}, not jaxlib {jaxlib_version}'s, which jax.jit uses"
    else:
        sides = f"an XLA of its own build, not jaxlib {jaxlib_version}'s, which jax.jit uses"
    return (
        f"{sides}: results may differ from jax.jit's in the last bits (pjrt-pool check-plugin "
        f"--platform {location.platform} --exact counts where; platform "
        f"'{_JAXLIB_PLATFORM}' runs on jaxlib's own client)"
    )


_JAXLIB_PLATFORM = "cpu"
"""The platform that runs on jaxlib's own CPU client."""


def newer_plugin_hint(location: PluginLocation) -> str:
    """What to do for a plugin whose XLA is too old: another plugin, never the one loaded (on a
    platform that runs on jaxlib's own client, that client, whose XLA is jaxlib's)."""
    facts = platform_named(location.platform)
    first = next(iter(facts.packages), None)
    variable = env_var(location.platform)
    if location.kind is RuntimeKind.JAXLIB:
        return "use a jaxlib whose XLA takes it (or build it for this one's)"
    if facts.runs_on_jaxlib:
        return f"unset {variable} to run on the installed jaxlib's own client, with jaxlib's XLA"
    if first is not None and default_plugin_of(location) is not first:
        return (
            f"use a plugin built from a newer XLA, such as {first.distribution} "
            f"({_install_command(first)}; unset {variable} if it names another plugin)"
        )
    return f"use a plugin built from a newer XLA (set {variable} to its library)"


def installed_default_library(path: str) -> tuple[Path, Path, str] | None:
    """Which default package's library a plugin file is, if any: (its library path as the
    package has it, the site directory holding the package, the distribution's name).
    jaxlib's own library (JAXLIB_LIBRARIES) is jaxlib's."""
    real = os.path.realpath(path)
    if os.path.basename(real) in JAXLIB_LIBRARIES:
        directory = _package_dir("jaxlib")
        library = None if directory is None else directory / os.path.basename(real)
        if library is not None and os.path.realpath(library) == real:
            return library, library.parents[1], "jaxlib"
    for platform in known_platforms():
        for default in platform.packages:
            if default.library != os.path.basename(real):
                continue  # not this package's file: its package is not even looked for
            library = _library_of(default)
            if library is None or os.path.realpath(library) != real:
                continue
            site = library.parents[len(default.package.split("."))]
            return library, site, default.distribution
    return None
