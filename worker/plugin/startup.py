"""What a Pool worker sets up before its plugin loads.

Its cache directory is already this process's default: the parent gave it
as ``PJRT_POOL_CACHE_DIR`` (worker.serve.command_line), so that everything
that defaults to the cache directory, the plugin's records included, uses
the Pool's.

- On CUDA (a platform whose shares_autotune_results says so:
  worker.plugin.platforms), XLA's per-fusion autotune results are shared by every worker and
  every run through a directory in the cache (``autotune/<plugin build>``):
  ``--xla_gpu_per_fusion_autotune_cache_dir`` is added to ``XLA_FLAGS``,
  which XLA reads once, when the plugin first needs its flags. XLA writes
  each result to a temporary file and renames it, so concurrent workers share
  the directory safely, and leaves versioning to its users, hence one
  directory per plugin build. A user's own ``XLA_FLAGS`` that names the flag
  is left as it is (an empty value turns sharing off).
- ``PJRT_POOL_WORKER_LOG=LEVEL`` (for example ``debug``) sends the worker's
  log records to its stderr, which the Pool logs on the ``pjrt_pool.worker``
  logger.
- The time from the parent's spawn to this point is the ``spawn_to_main``
  start-up phase (worker.phases).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

from worker.cache import open_cache
from worker.errors import PluginNotFoundError
from worker.log import get_logger
from worker.phases import STARTUP
from worker.plugin.locate import find_plugin
from worker.plugin.platforms.registry import platform_named
from worker.plugin.xla_flags import plugin_knows_flag

SPAWNED_AT_ENV = "PJRT_POOL_SPAWNED_AT"
"""The time.time() at which the parent spawned this process (set by pool.spawn)."""

WORKER_LOG_ENV = "PJRT_POOL_WORKER_LOG"
"""A logging level name: workers log at that level to their stderr."""

AUTOTUNE_FLAG = "xla_gpu_per_fusion_autotune_cache_dir"

logger = get_logger("pjrt_pool.startup")


def prepare_worker(platform: str) -> None:
    """Sets up a worker process for a platform; call before the plugin loads."""
    spawned = os.environ.pop(SPAWNED_AT_ENV, None)
    if spawned:
        with contextlib.suppress(ValueError):
            STARTUP.add("spawn_to_main", max(0.0, time.time() - float(spawned)))
    level = os.environ.get(WORKER_LOG_ENV)
    if level:
        logging.basicConfig(
            stream=sys.stderr, level=level.upper(), format="%(name)s %(levelname)s: %(message)s"
        )
    with STARTUP.time("autotune_setup"):
        share_autotune_results(platform)


def autotune_dir(cache_dir: Path, plugin_path: str) -> Path:
    """Returns the directory for a plugin build's autotune results in a cache directory."""
    info = os.stat(plugin_path)
    build = f"{os.path.realpath(plugin_path)}\0{info.st_size}\0{info.st_mtime_ns}\0{info.st_ino}"
    return cache_dir / "autotune" / hashlib.sha256(build.encode()).hexdigest()[:16]


def share_autotune_results(platform: str) -> Path | None:
    """Adds the autotune directory flag to XLA_FLAGS for a GPU platform; returns the directory.

    None when nothing was added: another platform, a user's flag, no plugin
    or cache directory to use, or a plugin whose XLA does not know the flag.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if not platform_named(platform).shares_autotune_results or AUTOTUNE_FLAG in flags:
        return None
    try:
        plugin_path = find_plugin(platform).path
    except PluginNotFoundError:
        return None  # loading the plugin reports it
    cache = open_cache()
    if not cache.writable:
        return None
    try:
        if not plugin_knows_flag(plugin_path, AUTOTUNE_FLAG, cache.memos):
            logger.debug(
                "%s does not know --%s; autotune results are not shared", plugin_path, AUTOTUNE_FLAG
            )
            return None
        directory = autotune_dir(cache.directory, plugin_path)
        directory.parent.mkdir(mode=0o700, exist_ok=True)
        directory.mkdir(mode=0o700, exist_ok=True)
    except OSError as error:
        logger.warning("not sharing autotune results: %s", error)
        return None
    if any(c.isspace() or c in "\"'" for c in str(directory)):
        return None  # XLA_FLAGS splits at spaces; such a path cannot be passed safely
    os.environ["XLA_FLAGS"] = f"{flags} --{AUTOTUNE_FLAG}={directory}".strip()
    logger.debug("sharing autotune results in %s", directory)
    return directory
