"""Paths a user passes that are not regular files: FIFOs, devices, links; damaged bundles.

A FIFO given as a manifest, bundle or inputs file must be refused at once
(a blocking open would wait for a writer forever), an output path that is a
FIFO or device must not be renamed over, and a bundle whose first header
was damaged is reported as a damaged bundle (issue 29, 8, E and "Also").
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from conftest import pjrt_pool
from test_bundle_types import one  # noqa: F401 (a fixture)

from pool.manifest import ManifestError, load_manifest
from worker.bundle.writer import create_bundle
from worker.cache import DiskCache
from worker.errors import BundleError

HANG = 60
"""Seconds a command may take: each takes about one; a blocking open would never end."""


def assert_refused(done, *fragments: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_a_fifo_given_as_any_input_is_refused_at_once(one, tmp_path):  # noqa: F811
    fifo = tmp_path / "f.bundle"
    os.mkfifo(fifo)
    manifest, bundle = str(one["manifest"]), str(one["bundle"])
    for arguments in (
        ["bundle", "check", str(fifo)],
        ["run", str(fifo), "p"],
        ["run", str(fifo)],
        ["bundle", "create", str(fifo), "-o", str(tmp_path / "out.bundle")],
        ["bundle", "merge", bundle, str(fifo), "-o", str(tmp_path / "out.bundle")],
        ["bundle", "import", str(fifo), "--cache-dir", str(tmp_path / "cache")],
        ["run", manifest, "p", "--inputs", str(fifo)],
    ):
        assert_refused(pjrt_pool(*arguments, timeout=HANG), "is a FIFO")
    assert not (tmp_path / "out.bundle").exists() and not (tmp_path / "cache").exists()
    with pytest.raises(ManifestError, match="not a regular file"):
        load_manifest(fifo)


def test_an_output_that_is_not_a_regular_file_is_not_renamed_over(one, tmp_path):  # noqa: F811
    fifo, link = tmp_path / "out.fifo", tmp_path / "link.bundle"
    os.mkfifo(fifo)
    link.symlink_to(tmp_path / "elsewhere")
    manifest = str(one["manifest"])
    for output, kind in ((fifo, "a FIFO"), (link, "a symbolic link"), ("/dev/null", "device")):
        done = pjrt_pool("bundle", "create", manifest, "-o", str(output), timeout=HANG)
        assert_refused(done, kind)
        merged = pjrt_pool("bundle", "merge", str(one["bundle"]), "-o", str(output), timeout=HANG)
        assert_refused(merged, kind)
    imported = pjrt_pool(
        "bundle",
        "import",
        str(one["bundle"]),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--manifest",
        str(fifo),
        timeout=HANG,
    )
    assert_refused(imported, "--manifest", "a FIFO")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink()
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    spec = load_manifest(one["manifest"]).spec("p")
    with pytest.raises(BundleError, match="not a regular file"):
        create_bundle(fifo, [(spec, DiskCache(one["cache"], create=False), "")])
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_bundle_with_a_damaged_header_is_reported_as_a_damaged_bundle(one, tmp_path):  # noqa: F811
    data = bytearray(Path(one["bundle"]).read_bytes())
    data[257:262] = b"ustaX"  # the first header's magic
    damaged = tmp_path / "damaged.bundle"
    damaged.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="fails its checksum") as refused:
        load_manifest(damaged)
    assert "utf-8" not in str(refused.value)
    done = pjrt_pool("bundle", "check", str(damaged), timeout=HANG)
    assert done.returncode == 1 and "fails its checksum" in done.stderr, done.stderr
