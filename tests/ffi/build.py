"""Builds tests/ffi/handlers.cc into a shared library of typed XLA FFI handlers.

Other test modules reuse it: ``from tests.ffi.build import build_handlers``
(or ``import ffi.build`` with tests/ on sys.path). The library exports
``add_one`` (f32 in, out = in + 1) and ``null_deref`` (SIGSEGV when run).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("handlers.cc")

HANDLERS = ("add_one", "null_deref")
"""The exported handler symbols."""


def ffi_include_dir() -> Path:
    """jaxlib's directory of XLA FFI headers (``xla/ffi/api/ffi.h``)."""
    import jaxlib

    include = Path(jaxlib.__file__).resolve().parent / "include"
    if not (include / "xla" / "ffi" / "api" / "ffi.h").is_file():
        raise FileNotFoundError(f"jaxlib has no XLA FFI headers under {include}")
    return include


def build_handlers(directory: str | Path) -> Path:
    """Compiles the handlers into `directory` (once per source version) and returns the .so path.

    Raises RuntimeError with the compiler's output when g++ fails or is missing.
    """
    compiler = shutil.which("g++")
    if compiler is None:
        raise RuntimeError("building the test FFI handlers needs g++ on PATH")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    output = Path(directory) / f"libtest_ffi_{digest}.so"
    if output.is_file():
        return output
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_suffix(".so.partial")
    done = subprocess.run(
        [compiler, "-shared", "-fPIC", "-std=c++17", "-O1",
         f"-I{ffi_include_dir()}", str(SOURCE), "-o", str(partial)],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"g++ failed to build {SOURCE}:\n{done.stderr[-4000:]}")
    partial.replace(output)
    return output
