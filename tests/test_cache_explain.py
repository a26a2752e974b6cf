"""pjrt-pool cache explain: why a program would miss, and exactly which key part differs."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import pjrt_pool

SPEC = """
import jax, jax.numpy as jnp

def programs():
    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    return [("double", lambda a: a * {factor}, [x]), ("sine", jnp.sin, [x])]
"""

OTHER_FLAGS = "--xla_cpu_enable_fast_math=true"
"""A code-generation flag: entries compiled under it are keyed apart from the default's."""


def _spec(folder: Path, factor: int = 2) -> Path:
    path = folder / f"spec{factor}.py"
    path.write_text(textwrap.dedent(SPEC.format(factor=factor)))
    return path


@pytest.mark.slow
def test_a_cpu_entry_warmed_with_other_xla_flags_names_the_flags(tmp_path):
    cache, spec, manifest = tmp_path / "cache", _spec(tmp_path), tmp_path / "m.json"
    warmed = pjrt_pool(
        "warm", str(spec), "--cache-dir", str(cache), "--workers", "1", "--manifest",
        str(manifest), env={"XLA_FLAGS": OTHER_FLAGS},
    )  # fmt: skip
    assert warmed.returncode == 0, warmed.stderr

    # Here, without the flag: both programs would miss, and each one's entry says why.
    here = {"XLA_FLAGS": ""}
    done = pjrt_pool("cache", "explain", str(spec), "--cache-dir", str(cache), env=here)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("double: would miss (") and lines[1] == "  nearest entries:"
    # JAX puts XLA_FLAGS' debug options in the compile options it lowers with: they differ too.
    assert "(same program), 2 part(s) differ:" in lines[2]
    assert lines[3].startswith("    compile_options: built with ") and "bytes sha256:" in lines[3]
    assert lines[4].startswith("    environment.xla_flags: built with [") and (
        "'xla_cpu_enable_fast_math=true'" in lines[4].split(", here")[0]
    )
    assert "xla_cpu_enable_fast_math" not in lines[4].split(", here")[1]
    assert lines[-1] == "0 of 2 programs would hit, 2 miss"

    # With the flag: both would hit.
    done = pjrt_pool(
        "cache", "explain", str(spec), "--cache-dir", str(cache), env={"XLA_FLAGS": OTHER_FLAGS}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "2 of 2 programs would hit, 0 miss"

    # The manifest written under the flag, explained here: its entry is the first named.
    done = pjrt_pool("cache", "explain", str(manifest), "sine", "--json", env={"XLA_FLAGS": ""})
    assert done.returncode == 1, done.stderr
    (sine,) = json.loads(done.stdout)["programs"]
    keys = json.loads(manifest.read_text())["programs"]
    assert sine["key"] == next(p["key"] for p in keys if p["name"] == "sine")
    assert "the manifest names an entry built elsewhere; here the key is" in sine["note"]
    assert sine["nearest"][0]["key"] == sine["key"] and sine["nearest"][0]["same_program"]
    assert [d.split(":")[0] for d in sine["nearest"][0]["differences"]] == ["environment.xla_flags"]

    # The same name lowered from other text: the program's own part differs.
    changed = _spec(tmp_path, factor=3)
    done = pjrt_pool(
        "cache", "explain", str(changed), "double", "--cache-dir", str(cache),
        env={"XLA_FLAGS": OTHER_FLAGS},
    )  # fmt: skip
    assert done.returncode == 1
    assert "(a program named 'double'), 1 part(s) differ:" in done.stdout
    assert "    program_sha256: built with '" in done.stdout


@pytest.mark.slow
def test_only_entries_of_the_same_program_or_name_are_near_and_unknown_text_is_said(tmp_path):
    """Issue 63: a program never warmed listed another program's entry as its nearest ("(a
    program 'jit__lambda'), 2 part(s) differ: program_sha256 ..."), every lambda's module
    having that name; and a manifest's program whose entry is gone said "0 part(s) differ:
    (no part differs)"."""
    cache, spec, manifest = tmp_path / "cache", _spec(tmp_path), tmp_path / "m.json"
    warmed = pjrt_pool(
        "warm", str(spec), "--cache-dir", str(cache), "--workers", "1", "--manifest",
        str(manifest),
    )  # fmt: skip
    assert warmed.returncode == 0, warmed.stderr
    other = tmp_path / "other.py"
    other.write_text(
        "import jax, jax.numpy as jnp\n"
        "def programs():\n"
        "    x = jax.ShapeDtypeStruct((8,), jnp.float32)\n"
        "    return [('halve', lambda a: a / 2, [x])]\n"
    )
    done = pjrt_pool("cache", "explain", str(other), "--cache-dir", str(cache))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith("halve: would miss (")
    assert "no entry of this program, nor of a program named 'halve', was found" in done.stdout
    assert "nearest entries" not in done.stdout and "jit__lambda" not in done.stdout

    programs = json.loads(manifest.read_text())["programs"]
    key = next(p["key"] for p in programs if p["name"] == "sine")
    (cache / "entries" / f"{key}.pjx").unlink()
    done = pjrt_pool("cache", "explain", str(manifest), "sine")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"the manifest names entry {key}, which is in neither the cache nor the remote" in (
        " ".join(done.stdout.split())
    )
    assert "which part of the key differs cannot be said" in done.stdout
    assert "part(s) differ" not in done.stdout and "no part differs" not in done.stdout


def test_usage_errors(tmp_path):
    spec = _spec(tmp_path)
    done = pjrt_pool("cache", "explain", str(spec), "cosine", "--cache-dir", str(tmp_path / "c"))
    assert done.returncode == 2
    assert "has no program named 'cosine'; it has: double, sine" in done.stderr
    done = pjrt_pool("cache", "explain", str(tmp_path / "missing.json"))
    assert done.returncode == 2 and "does not exist" in done.stderr
    # No entry anywhere: a miss, said so.
    done = pjrt_pool("cache", "explain", str(spec), "sine", "--cache-dir", str(tmp_path / "c"))
    assert done.returncode == 1
    assert "no entry of this program, nor of a program named 'sine', was found" in done.stdout


@pytest.mark.slow
def test_a_tpu_entry_for_another_topology_names_the_topology(tmp_path):
    pytest.importorskip("libtpu", reason="needs libtpu (pip install -e '.[tpu]')")
    from worker.plugin import libtpu

    if libtpu.attached_chips():
        pytest.skip("a TPU is attached: this is about explaining for a host of a topology")
    cache, spec = tmp_path / "cache", _spec(tmp_path)
    common = ("--platform", "tpu", "--cache-dir", str(cache))
    warmed = pjrt_pool("warm", str(spec), *common, "--topology", "v5e:2x2", "--workers", "1")
    assert warmed.returncode == 0, warmed.stderr
    done = pjrt_pool("cache", "explain", str(spec), "sine", *common, "--topology", "v5e:1x1")
    assert done.returncode == 1, done.stdout + done.stderr
    # The same program, built for v5e:2x2 (its lines end at the next entry, or the summary).
    nearest = done.stdout.split("  entry ")[1].split("\n0 of 1 programs")[0]
    assert "(same program), 4 part(s) differ:" in nearest
    differences = [line.strip() for line in nearest.splitlines()[1:]]
    assert "topology.name: built with 'v5e:2x2', here 'v5e:1x1'" in differences
    assert "topology.chips: built with '2x2x1', here '1x1x1'" in differences
    assert all(line.startswith("topology.") for line in differences), differences
    done = pjrt_pool("cache", "explain", str(spec), "sine", *common, "--topology", "v5e:2x2")
    assert done.returncode == 0 and "sine: would hit" in done.stdout
    # No chip here and no topology given: the host to explain for must be named.
    done = pjrt_pool("cache", "explain", str(spec), "sine", *common)
    assert done.returncode == 2 and "give --topology NAME" in done.stderr
