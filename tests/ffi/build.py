"""Builds tests/ffi/handlers.cc into a shared library of typed XLA FFI handlers.

Test modules reuse it through the ``ffi_library`` fixture of conftest.py, or
``from ffi.build import build_handlers`` (pytest puts tests/ on sys.path). The library exports
``add_one`` (f32 in, out = in + 1), ``null_deref`` (SIGSEGV when run), ``sleep_ms``
(out = in after sleeping in[0] ms) and ``device_error`` (fails as a lost CUDA device does).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("handlers.cc")

HANDLERS = ("add_one", "null_deref", "sleep_ms", "device_error")
"""The exported handler symbols."""


def ffi_include_dir() -> Path:
    """jaxlib's directory of XLA FFI headers (``xla/ffi/api/ffi.h``)."""
    import jaxlib

    include = Path(jaxlib.__file__).resolve().parent / "include"
    if not (include / "xla" / "ffi" / "api" / "ffi.h").is_file():
        raise FileNotFoundError(f"jaxlib has no XLA FFI headers under {include}")
    return include


_built: dict[str, Path] = {}


def build_handlers(directory: str | Path) -> Path:
    """Compiles the handlers into `directory` and returns the .so path.

    Building takes a few seconds, so a library this process built before from
    the same source is returned instead while it still exists (possibly in
    another directory). Raises RuntimeError with the compiler's output when
    g++ fails or is missing.
    """
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    earlier = _built.get(digest)
    if earlier is not None and earlier.is_file():
        return earlier
    output = Path(directory) / f"libtest_ffi_{digest}.so"
    if output.is_file():
        _built[digest] = output
        return output
    compiler = shutil.which("g++")
    if compiler is None:
        raise RuntimeError("building the test FFI handlers needs g++ on PATH")
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_suffix(".so.partial")
    done = subprocess.run(
        [
            compiler,
            "-shared",
            "-fPIC",
            "-std=c++17",
            "-O1",
            f"-I{ffi_include_dir()}",
            str(SOURCE),
            "-o",
            str(partial),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"g++ failed to build {SOURCE}:\n{done.stderr[-4000:]}")
    partial.replace(output)
    _built[digest] = output
    return output
