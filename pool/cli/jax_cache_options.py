"""The options that name JAX's own persistent cache and the target its entries are for
(``--jax-cache DIR`` and the rest), as ``pjrt-pool warm`` writes the entries and ``pjrt-pool
cache explain`` explains their misses (pool.jax_cache). Runs in the command's process.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pool.cli.main import UsageError
from pool.cli.options import topology_option
from worker.cache.jax_values import Compression
from worker.plugin.runtime import default_platform

if TYPE_CHECKING:
    from pool.jax_cache.entries import JaxCacheDestination

PATH_FOR_INSTALL = "pjrt-pool"
"""--jax-cache's name for pjrt-pool's own stores (pool.jax_cache.backing.PATH_IN_KEYS: what
install() sets jax_compilation_cache_dir to)."""


def add_jax_cache_options(command: Any, does: str, with_dir: str) -> None:
    """Adds the options that name a JAX cache and its target (--jax-cache and the rest):
    `does` says what the command does for JAX's cache, `with_dir` what it does with DIR."""
    jax = command.add_argument_group(
        "JAX's own persistent cache",
        f"{does}, as an unmodified jax.jit on the target keys it (docs/jax-cache.md); the "
        "spec's functions are what the script calls (a jax.jit, its options kept, or a "
        "function jax.jit wraps); run it with the target's XLA_FLAGS",
    )
    jax.add_argument(
        "--jax-cache",
        metavar="DIR",
        help=f"{with_dir}; '{PATH_FOR_INSTALL}': pjrt-pool's disk cache and remote tier alone, "
        "for scripts that call pool.jax_cache.install()",
    )
    jax.add_argument(
        "--jax-cache-path",
        metavar="PATH",
        help="the jax_compilation_cache_dir the target's script sets, which is part of JAX's "
        f"key (default: DIR, made absolute; '{PATH_FOR_INSTALL}' with install())",
    )
    jax.add_argument(
        "--jax-compression",
        choices=[c.value for c in Compression],
        default=Compression.ZLIB.value,
        metavar="{zlib,zstandard}",
        help="how the target's JAX compresses entries: zstandard where it can import it, else "
        "zlib (default)",
    )
    jax.add_argument(
        "--jax-cpu-devices",
        type=int,
        default=1,
        metavar="N",
        help="the CPU devices of the target's JAX (jax_num_cpu_devices; default 1)",
    )
    jax.add_argument(
        "--libtpu-init-args",
        metavar="ARGS",
        help="LIBTPU_INIT_ARGS in the target's environment (default: none; JAX on a TPU VM "
        "adds its own, which the key includes)",
    )


def check_jax_version() -> None:
    """Raises UsageError where the installed JAX's cache was not checked (its entry format
    and key function may differ): before anything is lowered or compiled for it."""
    from pool.jax_cache.versions import JaxVersionError, jax_internals  # imports JAX

    try:
        jax_internals()
    except JaxVersionError as error:
        raise UsageError(str(error)) from None


def jax_cache_option(args: argparse.Namespace) -> JaxCacheDestination | None:
    """The destination --jax-cache names, and the target its entries are made for."""
    if args.jax_cache is None:
        return None
    from pool.jax_cache.entries import JaxCacheDestination  # imports JAX: only when asked
    from pool.jax_cache.target import JaxTarget

    installed = args.jax_cache == PATH_FOR_INSTALL
    directory = None if installed else str(Path(args.jax_cache).absolute())
    path = args.jax_cache_path or (PATH_FOR_INSTALL if installed else directory)
    target = JaxTarget(
        platform=args.platform or default_platform(),
        cache_path=str(path),
        topology=topology_option(args),
        device_count=args.jax_cpu_devices,
        compression=Compression(args.jax_compression),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        libtpu_init_args=args.libtpu_init_args,
    )
    return JaxCacheDestination(target, directory)
