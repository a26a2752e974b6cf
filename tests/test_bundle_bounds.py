"""A bundle's entry is bounded before it is read, and read once into one buffer (issue 29, 7).

A crafted unsigned bundle whose entry carries a large payload (valid in
every digest: whoever makes an unsigned bundle computes them) costs a
reader one copy of the member, and an import into a cache whose bound it
exceeds costs none: the bound is checked before anything of the member but
its header is read. Peak memory is measured in a child process, against a
pristine bundle's in the same run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_python
from test_bundle_types import one  # noqa: F401 (a fixture)

from pool.manifest import load_manifest
from worker.bundle.writer import create_bundle
from worker.cache import DiskCache
from worker.cache import entry as entry_format

PADDING = 192 << 20
MiB = 1 << 20

# VmHWM, not ru_maxrss: Linux carries the parent's ru_maxrss into a child across exec.
PEAK = """
import sys
from pool.cli.main import main
code = main({arguments!r})
with open("/proc/self/status") as status:
    (peak,) = [line.split()[1] for line in status if line.startswith("VmHWM:")]
print(int(peak) * 1024, code, file=sys.stderr)
"""


def peak(*arguments: str, env: dict[str, str] | None = None) -> tuple[int, int]:
    """Runs pjrt-pool in a child; returns its peak resident bytes and its exit code."""
    done = run_python(PEAK.format(arguments=list(arguments)), env=env, check=False, timeout=300)
    size, code = done.stderr.strip().splitlines()[-1].split()
    return int(size), int(code)


@pytest.fixture(scope="module")
def padded(one, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """A bundle of the program whose entry's payload was padded by PADDING bytes, digests redone."""
    root = tmp_path_factory.mktemp("padded")
    cache = DiskCache(root / "cache")
    spec = load_manifest(one["manifest"]).spec("p")
    real = entry_format.decode((Path(one["cache"]) / "entries" / f"{spec.key}.pjx").read_bytes())
    payload = real.payload + bytes(PADDING)
    (cache.entries_dir / f"{spec.key}.pjx").write_bytes(
        entry_format.encode(spec.key, real.parts, real.metadata, payload)
    )
    del payload
    output = root / "padded.bundle"
    create_bundle(output, [(spec, DiskCache(root / "cache", create=False), "")])
    return output


@pytest.mark.slow
def test_a_large_entry_is_read_once_and_bounded_before_it_is_read(one, padded, tmp_path):  # noqa: F811
    pristine, code = peak("bundle", "check", str(one["bundle"]))
    assert code == 0
    checked, code = peak("bundle", "check", str(padded), "--json")
    assert code == 0  # every digest holds: it would load
    # One copy of the member, not two or three (the chunks, their join, the payload's slice).
    assert checked - pristine < 1.3 * PADDING, (checked // MiB, pristine // MiB)

    bounded = {"PJRT_POOL_CACHE_MAX_SIZE": "64M"}
    cache = tmp_path / "cache"
    imported, code = peak("bundle", "import", str(padded), "--cache-dir", str(cache), env=bounded)
    assert code == 1
    assert imported - pristine < 32 * MiB, (imported // MiB, pristine // MiB)  # nothing read
    assert not cache.exists()  # refused before a cache was made
    check = run_python(
        f"from pool.cli.main import main; main(['bundle', 'check', {str(padded)!r}, '--json'])",
        env=bounded,
        check=False,
    )
    (program,) = json.loads(check.stdout)["programs"]
    assert program["status"] == "would miss"
    assert "larger than the cache's bound" in program["reason"]
