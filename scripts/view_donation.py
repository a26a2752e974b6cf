"""Measure whether a CPU plugin can compute an output into memory the caller provides.

Usage::

    python scripts/view_donation.py [--plugin PATH ...]

PJRT's Execute allocates its outputs. The one way its C API offers to put
an output into caller memory is donation: make the memory a PJRT buffer with
PJRT_Client_CreateViewOfDeviceBuffer and donate it to a program whose output
aliases that parameter. scripts/view_donation.cc does that with a small
program (out = in + s, f32[1 << 20], tf.aliasing_output = 0) on each plugin
(default: both installed CPU plugins, PJRT API 0.115 and 0.81), and again
with a donated buffer the plugin allocated itself, which shows the aliasing
works. If the view's output landed in the caller's memory, a worker could
compute large outputs straight into shared memory instead of copying them
there (scripts/output_memory.py measures what the copy costs). Needs g++.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

PROGRAM = """\
module @donated attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<1048576xf32> {tf.aliasing_output = 0 : i32},
                         %arg1: tensor<f32>) -> tensor<1048576xf32> {
    %0 = stablehlo.broadcast_in_dim %arg1, dims = [] : (tensor<f32>) -> tensor<1048576xf32>
    %1 = stablehlo.add %arg0, %0 : tensor<1048576xf32>
    return %1 : tensor<1048576xf32>
  }
}
"""


def installed_plugins() -> list[str]:
    """The installed CPU plugins' libraries (the default package first)."""
    import importlib.util

    found = []
    for package, library in (
        ("lammps_jax_pjrt_cpu", "pjrt_c_api_cpu_plugin.so"),
        ("xla_plugins.xla_cpu_pjrt", "xla_cpu_pjrt.so"),
    ):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            path = Path(next(iter(spec.submodule_search_locations))) / library
            if path.is_file():
                found.append(str(path))
    return found


def header_dir() -> Path:
    """The PJRT C API header's folder, from the xla-cpu-pjrt package (as the build uses)."""
    import importlib.util

    spec = importlib.util.find_spec("xla_plugins.xla_cpu_pjrt")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the xla-cpu-pjrt package for pjrt_c_api.h")
    return Path(next(iter(spec.submodule_search_locations))) / "include"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plugin", action="append", help="a plugin library (repeatable)")
    args = parser.parse_args(argv)
    compiler = shutil.which("g++")
    if compiler is None:
        raise SystemExit("needs g++ on PATH")
    from worker.identity.options import compile_options

    with tempfile.TemporaryDirectory(prefix="view-donation-") as scratch:
        folder = Path(scratch)
        binary = folder / "view_donation"
        source = HERE / "view_donation.cc"
        build = [compiler, "-std=c++17", "-O1", f"-I{header_dir()}", str(source)]
        subprocess.run([*build, "-o", str(binary), "-ldl"], check=True)
        program, options = folder / "program.mlir", folder / "options.pb"
        program.write_text(PROGRAM)
        options.write_bytes(compile_options())
        for plugin in args.plugin or installed_plugins():
            print(f"{plugin}:")
            for what, extra in (("a view of caller memory", []), ("a plugin buffer", ["owned"])):
                done = subprocess.run(
                    [str(binary), plugin, str(program), str(options), *extra],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                lines = [line for line in done.stdout.splitlines() if ":" in line]
                print(f"  donating {what}: " + "; ".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
