"""jaxlib's CPU client behind the interface of the native module's Plugin and Client.

worker.plugin.runtime holds a process's runtime as a plugin handle and a
client; for jaxlib's own CPU client these are JaxlibPlugin (the library's
identity, its StableHLO and XLA FFI versions, custom-call registration, and
making clients) and JaxlibClient (its devices, compiling, loading, and
keeping arrays), with the methods of ``_pjrt.Plugin`` and ``_pjrt.Client``
that the rest of the worker calls.

How many devices a client has decides numbers, not only capacity: XLA's CPU
client splits its threads among its devices, and a convolution's gradient
computed on a client of 4 devices differs in its last bits from the same
executable's on a client of 1. So a client here has as many devices as JAX's
own CPU client would have in this process (jax_devices: JAX's
jax_num_cpu_devices, or XLA_FLAGS' --xla_force_host_platform_device_count,
else 1), or more where a program needs more.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from worker import _pjrt
from worker.errors import DeviceCountError, TopologyError
from worker.identity.environment import XLA_FLAGS_ENV, parse_xla_flags
from worker.identity.options import debug_options_of, with_debug_options
from worker.plugin.jaxlib_cpu import calls
from worker.plugin.jaxlib_cpu.executable import JaxlibExecutable

JAX_DEVICES_ENV = "JAX_NUM_CPU_DEVICES"
"""JAX's variable for jax_num_cpu_devices: the devices of its CPU client. A pool sets it for
its workers to the value its parent's JAX has (pool.spawn), so that theirs match."""

FORCE_DEVICES_FLAG = "xla_force_host_platform_device_count"
"""The XLA flag that gives jaxlib's CPU client its devices when JAX's setting does not."""


def jax_devices() -> int:
    """How many devices JAX's CPU client has in this process, or would have in a process of
    this environment: JAX's jax_num_cpu_devices where JAX is imported here and it is set
    (never importing JAX), else its variable JAX_NUM_CPU_DEVICES, else the XLA flag
    --xla_force_host_platform_device_count in XLA_FLAGS, else 1 (jaxlib's default).
    Raises ValueError for a value that is not a count."""
    jax = sys.modules.get("jax")
    configured = getattr(getattr(jax, "config", None), "jax_num_cpu_devices", None)
    if isinstance(configured, int) and configured >= 0:
        return max(configured, 1)
    text = os.environ.get(JAX_DEVICES_ENV, "").strip()
    if text:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(
                f"{JAX_DEVICES_ENV} must be a number of devices, not {text!r}"
            ) from None
        if value >= 0:
            return max(value, 1)
    flags = os.environ.get(XLA_FLAGS_ENV, "")
    named = parse_xla_flags(flags) if flags.lstrip().startswith("-") else {}
    forced = named.get(FORCE_DEVICES_FLAG)
    if forced is not None and forced.isdigit() and int(forced) > 0:
        return int(forced)
    return 1


class JaxlibPlugin:
    """jaxlib's CPU client as a process loads it (the counterpart of ``_pjrt.Plugin``)."""

    has_ffi_registration = True
    """Custom-call handlers register with jaxlib's XLA (register_ffi_handler)."""

    def __init__(self, path: str) -> None:
        self.path = path
        """The library that holds jaxlib's XLA (its identity: worker.plugin.locate)."""
        self.version = calls.version()
        """The installed jaxlib's version."""

    @functools.cached_property
    def _attributes(self) -> dict[str, Any]:
        minimum, current = calls.stablehlo_window()
        return {"stablehlo_minimum_version": minimum, "stablehlo_current_version": current}

    def attributes(self) -> dict[str, Any]:
        """The StableHLO versions jaxlib reads, named as a plugin's attributes name them."""
        return dict(self._attributes)

    def ffi_api_version(self, platform: str) -> tuple[int, int] | None:
        """The XLA FFI API version of jaxlib's XLA (the same for every FFI platform)."""
        return calls.ffi_api_version()

    def register_ffi_handler(
        self, target: str, handler: Any, platform: str, traits: int = 0
    ) -> dict[str, Any]:
        """Registers a typed XLA FFI handler for a CPU custom-call target with jaxlib's XLA,
        as JAX registers its own; returns what a plugin's registration says. jaxlib's XLA
        checks the handler's version itself (its own kernels are of its version)."""
        if platform != "Host":
            raise ValueError(f"jaxlib's CPU client registers handlers for 'Host', not {platform!r}")
        try:
            calls.register_ffi_target(target, handler, traits)
        except calls.FfiRefusalError as refusal:  # as a plugin's refusal: kernels.py reads either
            error = _pjrt.HandlerVersionError(str(refusal))
            error.code, error.code_name = 9, "FAILED_PRECONDITION"
            error.handler_version, error.plugin_version = (
                refusal.handler_version,
                (refusal.runtime_version),
            )
            raise error from None
        return {"plugin_version": self.ffi_api_version(platform), "handler_version": None,
                "adapted": False}  # fmt: skip

    def client(self, devices: int) -> JaxlibClient:
        """A new client of `devices` devices."""
        return JaxlibClient(calls.make_client(devices), self.version)

    @staticmethod
    def let_go() -> None:
        """Drops the host arrays XLA is done with now, rather than at jaxlib's next call
        (calls.collect_garbage): memory a worker was told to let go of is let go of."""
        calls.collect_garbage()


class JaxlibClient:
    """A jaxlib CPU client (the counterpart of ``_pjrt.Client``)."""

    platform_name = "cpu"

    def __init__(self, client: Any, version: str) -> None:
        self._client = client
        self._devices = calls.devices_of(client)
        self._by_id = {device.id: device for device in self._devices}
        self.platform_version = f"jaxlib {version}"
        """What the client runs: jaxlib's own CPU client of this version (part of keys)."""
        self._lock = threading.Lock()

    @property
    def device_kind(self) -> str:
        """The devices' kind, as jaxlib says it ("cpu")."""
        return str(self._devices[0].device_kind)

    @property
    def num_devices(self) -> int:
        """How many devices the client has."""
        return len(self._devices)

    @property
    def device_ids(self) -> list[int]:
        """The devices' ids, in order."""
        return [device.id for device in self._devices]

    def devices(self, ids: Sequence[int] | None) -> list[Any]:
        """The devices of these ids (None: the first device); raises DeviceCountError for an
        id this client does not have."""
        if ids is None:
            return self._devices[:1]
        missing = [i for i in ids if i not in self._by_id]
        if missing:
            raise DeviceCountError(
                f"the program runs on devices {list(ids)}, but this process's jaxlib CPU client "
                f"has devices {self.device_ids}: give JAX's CPU client as many "
                f"({JAX_DEVICES_ENV}, or jax.config.update('jax_num_cpu_devices', n))",
                max(ids) + 1,
                self.num_devices,
            )
        return [self._by_id[i] for i in ids]

    def compile(
        self, code: bytes, options: bytes, device_ids: Sequence[int] | None = None
    ) -> JaxlibExecutable:
        """Compiles StableHLO bytecode with serialized compile options for these devices
        (None: the first).

        Options without XLA's debug options (worker.identity.options.compile_options()'s six
        bytes) get jaxlib's default debug options, those JAX's own options start from: XLA
        would otherwise compile with every debug option at zero, where max(x, NaN) is x,
        not NaN. Nothing else is added (an empty proto still says no replicas, which XLA
        aborts on, as a plugin's XLA does).
        """
        if debug_options_of(options) is None:
            defaults = debug_options_of(calls.default_compile_options())
            if defaults is not None:
                options = with_debug_options(options, defaults)
        devices = self.devices(device_ids)
        return JaxlibExecutable(self, calls.compile_and_load(self._client, code, options, devices))

    def deserialize(
        self, serialized: bytes, device_ids: Sequence[int] | None = None
    ) -> JaxlibExecutable:
        """Loads what JaxlibExecutable.serialize gave onto the devices it was compiled for."""
        devices = self.devices(device_ids)
        return JaxlibExecutable(self, calls.deserialize(self._client, serialized, devices))

    def topology(self) -> Any:
        """Raises TopologyError: jaxlib's CPU client compiles for its own devices only."""
        raise TopologyError(
            "jaxlib's CPU client compiles for the devices it holds, not for a topology"
        )

    def put(self, array: np.ndarray) -> Any:
        """A copy of an array on the first device (a value a worker keeps)."""
        device = self._devices[0]
        block = np.ascontiguousarray(array)
        aval = calls.abstract(block.shape, block.dtype)
        return calls.put([block], [device], calls.one_device(device), False, aval)

    @staticmethod
    def host(value: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A value on one device (of this dtype and shape) as a numpy view of its
        buffer, once computed."""
        return calls.host_view(value, dtype, shape)

    @staticmethod
    def wait(values: Sequence[Any]) -> None:
        """Waits until values are computed; raises PjrtError for a run that failed."""
        calls.ready(values)


_clients: dict[int, JaxlibClient] = {}
_clients_lock = threading.Lock()


def serialized_for_jax(
    code: bytes, options: bytes, devices: int, device_ids: Sequence[int] | None = None
) -> bytes:
    """A program compiled as jax.jit compiles it on a CPU client of `devices` devices, over
    `device_ids` (None: the first), serialized as JAX's persistent cache stores it
    (``executable.serialize()``, behind JAX's own header of the compile time): options are
    JAX's for the program (pool.lowering records them). Compiled here, on a client of that
    many devices made once per count (not the process's runtime's, whose count is JAX's
    here), with the installed jaxlib's XLA, the one jax.jit uses."""
    with _clients_lock:
        client = _clients.get(devices)
        if client is None:
            client = _clients[devices] = JaxlibClient(calls.make_client(devices), calls.version())
    return client.compile(code, options, device_ids).serialize()
