"""JAX's persistent cache backed by pjrt-pool's disk cache and remote tier: ``install()``.

After ``install()``, an unmodified ``jax.jit`` in this process reads JAX's cache
from pjrt-pool's stores and publishes what it compiles there:

- reads go to the disk cache, then the remote tier (verified, and signed where
  the fleet signs; pool.jax_cache values are entries like executables,
  worker.cache.blobs);
- a miss claims the key (the disk cache's lock for this host, the remote's
  lease for the fleet) while JAX compiles, so one host compiles what the
  fleet needs and the others wait for it;
- every process publishes what it compiled, not only process 0, whatever the
  compile took (JAX writes only from process 0, above
  jax_persistent_cache_min_compile_time_secs), and the remote is create-only;
- a miss is explained: which parts of JAX's key differ from the nearest entry
  of the same program (pool.jax_cache.explain), in one warning per program.

JAX's key includes jax_compilation_cache_dir's path (pool.jax_cache.keys), so
install sets it to PATH_IN_KEYS, the same on every host; ``pjrt-pool warm
--jax-cache pjrt-pool`` warms for it. The JAX internals it replaces are those
of pool.jax_cache.versions.
"""

from __future__ import annotations

import inspect
import pathlib
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import jax

from pool.jax_cache.explain import Explanation, Known, explain, name_of
from pool.jax_cache.keys import _key_with_parts
from pool.jax_cache.target import local_compression
from pool.jax_cache.versions import jax_internals
from worker.cache.blobs import BlobStore
from worker.cache.jax_values import Compression, pack
from worker.cache.open_caches import open_cache
from worker.cache.remote import open_remote

PATH_IN_KEYS = "pjrt-pool"
"""jax_compilation_cache_dir once installed: a name, the same on every host (see the module)."""

JAX_KEY_PART = "jax_cache"
"""The part of an entry's key parts that names JAX's key (worker.cache.blobs)."""


class JaxCacheMissWarning(UserWarning):
    """JAX's cache missed a program; the message says which parts of its key differ."""


def parts_of(jax_key: str) -> dict[str, Any]:
    """The key parts of the entry that holds JAX's value for a key."""
    return {JAX_KEY_PART: jax_key}


class _Call(threading.local):
    """What one thread's compile (compile_or_get_cached) did with the cache."""

    def __init__(self) -> None:
        self.compiling = False
        self.missed: list[str] = []
        self.put: dict[str, bytes] = {}
        """What JAX put during the compile, filed when it ends (with its key's parts)."""


class JaxCacheBacking:
    """JAX's CacheInterface on pjrt-pool's stores (see the module); made by install()."""

    def __init__(self, store: BlobStore, compression: Compression, explain: bool) -> None:
        self.store = store
        self.compression = compression
        self.explain_misses = explain
        self._path = pathlib.Path(PATH_IN_KEYS)
        self._call = _Call()
        self._explained: set[str] = set()
        self.explanations: list[Explanation] = []
        """This process's explained misses, oldest first."""

    # -- JAX's CacheInterface --------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """JAX's value for a key, or None (a miss, then claimed: see the module)."""
        value = self.store.get(parts_of(key))
        if value is None:
            self._call.missed.append(key)
        return value

    def put(self, key: str, value: bytes) -> None:
        """Files JAX's value for a key (ends this process's claim of it); during a compile,
        once it ends, with the digests of its key's parts."""
        if self._call.compiling:
            self._call.put[key] = value
        else:
            self._put(key, value, None)

    # -- what the compile path adds ---------------------------------------------------

    def _put(self, key: str, value: bytes, parts: dict[str, str] | None) -> None:
        metadata: dict[str, Any] = {
            "name": name_of(key),
            "made_by": "jax",
            "jax": jax.__version__,
            "compression": self.compression.value,
            "created": time.time(),
        }
        if parts is not None:
            metadata["jax_parts"] = parts
        self.store.put(parts_of(key), metadata, value)

    def compiling(self) -> None:
        """JAX's compile path (compile_or_get_cached) begins in this thread."""
        self._call.compiling = True

    def compiled(self, arguments: dict[str, Any], executable: Any, seconds: float) -> None:
        """After JAX's compile path: files what it put, and what it compiled but did not put
        (not process 0), with its key's parts; explains each miss; ends every claim left."""
        missed, self._call.missed = self._call.missed, []
        put, self._call.put = self._call.put, {}
        self._call.compiling = False
        backend, computation, devices, options, host_callbacks = (
            arguments[name]
            for name in ("backend", "computation", "devices", "compile_options", "host_callbacks")
        )
        for key in dict.fromkeys([*missed, *put]):
            parts = self._parts(key, backend, computation, devices, options)
            if key in missed and self.explain_misses:
                self._explain(key, parts)
            value = put.get(key)
            if value is None and executable is not None and not host_callbacks:
                try:
                    value = pack(executable.serialize(), seconds, self.compression)
                except Exception:  # an executable that does not serialize: nothing to share
                    value = None
            if value is None:
                self.store.release(parts_of(key))
            else:
                self._put(key, value, parts)

    def _parts(
        self, key: str, backend: Any, computation: Any, devices: Any, options: Any
    ) -> dict[str, str] | None:
        internals = jax_internals()
        computed, parts = _key_with_parts(
            lambda: internals.cache_key.get(
                computation,
                devices,
                options,
                backend,
                self.compression.value,
                internals.ignore_callbacks(),
            )
        )
        return dict(parts) if computed == key else None

    def _explain(self, key: str, parts: dict[str, str] | None) -> None:
        if parts is None or name_of(key) in self._explained:
            return
        self._explained.add(name_of(key))
        found = explain(key, parts, known_entries(self.store))
        self.explanations.append(found)
        warnings.warn(str(found), JaxCacheMissWarning, stacklevel=2)


def known_entries(store: BlobStore) -> Iterator[Known]:
    """The JAX entries of a store's disk cache, with their parts, for explanations."""
    cache = store.cache
    if cache is None:
        return
    for listed in cache.list_entries():
        try:
            fields = cache.read_header(listed.key).fields
        except Exception:  # vanished, damaged, not ours to judge here
            continue
        parts, metadata = fields.get("parts") or {}, fields.get("metadata") or {}
        key = parts.get(JAX_KEY_PART) if isinstance(parts, dict) else None
        recorded = metadata.get("jax_parts") if isinstance(metadata, dict) else None
        if isinstance(key, str) and isinstance(recorded, dict):
            yield Known(key, recorded, metadata)


_installed: JaxCacheBacking | None = None
_install_lock = threading.Lock()


def install(
    cache_dir: str | pathlib.Path | None = None,
    remote: str | Literal[False] | None = None,
    *,
    explain_misses: bool = True,
) -> JaxCacheBacking:
    """Makes this process's JAX read and write its persistent cache through pjrt-pool.

    cache_dir is pjrt-pool's disk cache (default: PJRT_POOL_CACHE_DIR, else the user
    cache directory); remote its remote tier (default: PJRT_POOL_CACHE_REMOTE; False:
    none). Call it before the first jax.jit compiles; calling it again replaces the
    backing. Raises JaxVersionError on a JAX whose cache was not checked, and
    ValueError for a malformed remote URL.
    """
    global _installed
    internals = jax_internals()
    store = BlobStore(open_cache(cache_dir), open_remote(remote))
    backing = JaxCacheBacking(store, local_compression(), explain_misses)
    cache_module, compiler = internals.compilation_cache, internals.compiler
    with _install_lock:
        jax.config.update("jax_compilation_cache_dir", PATH_IN_KEYS)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        with cache_module._cache_initialized_mutex:
            cache_module._cache = backing
            cache_module._cache_initialized = True
        if _installed is None:
            original = compiler.compile_or_get_cached
            signature = inspect.signature(original)

            def compile_or_get_cached(*arguments: Any, **keywords: Any) -> Any:
                started = time.perf_counter()
                executable = None
                if _installed is not None:
                    _installed.compiling()
                try:
                    executable = original(*arguments, **keywords)
                    return executable
                finally:
                    current = _installed
                    if current is not None:
                        bound = signature.bind(*arguments, **keywords).arguments
                        current.compiled(bound, executable, time.perf_counter() - started)

            compiler.compile_or_get_cached = compile_or_get_cached
        if _installed is not None:
            _installed.store.close()
        _installed = backing
    return backing
