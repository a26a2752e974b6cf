"""The key under which JAX's persistent cache files a program, computed for the machine
that will run it.

JAX keys an entry (jax._src.cache_key.get) by hashing, part by part: the module
(its bytecode without locations), the jaxlib version, the backend's platform and
platform_version, the XLA flags (XLA_FLAGS, LIBTPU_INIT_ARGS and ``--xla``
arguments), the serialized compile options (a few debug fields cleared), the
accelerator config (the fingerprint of the devices' topology), the compression
and a custom hook. Three of them differ between a CPU machine's deviceless
compile and the same ``jax.jit`` on a TPU VM (docs/jax-cache.md):

- the module: arguments given as deviceless shapes carry shardings, a script's
  numpy arguments none; the program is lowered here from plain shapes, as the
  script calls it;
- the XLA flags: on a TPU VM JAX adds ``--xla_tpu_use_enhanced_launch_barrier=true``
  to LIBTPU_INIT_ARGS before libtpu loads (JaxTarget.flags);
- the compile options: they name the cache directory (XLA's autotuning cache
  under it), so the key depends on the path the script gives JAX.

So a key is made as the target makes it: JAX lowers the function and computes
its compile options itself (the compile is stopped where JAX would look in its
cache: jax._src.compiler.compile_or_get_cached), with the target's cache path
set; the device assignment is then the target's devices', and JAX's own key
function hashes it with the target's backend, devices, flags and compression.
Each part's digest is kept, so that a miss can say which part differs.

The JAX functions used are private; they are named in pool.jax_cache.versions,
which refuses a JAX version whose path was not checked.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from pool.jax_cache.target import JaxTarget
from pool.jax_cache.versions import jax_internals
from worker.errors import PjrtPoolError
from worker.plugin.locate import environment_variables
from worker.records import JaxCompile, LoweredProgram


class JaxProgram(NamedTuple):
    """A program as JAX compiles it for a target, and the key JAX files it under there."""

    name: str
    """The module's name (jit_ and the function's name), which starts the key."""

    key: str
    """JAX's cache key on the target: the name, a dash and 64 hex digits."""

    parts: tuple[tuple[str, str], ...]
    """Each part of the key (as JAX names it: "computation", "backend version", ...) and
    the SHA-256 of that part alone."""

    code: bytes
    """The module's MLIR bytecode, as JAX hands it to the compiler."""

    text: str
    """The module as text, without locations."""

    compile_options: bytes
    """The serialized CompileOptionsProto JAX compiles it with on the target."""

    devices: int
    """How many devices the program runs on."""

    def compile_request(self, target: JaxTarget) -> tuple[LoweredProgram, JaxCompile]:
        """What a pool compiles it from for the target's JAX cache (Pool.submit_compile's
        program and jax)."""
        program = LoweredProgram(
            code=self.code,
            text=self.text,
            platform=target.platform,
            compile_options=self.compile_options,
        )
        topology = None if target.topology is None else target.topology.to_json()
        devices = self.devices if target.platform != "cpu" else target.device_count
        request = JaxCompile(
            self.key, self.parts, topology, devices, target.compression.value, target.describe()
        )
        return program, request


class _StoppedError(PjrtPoolError):
    """Raised in place of JAX's compile, carrying what JAX would have compiled."""


_capturing = threading.local()
_lock = threading.Lock()
"""One key at a time: the capture sets JAX's cache path and reads the environment."""


@contextlib.contextmanager
def _stop_before_compiling() -> Iterator[None]:
    """While active in this thread, JAX's compile path raises _StoppedError(computation,
    devices, compile_options) where it would look in its cache and compile."""
    internals = jax_internals()
    original = internals.compiler.compile_or_get_cached

    def stop(
        backend: Any, computation: Any, devices: Any, compile_options: Any, *rest: Any, **kw: Any
    ) -> Any:
        if getattr(_capturing, "active", False):
            raise _StoppedError(computation, devices, compile_options)
        return original(backend, computation, devices, compile_options, *rest, **kw)

    internals.compiler.compile_or_get_cached = stop
    _capturing.active = True
    try:
        yield
    finally:
        _capturing.active = False
        internals.compiler.compile_or_get_cached = original


@contextlib.contextmanager
def _as_on_target(target: JaxTarget) -> Iterator[None]:
    """This process as the target's JAX sees it, while a key is made: its cache path set in
    JAX's config, its XLA_FLAGS and LIBTPU_INIT_ARGS in the environment, and no ``--xla``
    arguments in sys.argv (JAX hashes those of the process it runs in); all put back."""
    path = jax.config.jax_compilation_cache_dir
    argv = list(sys.argv)
    try:
        jax.config.update("jax_compilation_cache_dir", target.cache_path)
        sys.argv[:] = [a for a in argv if not a.startswith("--xla")]
        with environment_variables(target.flags()):
            yield
    finally:
        sys.argv[:] = argv
        jax.config.update("jax_compilation_cache_dir", path)


class _PartDigests(logging.Handler):
    """Collects the digest of each part that JAX's key function logs at debug level."""

    PREFIX = "get_cache_key hash of serialized "

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.parts: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self.PREFIX):
            name, _, digest = message[len(self.PREFIX) :].rpartition(": ")
            self.parts.append((name, digest))


def _key_with_parts(compute: Callable[[], str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    logger = logging.getLogger(jax_internals().cache_key.__name__)
    handler, level = _PartDigests(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        key = compute()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return key, tuple(handler.parts)


def _jit(function: Callable[..., Any]) -> Any:
    """The function as the script calls it: a jax.jit (its own options kept) or wrapped in one."""
    return function if hasattr(function, "trace") else jax.jit(function)


def jax_program(
    function: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    target: JaxTarget,
) -> JaxProgram:
    """Lowers function(*args, **kwargs) as jax.jit does on the target, and computes the key
    JAX's cache files it under there.

    function is what the script calls: a jax.jit-wrapped function (its options, such as
    donate_argnums or static_argnums, are part of its module) or a plain function, which
    is wrapped in jax.jit. args and kwargs are pytrees of shapes or arrays, as the script
    passes them (static arguments as their values). Raises JaxVersionError on a JAX
    whose compile path was not checked, and what JAX raises for a function it cannot trace.
    """
    internals = jax_internals()
    backend = target.backend()
    with _lock, _as_on_target(target):
        with _stop_before_compiling():
            try:
                _jit(function).trace(*args, **dict(kwargs or {})).lower(
                    lowering_platforms=(target.jax_platform,)
                ).compile()
            except _StoppedError as stopped:
                computation, local_devices, options = stopped.args
            else:  # pragma: no cover - JAX compiled without its cache path
                raise RuntimeError("JAX compiled the program without looking in its cache")
        devices = target.devices_for(np.asarray(local_devices).size)
        options.device_assignment = internals.device_assignment(devices)
        key, parts = _key_with_parts(
            lambda: internals.cache_key.get(
                computation,
                devices,
                options,
                backend,
                target.compression,
                internals.ignore_callbacks(),
            )
        )
        name = internals.module_name(computation)
        code = internals.module_to_bytecode(computation)
        text = computation.operation.get_asm(enable_debug_info=False)
    return JaxProgram(
        name=name,
        key=key,
        parts=parts,
        code=code,
        text=text,
        compile_options=bytes(options.SerializeAsString()),
        devices=int(devices.size),
    )
