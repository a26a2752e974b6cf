"""``pjrt-pool --version``: the version, where it was installed from, and each platform's plugin.

What a bug report needs in a few lines: pjrt-pool's version and source (a
checkout, editable or not, or a wheel: worker.extras.installed_from), the
Python, jax and jaxlib versions, and for each platform a plugin could be
found for (each a module of worker.plugin.platforms describes, and any a
PJRT_POOL_PLUGIN_<PLATFORM> names) the plugin this machine would load, or
why there is none and how to install one.
For a CPU platform it also says whether its programs run on the XLA that
jax.jit uses here (the installed jaxlib's own client, the ``cpu`` platform's)
or on a CPU plugin, another build of XLA whose results may differ from
jax.jit's in the last bits (worker.plugin.locate.jit_xla_note).
Nothing is imported or loaded to say it: versions come from the installed
distributions' metadata, and plugins are located as worker.plugin.locate
locates them, without loading them.
"""

from __future__ import annotations

import os
import platform as python_platform
from importlib import metadata

from pool import __version__
from worker.errors import PluginNotFoundError
from worker.extras import installed_from
from worker.plugin.locate import (
    ENV_PREFIX,
    RuntimeKind,
    default_plugin_of,
    find_plugin,
    jit_xla_note,
)
from worker.plugin.platforms.registry import known_platforms
from worker.plugin.runtime import PLATFORM_ENV, default_platform


def _platforms() -> list[str]:
    """The platforms a plugin could be found for here: those a module of
    worker.plugin.platforms describes, and those a PJRT_POOL_PLUGIN_<PLATFORM> names."""
    named = {
        name[len(ENV_PREFIX) :].lower()
        for name, value in os.environ.items()
        if name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX) and value
    }
    return sorted({platform.name for platform in known_platforms()} | named)


def _version_of(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _plugin_line(platform: str) -> str:
    """What this machine would load for a platform: the plugin's package, version and path,
    or the variable that names it; else why there is none (with the command that installs
    one)."""
    try:
        location = find_plugin(platform)
    except PluginNotFoundError as error:
        return f"none: {error}"
    if location.kind is RuntimeKind.JAXLIB:
        return f"{location.source}, the XLA jax.jit uses here (identity: {location.path})"
    default = default_plugin_of(location)
    if default is None:
        found = f"{location.path} ({location.source})"
    else:
        found = f"{default.distribution} {_version_of(default.distribution)}: {location.path}"
    note = jit_xla_note(location)
    return found if note is None else f"{found}; {note}"


def describe() -> str:
    """The lines ``pjrt-pool --version`` prints."""
    source = installed_from()
    where = "its source unrecorded" if source is None else f"from {source.describe()}"
    lines = [
        f"pjrt-pool {__version__}, {where}",
        f"Python {python_platform.python_version()}, jax {_version_of('jax')}, "
        f"jaxlib {_version_of('jaxlib')}",
        f"plugins by platform (the default platform: {default_platform()}"
        + (", from $PJRT_POOL_PLATFORM):" if os.environ.get(PLATFORM_ENV) else "):"),
    ]
    platforms = _platforms()
    width = max(map(len, platforms))
    lines += [f"  {name:<{width}}  {_plugin_line(name)}" for name in platforms]
    return "\n".join(lines)
