"""What the commands report, in words that hold, and what they refuse to do silently (issue 53).

Each runs the real `pjrt-pool` in a child process: a warm's counts (a
failure is not warmed, the compile seconds are the workers' sum, one
program is "1 program"), a bundle of a partial manifest (refused, or said),
a host that publishes unsigned records to a remote (warned once; `cache
info --remote` says so), and a cache directory that cannot be made (exit 2
from `bundle import`; one line, once, from compile_program and a Pool).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import pjrt_pool, run_python

from worker.cache.remote import generate_private_key

GOOD = '("add", lambda a, b: a + b, [jax.ShapeDtypeStruct((4,), jnp.float32)] * 2)'
BAD = '("bad", lambda a: a.no_such_attribute, [jax.ShapeDtypeStruct((4,), jnp.float32)])'
SPEC = "import jax, jax.numpy as jnp\n\ndef programs():\n    return [{}]\n"
UNSIGNED = "this process publishes unsigned records"
UNCREATABLE = "/proc/pjrt-pool-test/cache"  # /proc takes no new folder, even from root


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A spec of one program, warmed into a cache, its manifest."""
    directory = tmp_path_factory.mktemp("one")
    spec, cache, manifest = directory / "spec.py", directory / "cache", directory / "m.json"
    spec.write_text(SPEC.format(GOOD))
    done = pjrt_pool("warm", str(spec), "--cache-dir", str(cache), "--manifest", str(manifest))
    assert done.returncode == 0, done.stderr
    return {"dir": directory, "spec": spec, "cache": cache, "manifest": manifest, "warm": done}


def test_a_warm_counts_what_it_warmed_and_says_whose_seconds(one, tmp_path: Path) -> None:
    lines = one["warm"].stdout.splitlines()
    assert re.fullmatch(r"warmed 1 program in [\d.]+ s: 1 compiled", lines[0]), lines[0]
    assert lines[1].startswith("statistics, times summed over the workers: 1 compiled in ")
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC.format(f"{GOOD}, {BAD}"))
    done = pjrt_pool("warm", str(spec), "--cache-dir", str(one["cache"]))
    first = done.stdout.splitlines()[0]
    assert done.returncode == 1
    assert re.fullmatch(r"warmed 1 of 2 programs in [\d.]+ s: 1 loaded, 1 lowering error", first)


def test_bundle_create_refuses_a_partial_manifest_unless_asked(one, tmp_path: Path) -> None:
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({**json.loads(one["manifest"].read_text()), "partial": True}))
    bundle = tmp_path / "b.bundle"
    refused = pjrt_pool("bundle", "create", str(partial), "-o", str(bundle))
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "is a partial manifest" in lines[0] and "--allow-partial" in lines[0]
    assert not bundle.exists()
    made = pjrt_pool("bundle", "create", str(partial), "-o", str(bundle), "--allow-partial")
    assert made.returncode == 0, made.stderr
    assert "1 program, 1 entry built in 1 environment" in made.stdout
    assert f"partial: {partial} names only the 1 program warmed (its warm did not" in made.stdout
    whole = pjrt_pool("bundle", "create", str(one["manifest"]), "-o", str(tmp_path / "w.bundle"))
    assert whole.returncode == 0 and "partial" not in whole.stdout


def test_a_host_without_a_signing_key_is_told_its_records_are_unsigned(one, tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    remote = {"PJRT_POOL_CACHE_REMOTE": bucket.as_uri()}
    info = pjrt_pool("cache", "info", env=remote)
    assert info.returncode == 0, info.stderr
    assert re.search(r"remote signing +unsigned: it publishes and reads unsigned", info.stdout)
    warmed = pjrt_pool("warm", str(one["spec"]), "--cache-dir", str(tmp_path / "c1"), env=remote)
    assert warmed.returncode == 0, warmed.stderr
    assert warmed.stderr.count(UNSIGNED) == 1, warmed.stderr
    assert "1 published" in warmed.stdout
    # Another host, its cache empty: "1 entry fetched" (and unsigned still: it would publish).
    fetched = pjrt_pool("warm", str(one["spec"]), "--cache-dir", str(tmp_path / "c2"), env=remote)
    assert "remote cache: 1 entry fetched (1 by prefetch)" in fetched.stdout, fetched.stdout
    pulled = pjrt_pool("cache", "pull", "--cache-dir", str(tmp_path / "c3"), env=remote)
    assert pulled.returncode == 0 and pulled.stdout.startswith("pulled 1 entry ("), pulled.stdout
    # A host that signs is not warned, and info says how it signs.
    public = generate_private_key(tmp_path / "ci.pem")
    signing = {**remote, "PJRT_POOL_CACHE_PRIVATE_KEY_FILE": str(tmp_path / "ci.pem")}
    signed = pjrt_pool("warm", str(one["spec"]), "--cache-dir", str(tmp_path / "c4"), env=signing)
    assert signed.returncode == 0 and UNSIGNED not in signed.stderr, signed.stderr
    assert "1 published" in signed.stdout
    described = json.loads(pjrt_pool("cache", "info", "--json", env=signing).stdout)["remote"]
    assert described["signs"] and described["signer"].startswith("ed25519-"), described
    reader = {**remote, "PJRT_POOL_CACHE_PUBLIC_KEY": public}
    shown = pjrt_pool("cache", "info", env=reader).stdout
    assert "verifies ed25519-" in shown and "publishes none" in shown, shown


def test_bundle_import_to_a_cache_that_cannot_be_made_exits_2_in_one_line(
    one, tmp_path: Path
) -> None:
    bundle = tmp_path / "b.bundle"
    assert pjrt_pool("bundle", "create", str(one["manifest"]), "-o", str(bundle)).returncode == 0
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for place in (UNCREATABLE, str(a_file / "cache")):
        done = pjrt_pool("bundle", "import", str(bundle), "--cache-dir", place)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert lines[0].startswith(f"pjrt-pool bundle import: --cache-dir {place} cannot be")


CANNOT_BE_MADE = f"""
import warnings
import numpy as np
import jax, jax.numpy as jnp
from pool import Pool, compile_program, lower

program = lower(lambda x: x * 2, [jax.ShapeDtypeStruct((4,), jnp.float32)])
{{}}
with warnings.catch_warnings(record=True) as caught:  # still a warning, for who records them
    warnings.simplefilter("always")
    compile_program(program, cache_dir="{UNCREATABLE}-recorded")
assert [type(w.message).__name__ for w in caught] == ["CacheUnavailableWarning"], caught
"""


@pytest.mark.parametrize(
    "call",
    [
        f'compile_program(program, cache_dir="{UNCREATABLE}")',
        f'with Pool(1, cache_dir="{UNCREATABLE}") as pool:\n'
        "    assert (pool.run(program, [np.ones(4, np.float32)])[0] == 2).all()",
    ],
    ids=["compile_program", "Pool"],
)
def test_a_cache_directory_that_cannot_be_made_is_said_once_in_one_line(call: str) -> None:
    done = run_python(CANNOT_BE_MADE.format(call), env={"JAX_PLATFORMS": "cpu"})
    said = [line for line in done.stderr.splitlines() if f"{UNCREATABLE}:" in line]
    assert said == [
        f"pjrt-pool disk cache disabled for this process: cannot create cache directory "
        f"{UNCREATABLE}: No such file or directory"
    ], done.stderr
    assert "CacheUnavailableWarning" not in done.stderr
