"""What the parent knows about a platform's plugin without loading it.

lower() must serialize StableHLO that the plugin will read, so it needs the
plugin's StableHLO window. If this process has the plugin loaded (in-process
compile_program), that plugin answers; otherwise a child process probes it
(``python -m worker.probe``), and the answer is memoized in memory and in the
cache directory's ``plugins/`` folder by the library's path, size, mtime and
inode, so a machine probes each plugin build once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import threading
from typing import Any

from pool.errors import describe_exit
from pool.spawn import child_environment, python_command
from worker import find_plugin, loaded_runtime
from worker.cache import open_cache
from worker.cache.atomic import write_atomically
from worker.errors import PluginNotFoundError

PROBE_TIMEOUT = 120.0

_memo: dict[tuple[str, int, int, int], dict[str, Any]] = {}
_memo_lock = threading.Lock()


class PluginProbeError(RuntimeError):
    """Probing a plugin in a child process failed (it crashed or said why)."""


def _probe(platform: str, path: str) -> dict[str, Any]:
    try:
        done = subprocess.run(
            python_command("worker.probe", platform),
            env=child_environment({f"PJRT_POOL_PLUGIN_{platform.upper()}": path}),
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

    Raises PluginProbeError when the plugin exists but cannot be loaded.
    """
    runtime = loaded_runtime()
    if runtime is not None and runtime.platform == platform:
        return runtime.describe()
    try:
        location = find_plugin(platform)
    except PluginNotFoundError:
        return None
    stat = os.stat(location.path)
    identity = (location.path, stat.st_size, stat.st_mtime_ns, stat.st_ino)
    with _memo_lock:
        if identity in _memo:
            return _memo[identity]
    cache = open_cache()
    memo_file = cache.plugins_dir / (
        "probe-" + hashlib.sha256(repr(identity).encode()).hexdigest()[:32] + ".json"
    )
    try:
        record = json.loads(memo_file.read_text())
        answer = record["answer"] if record.get("identity") == list(identity) else None
    except (OSError, ValueError, KeyError):
        answer = None
    if answer is None:
        answer = _probe(platform, location.path)
        # No writable cache directory: the next process probes again.
        with contextlib.suppress(OSError):
            write_atomically(
                memo_file, json.dumps({"identity": list(identity), "answer": answer}).encode()
            )
    with _memo_lock:
        _memo[identity] = answer
    return answer
