"""A refused bundle leaves no cache directory behind (issue 29, Also).

A refused import into a directory that does not exist must not make an
empty cache there.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import REPO, pjrt_pool, run_python
from test_bundle_types import edit_index, flipped_shape, one  # noqa: F401 (one: a fixture)

from worker.plugin.locate import env_var, find_plugin

BUNDLE_ONE = """
import sys
sys.path.insert(0, {tests!r})
from cache_helpers import lowered
from worker import compile_program
from worker.bundle.writer import create_bundle
from worker.cache import DiskCache
from worker.records import ProgramSpec
executable, _ = compile_program(lowered(0), cache_dir={cache!r})
spec = ProgramSpec.from_executable("p", executable)
create_bundle({bundle!r}, [(spec, DiskCache({cache!r}, create=False), "")])
"""
"""A child that compiles test_bundle_types' program on its cpu runtime and bundles it."""


def test_a_refused_import_makes_no_cache(one, tmp_path):  # noqa: F811
    edited = edit_index(one["bundle"], tmp_path / "edited.bundle", flipped_shape)
    cache = tmp_path / "new" / "cache"
    done = pjrt_pool("bundle", "import", str(edited), "--cache-dir", str(cache))
    assert done.returncode == 1 and "index gives program 'p'" in done.stderr, done.stderr
    assert not cache.exists()
    good = pjrt_pool("bundle", "import", str(one["bundle"]), "--cache-dir", str(cache))
    assert good.returncode == 0, good.stderr
    assert len(list((cache / "entries").iterdir())) == 1


@pytest.mark.parametrize("plugin", ["installed", "a copy"])
def test_a_run_from_a_bundle_creates_nothing_in_an_existing_default_cache(
    one,  # noqa: F811
    tmp_path,
    plugin,
):
    # The host has a default cache directory already (another tool warmed it, or
    # an earlier compile): running from a bundle reads the bundle and at most the
    # runtime's memos there, and makes no folders of its own. "installed" is the cpu
    # platform's own runtime (jaxlib's client). A copy of the CPU plugin is no
    # installed file that its RECORD vouches for, so its library is read (and the
    # reading memoized) as it loads: the cpu platform is given it, and a bundle of
    # the program built with it.
    bundle = one["bundle"]
    home = tmp_path / "home"
    default = home / ".cache" / "pjrt-pool"
    default.mkdir(parents=True, mode=0o700)
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "PJRT_POOL_CACHE_DIR": ""}
    if plugin == "a copy":
        copy = tmp_path / "plugin.so"
        shutil.copyfile(find_plugin("pjrt_cpu").path, copy)
        env[env_var("cpu")] = str(copy)
        bundle = tmp_path / "copy.bundle"
        made = BUNDLE_ONE.format(
            tests=str(REPO / "tests"), bundle=str(bundle), cache=str(tmp_path / "copy-cache")
        )
        run_python(made, env={env_var("cpu"): str(copy)})
    done = pjrt_pool("run", str(bundle), "p", "--json", env=env)
    assert done.returncode == 0, done.stderr
    made = sorted(path.name for path in default.iterdir())
    assert not {"entries", "loads", "locks"} & set(made), made
