"""A refused bundle leaves no cache directory behind (issue 29, Also).

A refused import into a directory that does not exist must not make an
empty cache there.
"""

from __future__ import annotations

from test_bundle_types import edit_index, flipped_shape, one  # noqa: F401 (one: a fixture)
from test_warm import pjrt_pool


def test_a_refused_import_makes_no_cache(one, tmp_path):  # noqa: F811
    edited = edit_index(one["bundle"], tmp_path / "edited.bundle", flipped_shape)
    cache = tmp_path / "new" / "cache"
    done = pjrt_pool("bundle", "import", str(edited), "--cache-dir", str(cache))
    assert done.returncode == 1 and "index gives program 'p'" in done.stderr, done.stderr
    assert not cache.exists()
    good = pjrt_pool("bundle", "import", str(one["bundle"]), "--cache-dir", str(cache))
    assert good.returncode == 0, good.stderr
    assert len(list((cache / "entries").iterdir())) == 1
