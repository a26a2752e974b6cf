"""A plugin's build identity comes from its installed RECORD without hashing, and only when
RECORD vouches for the file as it is (worker.plugin.build_identity, worker.identity.build)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import pytest
from conftest import DEFAULT_PLUGIN, REPO, run_python

from worker.identity.build import _file_digest, dist_info_of, recorded_sha256
from worker.plugin.known_builds import KNOWN_BUILDS

pytestmark = pytest.mark.skipif(DEFAULT_PLUGIN is None, reason="needs lammps-jax-pjrt-cpu")

# A child that reports its plugin identity and how often it hashed a file to get it.
IDENTITY = """
import json, os, sys
import worker.identity.build as key

hashed = []
real_digest = key._file_digest
key._file_digest = lambda path: hashed.append(path) or real_digest(path)

from worker.cache.location import default_cache_dir
from worker.plugin.build_identity import plugin_build_sha256

path = sys.argv[1]
if path == "runtime":
    from worker.identity.target import runtime_key_parts
    from worker.plugin.runtime import get_runtime

    runtime = get_runtime("pjrt_cpu")
    digest = runtime.identity()["plugin_sha256"]
    assert runtime_key_parts(runtime, None)["plugin"]["sha256"] == digest
else:
    digest = plugin_build_sha256(path, lambda: None)
print(json.dumps({"sha256": digest, "hashed": len(hashed),
                  "cache_dir_exists": default_cache_dir().exists()}))
"""

PACKAGE, LIBRARY = "lammps_jax_pjrt_cpu", "pjrt_c_api_cpu_plugin.so"


def _no_cache_env(home: Path, site: Path | None = None) -> dict[str, str]:
    """A host with no cache directory: an empty HOME, and nothing names a cache."""
    env = {
        "HOME": str(home),
        "XDG_CACHE_HOME": "",
        "PJRT_POOL_CACHE_DIR": "",
        "PJRT_POOL_PLUGIN_CPU": "",
        "PJRT_POOL_PLUGIN_PJRT_CPU": "",
    }
    if site is not None:  # a fake installation, found before the real one
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    return env


def _identity(tmp_path: Path, target: str, site: Path | None = None) -> dict:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    code = IDENTITY.replace("sys.argv[1]", repr(target))
    done = run_python(code, env=_no_cache_env(home, site))
    return json.loads(done.stdout.splitlines()[-1])


def _record_line(relative: str, data: bytes) -> str:
    encoded = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{relative},sha256={encoded},{len(data)}\n"


def _install(site: Path, data: bytes, record: str | None = None) -> Path:
    """A fake installed lammps-jax-pjrt-cpu in site: the library, then its RECORD, as pip does."""
    package = site / PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    library = package / LIBRARY
    library.write_bytes(data)
    dist_info = site / f"{PACKAGE}-0.11.2.dist-info"
    dist_info.mkdir()
    text = record if record is not None else _record_line(f"{PACKAGE}/{LIBRARY}", data)
    (dist_info / "RECORD").write_text(text + f"{PACKAGE}-0.11.2.dist-info/RECORD,,\n")
    installed = os.stat(dist_info / "RECORD").st_mtime_ns - 10**9  # installed a second ago
    os.utime(library, ns=(installed, installed))
    os.utime(dist_info / "RECORD", ns=(installed, installed))
    return library


def test_a_host_with_no_cache_dir_gets_the_plugins_identity_without_hashing(tmp_path):
    real = _file_digest(DEFAULT_PLUGIN)
    found = _identity(tmp_path, "runtime")
    assert not found["cache_dir_exists"]
    assert found["hashed"] == 0
    assert found["sha256"] == real == KNOWN_BUILDS[0].sha256


def test_the_installed_record_gives_what_hashing_gives(tmp_path):
    data = os.urandom(4096)
    library = _install(tmp_path / "site", data)
    found = _identity(tmp_path, str(library), tmp_path / "site")
    assert found == {
        "sha256": hashlib.sha256(data).hexdigest(),
        "hashed": 0,
        "cache_dir_exists": False,
    }


def test_a_plugin_changed_in_place_after_install_is_hashed(tmp_path):
    data = os.urandom(4096)
    library = _install(tmp_path / "site", data)
    with open(library, "r+b") as file:  # the same size, one byte changed
        file.seek(100)
        file.write(bytes([data[100] ^ 0xFF]))
    found = _identity(tmp_path, str(library), tmp_path / "site")
    assert found["hashed"] == 1
    assert found["sha256"] == _file_digest(str(library)) != hashlib.sha256(data).hexdigest()


def test_a_copy_of_the_real_plugin_changed_after_install_is_hashed(tmp_path):
    data = Path(DEFAULT_PLUGIN).read_bytes()
    library = _install(tmp_path / "site", data)
    assert _identity(tmp_path, str(library), tmp_path / "site")["hashed"] == 0
    with open(library, "ab") as file:
        file.write(b"\0")
    found = _identity(tmp_path, str(library), tmp_path / "site")
    assert found["hashed"] == 1
    assert found["sha256"] == _file_digest(str(library)) != KNOWN_BUILDS[0].sha256


def test_a_file_replaced_after_install_is_not_vouched_for(tmp_path):
    site = tmp_path / "site"
    data = os.urandom(4096)
    library = _install(site, data)
    dist_info = dist_info_of(site, "lammps-jax-pjrt-cpu")
    assert dist_info is not None
    assert recorded_sha256(library, site, dist_info) == hashlib.sha256(data).hexdigest()
    replacement = tmp_path / "other.so"
    replacement.write_bytes(os.urandom(4096))  # the same size, written after the install
    os.replace(replacement, library)
    assert recorded_sha256(library, site, dist_info) is None


def test_record_must_name_the_file_with_its_size(tmp_path):
    data = os.urandom(512)
    wrong_size = _record_line(f"{PACKAGE}/{LIBRARY}", data).replace(",512", ",513")
    site = tmp_path / "a"
    library = _install(site, data, record=wrong_size)
    assert recorded_sha256(library, site, site / f"{PACKAGE}-0.11.2.dist-info") is None
    site = tmp_path / "b"
    library = _install(site, data, record=_record_line(f"{PACKAGE}/other.so", data))
    assert recorded_sha256(library, site, site / f"{PACKAGE}-0.11.2.dist-info") is None
    site = tmp_path / "c"
    md5 = f"{PACKAGE}/{LIBRARY},md5={hashlib.md5(data).hexdigest()},512\n"
    library = _install(site, data, record=md5)
    assert recorded_sha256(library, site, site / f"{PACKAGE}-0.11.2.dist-info") is None


def test_two_dist_infos_of_the_distribution_vouch_for_nothing(tmp_path):
    site = tmp_path / "site"
    library = _install(site, os.urandom(256))
    (site / f"{PACKAGE}-0.11.1.dist-info").mkdir()
    assert dist_info_of(site, "lammps-jax-pjrt-cpu") is None
    found = _identity(tmp_path, str(library), site)
    assert found["hashed"] == 1


def test_a_known_builds_flags_are_not_read_from_its_library(tmp_path):
    """A known build that its RECORD vouches for loads with JAX's flags, reading no 200 MB."""
    code = """
import json
import worker.identity.build as key
import worker.plugin.xla_flags as xla_flags

scans = []
real_memo = xla_flags.memoized_by_file
xla_flags.memoized_by_file = lambda *args, **kw: scans.append(args[2]) or real_memo(*args, **kw)
hashed = []
real_digest = key._file_digest
key._file_digest = lambda path: hashed.append(path) or real_digest(path)
from worker.plugin.runtime import get_runtime

runtime = get_runtime("pjrt_cpu")
runtime.identity()
print(json.dumps({"scans": scans, "hashed": len(hashed),
                  "flags": runtime.codegen_environment["xla_flags"]}))
"""
    home = tmp_path / "home"
    home.mkdir()
    found = json.loads(run_python(code, env=_no_cache_env(home)).stdout.splitlines()[-1])
    assert found["scans"] == [] and found["hashed"] == 0
    assert "xla_cpu_enable_fast_min_max=false" in found["flags"]  # normalized


def test_the_known_builds_flags_are_in_their_libraries():
    """KnownBuild.flags says what reading the library would find."""
    import mmap

    build = KNOWN_BUILDS[0]
    assert _file_digest(DEFAULT_PLUGIN) == build.sha256
    with (
        open(DEFAULT_PLUGIN, "rb") as file,
        mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as image,
    ):
        for flag in build.flags:
            assert image.find(flag.encode()) >= 0, flag
