"""What the parent knows about a platform's plugin without loading it.

lower() must serialize StableHLO that the plugin will read, so it needs the
plugin's StableHLO window. If this process has the plugin loaded (in-process
compile_program), that plugin answers; otherwise a child process probes it
(``python -m worker.plugin.probe``), and the answer is memoized in memory and in the
cache directory's ``plugins/`` folder by the library's path, size, mtime and
inode, so a machine probes each plugin build once. lower() also needs the
library's SHA-256, which says whether it is a build known to miscompile
something (worker.plugin.known_builds): it is the digest the cache keys use,
memoized the same way, so the parent and the workers hash a build once
between them.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from pool.errors import describe_exit
from pool.spawn import child_environment, python_command
from worker import find_plugin, loaded_runtime
from worker.cache import UntrustedCacheError, open_cache
from worker.errors import PjrtPoolError, PluginNotFoundError
from worker.identity.build import memoized_by_file, plugin_digest
from worker.plugin.locate import env_var

PROBE_TIMEOUT = 120.0


class PluginProbeError(PjrtPoolError, RuntimeError):
    """Probing a plugin in a child process failed (it crashed or said why)."""


def _probe(platform: str, path: str) -> dict[str, Any]:
    try:
        done = subprocess.run(
            python_command("worker.plugin.probe", platform),
            env=child_environment({env_var(platform): path}),
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise PluginProbeError(
            f"probing the {platform} plugin {path} took over {PROBE_TIMEOUT:.0f} s"
        ) from None
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise PluginProbeError(
            f"probing the {platform} plugin {path} failed: the probe process "
            f"{describe_exit(done.returncode)}; its stderr ends with:\n{done.stderr[-2000:]}"
        ) from None
    if "error" in answer:
        raise PluginProbeError(f"cannot use the {platform} plugin: {answer['error']}")
    return answer


def plugin_info(platform: str) -> dict[str, Any] | None:
    """Returns the identity and StableHLO window of a platform's plugin, or None if none is found.

    The identity includes ``plugin_sha256``, the SHA-256 of the library.
    Raises PluginProbeError when the plugin exists but cannot be loaded.
    """
    runtime = loaded_runtime()
    if runtime is not None and runtime.platform == platform:
        return {**runtime.describe(), "plugin_sha256": runtime.plugin_sha256()}
    try:
        location = find_plugin(platform)
    except PluginNotFoundError:
        return None
    try:
        cache = open_cache()
        memos = cache.memos if cache.usable else None
    except UntrustedCacheError:
        # lower() needs no cache; compiling will refuse this directory and say why.
        memos = None
    probed = memoized_by_file(
        location.path, memos, "probe", lambda: _probe(platform, location.path), _is_probe
    )
    return {**probed, "plugin_sha256": plugin_digest(location.path, memos)}


def _is_probe(value: Any) -> bool:
    """Whether a remembered probe answer has the fields lower() reads, as strings."""
    return isinstance(value, dict) and all(
        isinstance(value.get(name), (str, type(None)))
        for name in ("stablehlo_minimum_version", "stablehlo_current_version", "platform")
    )
