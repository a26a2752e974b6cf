"""A published file survives a power loss: after each rename, its directory is fsynced.

A rename lives in the directory's data; until that is flushed a power loss
can undo it (issue 29, 10). The system calls of a real child process are
traced with strace: every rename that publishes a cache entry, a bundle or
a manifest is followed by an fsync of the directory it was made in.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")

PUBLISH = """
import sys
from pathlib import Path
from pool.manifest import Manifest
from worker.bundle.writer import Source, write_archive
from worker.cache import DiskCache
from worker.identity.keys import key_of
root = Path(sys.argv[1])
cache = DiskCache(root / "cache")
parts = {"program": "durability"}
assert cache.publish(key_of(parts), parts, {}, b"a payload")
(root / "out").mkdir()
write_archive(root / "out" / "app.bundle", [Source("index.json", 2, lambda: b"{}")])
(root / "manifests").mkdir()
Manifest([], None, "cpu").write(root / "manifests" / "m.json")
"""

_RENAME = re.compile(
    r'rename(?:at2?)?\((?:\d+<(?P<dir>[^>]*)>, )?"[^"]*", '
    r'(?:\d+<[^>]*>, )?"(?P<dst>[^"]*)"'
)
_FSYNC = re.compile(r"fsync\(\d+<(?P<path>[^>]*)>\)\s+= 0")


def test_every_published_rename_is_followed_by_an_fsync_of_its_directory(tmp_path):
    trace = tmp_path / "trace.txt"
    done = subprocess.run(
        [
            "strace",
            "-f",
            "-y",
            "-o",
            str(trace),
            "-e",
            "trace=fsync,rename,renameat,renameat2",
            sys.executable,
            "-c",
            textwrap.dedent(PUBLISH),
            str(tmp_path),
        ],
        env={
            "PYTHONPATH": str(REPO),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = trace.read_text().splitlines()
    published = {}
    for number, line in enumerate(lines):
        found = _RENAME.search(line)
        if found is None or "= 0" not in line:
            continue
        target = Path(found["dir"] or "/", found["dst"])  # renameat's name is relative
        if target.is_relative_to(tmp_path):
            published[str(target)] = (number, str(target.parent))
    wanted = {"app.bundle", "m.json"}
    assert wanted <= {Path(d).name for d in published}, lines
    assert any(d.endswith(".pjx") for d in published), lines
    for dst, (number, directory) in published.items():
        later = [_FSYNC.search(line) for line in lines[number + 1 :]]
        synced = {found["path"] for found in later if found}
        assert directory in synced, f"{dst}: no fsync of {directory} after its rename"
