"""The machine a JAX cache entry is made for: its platform and devices, the path its script
gives JAX's cache, the flags its JAX sees, and how its JAX compresses entries.

A key (pool.jax_cache.keys) hashes the target's backend (platform and
platform_version) and the topology of its devices. For a TPU topology both come
from libtpu here, without a chip: a deviceless v5e:1x1 has the platform version
and topology fingerprint of the one-chip VM (docs/jax-cache.md). For the CPU
they are this machine's: CPU entries are for machines like this one (XLA:CPU
compiles for the host's instruction set).
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import numpy as np

from pool.jax_cache.versions import TPU_VM_LIBTPU_ARGS
from worker.cache.jax_values import Compression
from worker.plugin.platforms.registry import platform_named
from worker.plugin.topology import TopologySpec


def local_compression() -> Compression:
    """The compression this process's JAX uses (zstandard where importable)."""
    from pool.jax_cache.versions import jax_internals

    cache = jax_internals().compilation_cache
    has_zstd = getattr(cache, "zstd", None) is not None or getattr(cache, "zstandard", None)
    return Compression.ZSTANDARD if has_zstd else Compression.ZLIB


class JaxTarget(NamedTuple):
    """Where a JAX cache entry will be read (see the module)."""

    platform: str
    """pjrt-pool's platform name: "cpu" or "tpu"."""

    cache_path: str
    """jax_compilation_cache_dir as the target's script sets it (part of the key)."""

    topology: TopologySpec | None = None
    """For a TPU: the topology its JAX sees (a VM of one v5e chip: v5e:1x1)."""

    device_count: int = 1
    """For the CPU: the devices of its JAX's CPU client (jax_num_cpu_devices)."""

    compression: Compression = Compression.ZLIB
    """How its JAX compresses entries."""

    xla_flags: str = ""
    """XLA_FLAGS in the target's environment."""

    libtpu_init_args: str | None = None
    """LIBTPU_INIT_ARGS as the target's JAX sees them once libtpu loads; None: empty in its
    environment, to which JAX on a TPU VM adds TPU_VM_LIBTPU_ARGS."""

    @property
    def jax_platform(self) -> str:
        """The platform's name in JAX (lowering_platforms)."""
        return platform_named(self.platform).jax_names[0]

    def flags(self) -> dict[str, str | None]:
        """The environment the key's XLA flags are read from, as the target's JAX has it."""
        args = self.libtpu_init_args
        if args is None:
            args = " " + " ".join(TPU_VM_LIBTPU_ARGS) if self.platform == "tpu" else None
        return {"XLA_FLAGS": self.xla_flags or None, "LIBTPU_INIT_ARGS": args}

    def backend(self) -> Any:
        """A jaxlib client with the target's platform and platform_version."""
        return self.devices_for(1).flat[0].client

    def devices_for(self, count: int) -> np.ndarray:
        """The target's first `count` devices (jaxlib devices, for the key's device
        assignment and topology); raises ValueError where it has fewer."""
        devices = _devices(self.platform, self.topology, self.device_count)
        if count > len(devices):
            raise ValueError(
                f"the program runs on {count} devices but the target ({self.describe()}) has "
                f"{len(devices)}"
            )
        found = np.empty(count, dtype=object)
        found[:] = devices[:count]
        return found

    def describe(self) -> str:
        """The target for people: "tpu v5e:1x1" or "cpu, 1 device"."""
        if self.topology is not None:
            return f"{self.platform} {self.topology}"
        return f"{self.platform}, {self.device_count} device{'s' if self.device_count > 1 else ''}"


@functools.cache
def _devices(platform: str, topology: TopologySpec | None, count: int) -> tuple[Any, ...]:
    if platform == "tpu":
        if topology is None:
            raise ValueError("a TPU target names its topology (v5e:1x1, v5e:2x2, ...)")
        return _topology_devices(topology)
    if platform != "cpu":
        raise ValueError(
            f"JAX cache entries are made for the CPU and TPU topologies, not {platform!r}"
        )
    from jax._src.lib import _jax

    client = _jax.get_tfrt_cpu_client(asynchronous=True, num_devices=count)
    return tuple(client.local_devices())


def _topology_devices(topology: TopologySpec) -> tuple[Any, ...]:
    """The devices of a TPU topology, from libtpu without a chip (JAX's deviceless path)."""
    for name, value in platform_named("tpu").compile_only_environment().items():
        os.environ.setdefault(name, value)  # read by libtpu as it loads, once
    from jax.experimental import topologies

    description = topologies.get_topology_desc(topology.name, "tpu", **topology.create_options())
    return tuple(description.devices)
