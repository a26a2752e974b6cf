"""The JAX versions whose persistent cache pjrt-pool writes and reads, and the private JAX
functions it uses for them.

JAX's cache has no public interface for computing a key elsewhere, or for the
format of an entry. pjrt-pool uses JAX's own functions for both, which are
private and change between releases; each minor version below was checked
(tests/test_jax_cache.py runs on each on CI's legs). Another version is refused
with JaxVersionError rather than written in a format it may not read.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, NamedTuple

import jax
import numpy as np

from worker.errors import PjrtPoolError

CHECKED_VERSIONS = ((0, 10), (0, 11), (0, 12))
"""The (major, minor) JAX versions whose cache format and key function were checked."""

TPU_VM_LIBTPU_ARGS = ("--xla_tpu_use_enhanced_launch_barrier=true",)
"""What JAX adds to LIBTPU_INIT_ARGS on a Cloud TPU VM before libtpu loads
(jax._src.cloud_tpu_init), on every checked version: a key made on the VM hashes it."""


class JaxVersionError(PjrtPoolError, RuntimeError):
    """This JAX's cache format or key function was not checked by this pjrt-pool."""


class JaxInternals(NamedTuple):
    """The parts of JAX that its persistent cache is made of (see the module)."""

    compiler: ModuleType
    """jax._src.compiler: compile_or_get_cached, where JAX looks in its cache."""

    cache_key: ModuleType
    """jax._src.cache_key: get, JAX's key function."""

    compilation_cache: ModuleType
    """jax._src.compilation_cache: the entry format and the cache JAX reads."""

    version: tuple[int, int]
    """This JAX's (major, minor)."""

    def module_name(self, module: Any) -> str:
        """A module's symbol name (jit_f), which starts its key."""
        from jax._src.lib.mlir import ir

        return str(ir.StringAttr(module.operation.attributes["sym_name"]).value)

    def module_to_bytecode(self, module: Any) -> bytes:
        """The module's MLIR bytecode, as JAX hands it to a compiler."""
        from jax._src.interpreters import mlir

        return bytes(mlir.module_to_bytecode(module))

    def device_assignment(self, devices: np.ndarray) -> Any:
        """jaxlib's DeviceAssignment of one replica over `devices` (partitions in order)."""
        from jax._src.lib import xla_client

        ids = np.array([d.id for d in devices.flat], dtype=np.int64).reshape(1, devices.size)
        return xla_client.DeviceAssignment.create(ids)

    def ignore_callbacks(self) -> Any:
        """What JAX leaves out of a module's hash, as its compile path chooses: an
        IgnoreCallbacks (jax 0.10.2), or whether to drop custom partitioning's (0.11, 0.12)."""
        removing = bool(jax.config.jax_remove_custom_partitioning_ptr_from_cache_key)
        choices = getattr(self.cache_key, "IgnoreCallbacks", None)
        if choices is None:
            return removing
        return choices.CUSTOM_PARTITIONING if removing else choices.NO


def jax_version() -> tuple[int, int]:
    """The installed JAX's (major, minor)."""
    major, minor = jax.__version_info__[:2]
    return int(major), int(minor)


@functools.cache
def jax_internals() -> JaxInternals:
    """JAX's cache internals, once checked to be where pjrt-pool expects them.

    Raises JaxVersionError for a JAX outside CHECKED_VERSIONS, or one that moved them.
    """
    version = jax_version()
    if version not in CHECKED_VERSIONS:
        checked = ", ".join(f"{a}.{b}" for a, b in CHECKED_VERSIONS)
        raise JaxVersionError(
            f"JAX {jax.__version__}'s persistent cache format was not checked by this pjrt-pool "
            f"(checked: {checked}); install one of those JAX versions, or a pjrt-pool that "
            "checked yours"
        )
    try:
        from jax._src import cache_key, compilation_cache, compiler
    except ImportError as error:  # pragma: no cover - a checked version has them
        raise JaxVersionError(f"JAX {jax.__version__} moved its cache modules: {error}") from None
    missing = [
        f"{module.__name__}.{name}"
        for module, name in (
            (compiler, "compile_or_get_cached"),
            (cache_key, "get"),
            (compilation_cache, "combine_executable_and_time"),
            (compilation_cache, "compress_executable"),
            (compilation_cache, "decompress_executable"),
            (compilation_cache, "extract_executable_and_time"),
        )
        if not hasattr(module, name)
    ]
    if missing:
        raise JaxVersionError(
            f"JAX {jax.__version__} has no {', '.join(missing)}, which pjrt-pool's JAX cache "
            "support uses; install a checked JAX version"
        )
    return JaxInternals(compiler, cache_key, compilation_cache, version)
