"""Which kernel package a plugin's custom calls are registered from (issue 11, item 3).

With jax-cuda12-plugin and jax-cuda13-plugin both installed, registering the
handlers of every importable package put two handlers under each target
name, and the plugin kept one of them without a word. Only the package that
matches the loaded plugin may register: the plugin's own package directory
(jax_plugins/xla_cudaNN) decides, else the CUDA version its client reports.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest
from conftest import DEFAULT_PLUGIN, run_python

from worker.errors import PluginNotFoundError
from worker.plugin.kernels import kernel_package
from worker.plugin.locate import find_plugin
from worker.plugin.platforms.cuda import cuda_major
from worker.plugin.platforms.registry import platform_named


def _plugin_file(root: Path, directory: str) -> Path:
    """A file laid out where a jax-cuda PJRT package installs its plugin."""
    path = root / "site-packages" / "jax_plugins" / directory / "xla_cuda_plugin.so"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x7fELF")
    return path


@pytest.mark.parametrize("major", [12, 13])
def test_the_plugins_package_chooses_the_kernel_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, major: int
):
    path = _plugin_file(tmp_path, f"xla_cuda{major}")
    monkeypatch.setenv("PJRT_POOL_PLUGIN_CUDA", str(path))
    location = find_plugin("cuda")
    assert cuda_major(location.path) == major
    # The package directory wins over whatever the client reports.
    for reported in (None, "cuda 12.9.1", "cuda 13.0.0", "<unknown>"):
        assert kernel_package("cuda", location.path, reported) == f"jax_cuda{major}_plugin"


def test_a_plugin_elsewhere_is_matched_by_its_cuda_version(tmp_path: Path):
    path = tmp_path / "build" / "pjrt_c_api_gpu_plugin.so"
    assert cuda_major(str(path)) is None
    assert kernel_package("cuda", str(path), "cuda 13.0.0") == "jax_cuda13_plugin"
    assert kernel_package("cuda", str(path), "cuda 12.8") == "jax_cuda12_plugin"
    assert kernel_package("cuda", str(path), "cuda 12030") == "jax_cuda12_plugin"  # CUDART_VERSION
    # Nothing says which: nothing is registered, rather than a guess.
    assert kernel_package("cuda", str(path), "<unknown>") is None
    assert kernel_package("cuda", str(path), None) is None


def test_cpu_kernels_come_from_jaxlib_and_other_platforms_have_none(tmp_path: Path):
    assert kernel_package("cpu", str(tmp_path / "any.so"), "cpu") == "jaxlib.cpu"
    assert kernel_package("tpu", str(tmp_path / "libtpu.so"), "TFRT TPU v5 lite") is None
    assert kernel_package("unlisted", str(tmp_path / "any.so"), None) is None


def test_rocm_kernels_come_only_from_the_package_its_plugin_names(tmp_path: Path):
    """jax-rocm7-pjrt installs its plugin as jax_plugins/xla_rocm7; its kernels are
    jax_rocm7_plugin's. A ROCm plugin elsewhere gets none: its version is not guessed."""
    for major in (7, 60):
        path = tmp_path / "jax_plugins" / f"xla_rocm{major}" / "xla_rocm_plugin.so"
        assert kernel_package("rocm", str(path), "rocm 6.0") == f"jax_rocm{major}_plugin"
    assert kernel_package("rocm", str(tmp_path / "any.so"), "rocm 6.0") is None


def _kernel_kit(root: Path, package: str, handler: str, library: Path) -> None:
    """A kernel package laid out like jax's: a module whose registrations() name handlers."""
    directory = root / package
    directory.mkdir(parents=True)
    (directory / "__init__.py").write_text("")
    (directory / "_prng.py").write_text(
        textwrap.dedent(
            f"""
            import ctypes

            _library = ctypes.CDLL({str(library)!r})

            def registrations():
                address = ctypes.cast(_library.{handler}, ctypes.c_void_p).value
                # One FFI target, and a legacy custom call that must not be registered as FFI.
                return {{"pjrt_pool_kit_target_ffi": address, "pjrt_pool_kit_legacy": address}}
            """
        )
    )


def test_only_the_matching_package_registers_its_handlers(tmp_path: Path, ffi_library: Path):
    """Both CUDA kernel packages installed, one target name in each with another handler.

    The CUDA 12 package's handler crashes the process (null_deref), the CUDA
    13 one adds one: a CUDA 13 plugin must get the latter, and the CUDA 12
    package must not even be imported. The handlers are registered into the
    real CPU plugin (platform "Host"), which then runs the program.
    """
    kits = tmp_path / "kits"
    _kernel_kit(kits, "jax_cuda12_plugin", "null_deref", ffi_library)
    _kernel_kit(kits, "jax_cuda13_plugin", "add_one", ffi_library)
    plugin_path = _plugin_file(tmp_path, "xla_cuda13")
    code = f"""
        import sys
        from worker import get_runtime
        from worker.plugin.kernels import register_kernels, kernel_package

        runtime = get_runtime("cpu")
        package = kernel_package("cuda", {str(plugin_path)!r}, "cuda 12.9")
        registration = register_kernels(runtime.plugin, "Host", package, [("_prng", False)])
        registered = registration.registered
        assert not registration.refused, registration.refused
        assert registered == {{"jax_cuda13_plugin._prng": ["pjrt_pool_kit_target_ffi"]}}, registered
        # (Checked before JAX is imported: JAX itself imports both packages' modules.)
        assert not [m for m in sys.modules if m.startswith("jax_cuda12")], sorted(sys.modules)

        import jax, jax.numpy as jnp, numpy as np
        from pool import compile_program, lower

        target = "pjrt_pool_kit_target_ffi"
        program = lower(
            lambda x: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x),
            [jax.ShapeDtypeStruct((4,), jnp.float32)],
            custom_calls=[target],
        )
        executable, _ = compile_program(program)
        (out,) = executable.run([np.arange(4, dtype=np.float32)])
        np.testing.assert_array_equal(out, np.arange(1, 5, dtype=np.float32))
        print("ok")
    """
    env = {"PYTHONPATH": str(kits)}
    if DEFAULT_PLUGIN:
        env["PJRT_POOL_PLUGIN_CPU"] = DEFAULT_PLUGIN
    done = run_python(code, env=env)
    assert done.stdout.strip().endswith("ok")


def _installed_cuda_plugin() -> tuple[str, str] | None:
    """The installed CUDA plugin and its kernel package, when both are there."""
    try:
        location = find_plugin("cuda")
    except PluginNotFoundError:
        return None
    package = kernel_package("cuda", location.path)
    if package is None or importlib.util.find_spec(package) is None:
        return None
    return location.path, package


@pytest.mark.skipif(
    _installed_cuda_plugin() is None, reason="needs a jax-cuda PJRT plugin and its kernel package"
)
def test_the_installed_cuda_kernels_register_with_the_cuda_plugin():
    """The real CUDA plugin and kernels; registration needs no GPU (the client is not created)."""
    found = _installed_cuda_plugin()
    assert found is not None
    path, package = found
    code = f"""
        import sys
        from worker import _pjrt
        from worker.plugin.kernels import register_kernels
        from worker.plugin.platforms.registry import platform_named

        plugin = _pjrt.Plugin.load({path!r})
        (cuda,) = platform_named("cuda").kernels
        registration = register_kernels(plugin, "CUDA", {package!r}, cuda.modules)
        assert not registration.refused, registration.refused
        registered = registration.registered
        assert registered and all(m.startswith({package!r} + ".") for m in registered), registered
        assert "cu_lu_pivots_to_permutation" in registered[{package!r} + "._linalg"]
        other = [m for m in sys.modules if m.startswith("jax_cuda") and
                 not m.startswith({package!r})]
        assert not other, other
        print("ok", sum(map(len, registered.values())))
    """
    assert "ok" in run_python(code).stdout


@pytest.mark.parametrize("platform, prefix", [("cuda", "cu"), ("rocm", "hip")])
def test_markers_cover_every_gpu_kernel_target(platform: str, prefix: str):
    """Targets of jax-cuda 0.10-0.11's kernel modules, one per module (from their
    registrations), and their ROCm names (jax names each target with the platform's prefix)."""
    (library,) = platform_named(platform).kernels
    targets = (
        "solver_getrf_ffi",  # _solver
        "hybrid_eig_real",  # _hybrid
        "_lu_pivots_to_permutation",  # _linalg
        "_threefry2x32_ffi",  # _prng
        "sparse_csr_matvec_ffi",  # _sparse
    )
    for target in targets:
        assert any((prefix + target).startswith(m.decode()) for m in library.markers), target
    # Neither platform's markers take the other's targets.
    other = "hip" if prefix == "cu" else "cu"
    assert not any((other + t).startswith(m.decode()) for t in targets for m in library.markers)
