"""The value JAX's persistent cache files an executable as, made without JAX.

JAX (jax._src.compilation_cache, on every JAX version pjrt-pool checked: pool.jax_cache.versions)
files an executable as the compile time in whole seconds, a 4-byte big-endian
integer, followed by the executable as jaxlib's client serializes it, the whole
compressed with zstandard where JAX can import it, else with zlib. Which one is
part of JAX's key, so a value is made for one compression. tests/test_jax_cache.py
checks these against JAX's own functions.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Callable

from worker.errors import PjrtPoolError

TIME_BYTES = 4
"""The compile time's width at the start of a value."""


class Compression(enum.StrEnum):
    """How a JAX compresses its cache's values: zstandard where it can import it, else zlib."""

    ZLIB = "zlib"
    ZSTANDARD = "zstandard"


class JaxValueError(PjrtPoolError, ValueError):
    """A value cannot be made or read here (a compression this Python lacks, bad bytes)."""


def _zstd() -> tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]:
    """zstandard's compress and decompress, where this Python has one."""
    try:
        from compression import zstd  # type: ignore[import-not-found]  # Python 3.14

        return zstd.compress, zstd.decompress
    except ImportError:
        pass
    try:
        import zstandard  # type: ignore[import-not-found]
    except ImportError:
        raise JaxValueError(
            "the JAX that reads these entries compresses its cache with zstandard, which this "
            "Python cannot import: pip install zstandard here, or make entries for zlib"
        ) from None
    return zstandard.ZstdCompressor().compress, zstandard.ZstdDecompressor().decompress


def pack(serialized: bytes, compile_seconds: float, compression: Compression) -> bytes:
    """The value JAX files an executable as: its compile time and bytes, compressed."""
    seconds = max(0, min(int(compile_seconds), (1 << (8 * TIME_BYTES)) - 1))
    combined = seconds.to_bytes(TIME_BYTES, "big") + serialized
    if compression is Compression.ZLIB:
        return zlib.compress(combined)
    return _zstd()[0](combined)


def unpack(value: bytes, compression: Compression) -> tuple[bytes, int]:
    """The serialized executable and compile seconds of a value; raises JaxValueError for one
    that does not decompress."""
    decompress = zlib.decompress if compression is Compression.ZLIB else _zstd()[1]
    try:
        combined = decompress(value)
    except JaxValueError:
        raise
    except Exception as error:  # zlib's and zstandard's own errors
        raise JaxValueError(
            f"the value does not decompress with {compression.value}: {error}"
        ) from None
    if len(combined) < TIME_BYTES:
        raise JaxValueError("the value is shorter than its compile time")
    return combined[TIME_BYTES:], int.from_bytes(combined[:TIME_BYTES], "big")
