"""Builds tests/ffi/handlers.cc into a shared library of typed XLA FFI handlers.

The handlers are written against the project's declarations of the XLA FFI C
API (native/xla_ffi.h) and report XLA FFI 0.1, which every XLA takes: built
against jaxlib's headers they would be of the installed jaxlib's version,
which a plugin built from an older XLA drops (jaxlib 0.12's FFI 0.5 on the FFI
0.4 of the default CPU plugin).

Test modules reuse it through the ``ffi_library`` fixture of conftest.py, or
``from ffi.build import build_handlers`` (pytest puts tests/ on sys.path). The library exports
``add_one`` (f32 in, out = in + 1), ``null_deref`` (SIGSEGV when run), ``sleep_ms``
(out = in after sleeping in[0] ms), ``device_error`` (fails as a lost CUDA device does),
``fail_if_negative`` (out = in + 1, or an error when in[0] < 0),
and ``add_one_reporting_0_5`` and ``_0_9``, add_one reporting those XLA FFI versions.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("handlers.cc")

HANDLERS = (
    "add_one",
    "null_deref",
    "sleep_ms",
    "device_error",
    "fail_if_negative",
    "add_one_reporting_0_5",
    "add_one_reporting_0_9",
)
"""The exported handler symbols."""


ABI_HEADER = SOURCE.parent.parent.parent / "native" / "xla_ffi.h"
"""The declarations of the XLA FFI C API the handlers are built against."""


_built: dict[str, Path] = {}


def build_handlers(directory: str | Path) -> Path:
    """Compiles the handlers into `directory` and returns the .so path.

    Building takes a few seconds, so a library this process built before from
    the same source is returned instead while it still exists (possibly in
    another directory). Raises RuntimeError with the compiler's output when
    g++ fails or is missing.
    """
    digest = hashlib.sha256(SOURCE.read_bytes() + ABI_HEADER.read_bytes()).hexdigest()[:16]
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
            f"-I{ABI_HEADER.parent}",
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
