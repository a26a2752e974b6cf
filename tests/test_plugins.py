"""Finding and loading PJRT plugins.

find_plugin only looks at the environment and the installed packages, so it
is tested in this process. Loading a plugin is once per process, so every
test that loads one (or fails to) runs in a child; those children import the
worker side only, which starts in a fraction of a second.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jaxlib
import pytest
from conftest import DEFAULT_PLUGIN, REPO, SECOND_PLUGIN, run_python
from install_sources import SOURCES, installed_as

import pool
from worker import PluginNotFoundError, find_plugin
from worker.plugin.locate import RuntimeKind, env_var, install_extra_command

needs_both = pytest.mark.skipif(
    DEFAULT_PLUGIN is None or SECOND_PLUGIN is None, reason="needs both CPU plugins installed"
)
LIBZ = next(
    (
        p
        for p in (
            "/lib/x86_64-linux-gnu/libz.so.1",
            "/usr/lib/x86_64-linux-gnu/libz.so.1",
            "/usr/lib64/libz.so.1",
            "/lib64/libz.so.1",
        )
        if os.path.exists(p)
    ),
    None,
)
LIBZ_PATH = LIBZ and os.path.realpath(LIBZ)
"""libz as find_plugin reports it: absolute, links resolved."""


def last_json(done) -> dict:
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def no_plugin_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("PJRT_POOL_PLUGIN_") or name == "PJRT_POOL_PLATFORM":
            monkeypatch.delenv(name)
    return monkeypatch


# -- discovery ---------------------------------------------------------------------


def test_env_var_is_named_after_the_platform():
    assert env_var("cpu") == "PJRT_POOL_PLUGIN_CPU"
    assert env_var("cuda") == "PJRT_POOL_PLUGIN_CUDA"
    assert env_var("rocm") == "PJRT_POOL_PLUGIN_ROCM"


@needs_both
def test_env_var_chooses_the_plugin_of_its_platform(no_plugin_env, tmp_path: Path):
    link = tmp_path / "my_plugin.so"
    link.symlink_to(SECOND_PLUGIN)
    no_plugin_env.setenv("PJRT_POOL_PLUGIN_CPU", str(link))
    no_plugin_env.setenv("PJRT_POOL_PLUGIN_ROCM", DEFAULT_PLUGIN)
    cpu = find_plugin("cpu")
    assert cpu.platform == "cpu"
    assert cpu.path == os.path.realpath(SECOND_PLUGIN)  # absolute, links resolved
    assert cpu.source == "environment variable PJRT_POOL_PLUGIN_CPU"
    rocm = find_plugin("rocm")
    assert (rocm.platform, rocm.path) == ("rocm", os.path.realpath(DEFAULT_PLUGIN))
    assert rocm.source == "environment variable PJRT_POOL_PLUGIN_ROCM"


@needs_both
def test_default_cpu_plugin_is_the_first_installed_package(no_plugin_env):
    location = find_plugin("pjrt_cpu")
    assert location.path == os.path.realpath(DEFAULT_PLUGIN)
    assert location.source == "package lammps-jax-pjrt-cpu"
    assert location.kind is RuntimeKind.PLUGIN


def test_the_cpu_platform_runs_on_jaxlibs_own_client_unless_a_plugin_is_named(no_plugin_env):
    location = find_plugin("cpu")
    assert location.kind is RuntimeKind.JAXLIB
    assert location.source == f"jaxlib {jaxlib.__version__}'s own CPU client"
    # Its identity: jaxlib's installed RECORD, which names every file of it by its digest.
    assert location.path.endswith(f"jaxlib-{jaxlib.__version__}.dist-info/RECORD")
    if DEFAULT_PLUGIN is not None:
        no_plugin_env.setenv("PJRT_POOL_PLUGIN_CPU", DEFAULT_PLUGIN)
        named = find_plugin("cpu")
        assert (named.kind, named.path) == (RuntimeKind.PLUGIN, os.path.realpath(DEFAULT_PLUGIN))
    # The variable may name jaxlib's own client too, as its location names it (the probe
    # lower() starts names a platform's runtime so).
    no_plugin_env.setenv("PJRT_POOL_PLUGIN_CPU", location.path)
    assert find_plugin("cpu") == location


@needs_both
def test_a_default_package_without_its_library_is_skipped(tmp_path: Path, no_plugin_env):
    # A lammps_jax_pjrt_cpu package earlier on the path, but without the .so:
    # the next default, xla-cpu-pjrt, is found and loads.
    shadow = tmp_path / "lammps_jax_pjrt_cpu"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("")
    done = run_python(
        """
        import json, sys
        import worker
        location = worker.find_plugin("pjrt_cpu")
        runtime = worker.get_runtime("pjrt_cpu")
        print(json.dumps({"path": location.path, "source": location.source,
                          "api": runtime.api_version}))
        """,
        env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])},
    )
    assert last_json(done) == {
        "path": os.path.realpath(SECOND_PLUGIN),
        "source": "package xla-cpu-pjrt",
        "api": "0.81",
    }


@pytest.mark.parametrize("source", list(SOURCES))
def test_no_cpu_plugin_names_the_extra_to_install(tmp_path: Path, no_plugin_env, source: str):
    # Both CPU packages shadowed by packages without their libraries: as if
    # pjrt-pool were installed without the cpu extra. No index serves
    # pjrt-pool (issue 42): the extra comes from where pjrt-pool came from, as
    # the distribution found first on the path records it.
    for package in ("lammps_jax_pjrt_cpu", "xla_plugins/xla_cpu_pjrt"):
        shadow = tmp_path / package
        shadow.mkdir(parents=True)
        (shadow / "__init__.py").write_text("")
    direct_url, command = SOURCES[source]
    command = command.format(extra="cpu")
    installed_as(tmp_path, direct_url)
    done = run_python(
        """
        import worker
        try:
            worker.find_plugin("pjrt_cpu")
        except worker.PluginNotFoundError as error:
            print(error)
        """,
        env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])},
    )
    message = done.stdout
    assert "no PJRT plugin found for platform 'pjrt_cpu'" in message
    assert f"({command} for lammps-jax-pjrt-cpu or pip install xla-cpu-pjrt)" in message
    assert "pip install pjrt-pool[cpu]" not in message  # what no index serves
    assert "PJRT_POOL_PLUGIN_PJRT_CPU" in message


def test_no_plugin_for_a_platform_says_what_to_set(no_plugin_env):
    """A platform no module describes has no package to install: only the variable to set."""
    with pytest.raises(
        PluginNotFoundError, match="no PJRT plugin found for platform 'vendor'"
    ) as e:
        find_plugin("vendor")
    assert "set PJRT_POOL_PLUGIN_VENDOR to the path of a PJRT plugin library" in str(e.value)


def test_no_plugin_for_rocm_names_jaxs_rocm_plugins(no_plugin_env):
    with pytest.raises(PluginNotFoundError, match="no PJRT plugin found for platform 'rocm'") as e:
        find_plugin("rocm")
    assert "(pip install jax-rocm7-pjrt or pip install jax-rocm60-pjrt)" in str(e.value)
    assert "set PJRT_POOL_PLUGIN_ROCM to the plugin's .so" in str(e.value)


def test_no_plugin_for_cuda_says_what_to_install(no_plugin_env):
    try:
        find_plugin("cuda")
    except PluginNotFoundError as error:
        message = str(error)
    else:
        pytest.skip("a CUDA plugin is installed here")
    assert (
        f"{install_extra_command('cuda13')} for jax-cuda13-pjrt or "
        f"{install_extra_command('cuda12')} for jax-cuda12-pjrt" in message
    )
    assert "[cuda13]'" in message and "pip install pjrt-pool[" not in message
    assert "PJRT_POOL_PLUGIN_CUDA" in message


def test_env_var_naming_a_missing_file_says_so(no_plugin_env, tmp_path: Path):
    missing = tmp_path / "nowhere" / "plugin.so"
    no_plugin_env.setenv("PJRT_POOL_PLUGIN_CPU", str(missing))
    with pytest.raises(PluginNotFoundError) as caught:
        find_plugin("cpu")
    message = str(caught.value)
    assert f"PJRT_POOL_PLUGIN_CPU={missing} does not name a file" in message
    assert "unset it to use an installed package" in message


def test_compiling_for_a_platform_without_a_plugin_raises_in_a_fresh_process():
    # No plugin is loaded in the child, so the program's platform decides.
    done = run_python(
        """
        import json
        from worker import (Executable, LoweredProgram, PluginNotFoundError, compile_options,
                            compile_program, loaded_runtime)
        results = {}
        try:
            compile_program(LoweredProgram(b"ML\\xefR", "module {}", None, "rocm"))
        except PluginNotFoundError as error:
            results["program"] = str(error)
        import os
        os.environ["PJRT_POOL_PLATFORM"] = "rocm"  # the default platform, when nothing names one
        try:
            Executable.compile(b"ML\\xefR", compile_options())
        except PluginNotFoundError as error:
            results["default"] = str(error)
        results["loaded"] = loaded_runtime() is not None
        print(json.dumps(results))
        """,
        env={"PJRT_POOL_PLUGIN_ROCM": ""},
    )
    results = last_json(done)
    assert results["loaded"] is False
    for key in ("program", "default"):
        assert "no PJRT plugin found for platform 'rocm'" in results[key]
        assert "PJRT_POOL_PLUGIN_ROCM" in results[key]


# -- loading -----------------------------------------------------------------------


@pytest.mark.skipif(LIBZ is None or DEFAULT_PLUGIN is None, reason="needs libz and the plugin")
def test_libraries_that_are_not_plugins_give_plugin_load_error(tmp_path: Path):
    not_elf = tmp_path / "fake_plugin.so"
    not_elf.write_text("this is not a shared library\n")
    missing = tmp_path / "gone.so"
    done = run_python(
        f"""
        import json, os
        import worker
        from worker import PluginLoadError, get_runtime, loaded_runtime
        from worker import _pjrt

        results = {{}}
        for name, path in (("libz", {LIBZ!r}), ("not_elf", {str(not_elf)!r})):
            os.environ["PJRT_POOL_PLUGIN_CPU"] = path
            try:
                get_runtime()
            except PluginLoadError as error:
                results[name] = [type(error).__name__, isinstance(error, OSError), str(error)]
        try:
            _pjrt.Plugin.load({str(missing)!r})  # the file vanished between finding and loading
        except PluginLoadError as error:
            results["missing"] = [type(error).__name__, isinstance(error, OSError), str(error)]
        results["loaded_after_failures"] = loaded_runtime() is not None

        # A failed load leaves the process free to load a real plugin.
        os.environ["PJRT_POOL_PLUGIN_CPU"] = {DEFAULT_PLUGIN!r}
        results["then"] = get_runtime().api_version
        print(json.dumps(results))
        """
    )
    results = last_json(done)
    assert results["loaded_after_failures"] is False
    assert results["then"] == "0.115"
    for name in ("libz", "not_elf", "missing"):
        kind, is_os_error, _ = results[name]
        assert (kind, is_os_error) == ("PluginLoadError", True), name
    assert f"{LIBZ_PATH} is not a PJRT plugin: it exports no GetPjrtApi" in results["libz"][2]
    for name in ("libz", "not_elf"):  # how it was found, and what to do
        assert "found through environment variable PJRT_POOL_PLUGIN_CPU" in results[name][2]
        assert "set PJRT_POOL_PLUGIN_CPU to another plugin library" in results[name][2]
    assert f"cannot load PJRT plugin {not_elf}" in results["not_elf"][2]
    assert f"cannot load PJRT plugin {missing}" in results["missing"][2]
    assert "No such file or directory" in results["missing"][2]


@needs_both
def test_a_process_keeps_its_first_plugin():
    done = run_python(
        """
        import json, os
        from worker import PlatformMismatchError, get_runtime
        first = get_runtime("cpu")
        os.environ["PJRT_POOL_PLUGIN_CPU"] = os.environ.pop("OTHER_PLUGIN")
        again = get_runtime("cpu")
        try:
            get_runtime("cuda")
            mismatch = None
        except PlatformMismatchError as error:
            mismatch = str(error)
        print(json.dumps({"same": again is first, "path": again.location.path,
                          "source": again.location.source, "api": again.api_version,
                          "mismatch": mismatch}))
        """,
        env={"PJRT_POOL_PLUGIN_CPU": DEFAULT_PLUGIN, "OTHER_PLUGIN": SECOND_PLUGIN},
    )
    results = last_json(done)
    assert results["same"] is True
    assert results["path"] == os.path.realpath(DEFAULT_PLUGIN)
    assert results["source"] == "environment variable PJRT_POOL_PLUGIN_CPU"
    assert results["api"] == "0.115"
    assert "this program is for platform 'cuda'" in results["mismatch"]
    assert "has the 'cpu' plugin loaded" in results["mismatch"]


@pytest.mark.skipif(LIBZ is None, reason="needs libz")
def test_lower_for_a_broken_plugin_says_which_plugin(tmp_path: Path):
    # lower() probes the platform's plugin (in a child of the child) for its
    # StableHLO window; a library that is no plugin fails that probe clearly.
    done = run_python(
        """
        import json
        import jax
        import pool
        try:
            pool.lower(lambda x: x, [jax.ShapeDtypeStruct((2,), "float32")])
            print(json.dumps({"error": None}))
        except Exception as error:
            print(json.dumps({"kind": type(error).__name__, "error": str(error)}))
        """,
        env={"PJRT_POOL_PLUGIN_CPU": LIBZ, "PJRT_POOL_CACHE_DIR": str(tmp_path / "cache")},
    )
    results = last_json(done)
    assert results["kind"] == "PluginProbeError"
    assert "cannot use the cpu plugin" in results["error"]
    assert f"{LIBZ_PATH} is not a PJRT plugin: it exports no GetPjrtApi" in results["error"]


def test_error_classes_are_exported_and_distinct():
    assert issubclass(pool.PluginLoadError, OSError)
    assert issubclass(pool.PluginNotFoundError, RuntimeError)
    assert not issubclass(pool.PluginNotFoundError, pool.PluginLoadError)
    assert issubclass(pool.MissingCustomCallError, pool.PjrtError)
