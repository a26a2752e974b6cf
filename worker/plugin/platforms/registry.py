"""Finding a platform by its name: the module of that name here, else an unlisted platform.

A platform's module is imported when its platform is first asked for, so a
process reads only its own (a worker of a CPU pool never imports the CUDA
module); known_platforms goes through them all, for what must look at every
one (whose package a plugin file is, which platform a device of JAX's is).
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Iterator

from worker.plugin.platforms.platform import Platform, UnlistedPlatform

_PACKAGE = __name__.rpartition(".")[0]
_DIRECTORY = os.path.dirname(__file__)
_MODULE_NAME = re.compile(r"[a-z][a-z0-9_]*")
_found: dict[str, Platform] = {}


def platform_named(name: str) -> Platform:
    """The platform of that name: its module's PLATFORM, or an UnlistedPlatform when no
    module here describes it (its plugin can still be named by PJRT_POOL_PLUGIN_<NAME>)."""
    found = _found.get(name)
    if found is None:
        found = _listed(name) or UnlistedPlatform(name)
        _found[name] = found
    return found


def _listed(name: str) -> Platform | None:
    """The PLATFORM of the module named `name` here, or None when there is no such module
    (or it is one of the modules that describe no platform)."""
    if not _MODULE_NAME.fullmatch(name):
        return None
    module_name = f"{_PACKAGE}.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise  # the module is there, and something it imports is not: a bug to see
        return None
    platform = getattr(module, "PLATFORM", None)
    if isinstance(platform, Platform) and platform.name == name:
        return platform
    return None


def known_platforms() -> Iterator[Platform]:
    """Every platform a module here describes, in the order of their names, each module
    imported as it is reached (a caller that stops at the first that fits imports no more)."""
    names = sorted(
        entry[: -len(".py")]
        for entry in os.listdir(_DIRECTORY)
        if entry.endswith(".py") and not entry.startswith("_")
    )
    for name in names:
        platform = platform_named(name)
        if not isinstance(platform, UnlistedPlatform):
            yield platform


def platform_of_jax_device(jax_platform: str, platform_version: str = "") -> str:
    """The platform of a device of JAX's, from its platform ("gpu") and its client's platform
    version ("rocm 60300"): among the platforms JAX knows by their own names and by
    jax_platform, the one the version names, else the first by name (CUDA for "gpu");
    jax_platform itself when no platform here is JAX's for it."""
    version = platform_version.lower()
    candidates = [
        p for p in known_platforms() if p.jax_names[:1] == (p.name,) and jax_platform in p.jax_names
    ]
    named = [p for p in candidates if p.name in version]
    chosen = (named or candidates)[:1]
    return chosen[0].name if chosen else jax_platform
