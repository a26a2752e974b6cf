"""Finding the PJRT plugin library for a platform.

A plugin is found, in order:

1. at the path in the environment variable ``PJRT_POOL_PLUGIN_<PLATFORM>``
   (for example ``PJRT_POOL_PLUGIN_CPU=/opt/xla/pjrt_cpu.so``);
2. in the first installed default package for the platform, as its module
   lists them (worker.plugin.platforms: Platform.packages): for ``cpu``,
   ``lammps-jax-pjrt-cpu`` (the extra ``pjrt-pool[cpu]``) and then
   ``xla-cpu-pjrt``; for ``cuda``, ``jax-cuda13-pjrt`` and then
   ``jax-cuda12-pjrt`` (``pjrt-pool[cuda13]``, ``pjrt-pool[cuda12]``); for
   ``tpu``, ``libtpu`` (``pjrt-pool[tpu]``, which brings the libtpu of the
   installed jax, as ``jax[tpu]`` does).

Packages are located without being imported, so finding a plugin costs no
imports (the CUDA packages import JAX).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

from worker.errors import PluginNotFoundError
from worker.extras import install_extra_command
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


class PluginLocation(NamedTuple):
    """Where the plugin for a platform lives, and how it was chosen."""

    platform: str
    """The platform the plugin serves ("cpu", "cuda", ...)."""

    path: str
    """Absolute path of the plugin's shared library."""

    source: str
    """How it was found: the environment variable or the package that gave it."""


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
        return PluginLocation(platform, str(path.resolve()), f"environment variable {variable}")

    defaults = platform_named(platform).packages
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
    whose XLA they are built from; a plugin named by its path says nothing.
    """
    from importlib import metadata

    default = default_plugin_of(location)
    if default is None or not default.versioned_as_jax:
        return None
    try:
        return metadata.version(default.distribution)
    except metadata.PackageNotFoundError:
        return None


def newer_plugin_hint(location: PluginLocation) -> str:
    """What to do for a plugin whose XLA is too old: another plugin, never the one loaded."""
    first = next(iter(platform_named(location.platform).packages), None)
    variable = env_var(location.platform)
    if first is not None and default_plugin_of(location) is not first:
        return (
            f"use a plugin built from a newer XLA, such as {first.distribution} "
            f"({_install_command(first)}; unset {variable} if it names another plugin)"
        )
    return f"use a plugin built from a newer XLA (set {variable} to its library)"


def installed_default_library(path: str) -> tuple[Path, Path, str] | None:
    """Which default package's library a plugin file is, if any: (its library path as the
    package has it, the site directory holding the package, the distribution's name)."""
    real = os.path.realpath(path)
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
