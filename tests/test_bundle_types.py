"""A bundle's types are its entries' own: a stale or edited manifest or index is refused.

A manifest or bundle index names each program's types beside its key, out
of reach of the entry's digests; the entry records the types it was
compiled for. A program given an int32 where it takes float32 (the same
size) would run on reinterpreted bytes: bundle create, every bundle loader
and bundle check compare the two (issue 29, B and C).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cache_helpers import lowered
from conftest import pjrt_pool
from test_bundle import make_bundle, rebuild

from pool.manifest import Manifest, load_manifest
from worker import compile_program
from worker.bundle.reader import Bundle
from worker.bundle.writer import create_bundle, merge_bundles
from worker.cache import DiskCache
from worker.errors import BundleError
from worker.records import ProgramSpec

X = np.linspace(-1, 1, 4, dtype=np.float32)


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A cache holding one program (float32[4] -> float32[4]), its manifest and its bundle."""
    root = tmp_path_factory.mktemp("types")
    cache = root / "cache"
    executable, _ = compile_program(lowered(0), cache_dir=cache)
    spec = ProgramSpec.from_executable("p", executable)
    Manifest([spec], str(cache), "cpu").write(root / "m.json")
    bundle = make_bundle(root / "m.json", root / "good.bundle")
    return {"root": root, "cache": cache, "manifest": root / "m.json", "bundle": bundle}


def edit_manifest(source: Path, target: Path, change) -> Path:
    document = json.loads(source.read_text())
    change(document["programs"][0])
    target.write_text(json.dumps(document))
    return target


def edit_index(source: Path, target: Path, change) -> Path:
    def members(items: list) -> list:
        out = []
        for info, data in items:
            if info.name == "index.json":
                index = json.loads(data)
                change(index["programs"][0])
                data = json.dumps(index, sort_keys=True, indent=1).encode() + b"\n"
                info.size = len(data)
            out.append((info, data))
        return out

    return rebuild(source, target, members)


def as_int32(program: dict) -> None:
    program["input_types"][0]["dtype"] = "int32"


def flipped_shape(program: dict) -> None:
    program["input_types"][0]["shape"] = [5]


def dropped_input(program: dict) -> None:
    program["input_types"] = []


def test_create_refuses_a_manifest_whose_types_differ_from_the_entry(one, tmp_path):
    stale = edit_manifest(one["manifest"], tmp_path / "stale.json", as_int32)
    loaded = load_manifest(stale)
    cache = DiskCache(one["cache"], create=False)
    with pytest.raises(BundleError, match=r"inputs \(int32\[4\]\).*compiled for \(float32\[4\]\)"):
        create_bundle(tmp_path / "x.bundle", [(s, cache, "") for s in loaded.specs.values()])
    assert not (tmp_path / "x.bundle").exists()
    done = pjrt_pool("bundle", "create", str(stale), "-o", str(tmp_path / "y.bundle"))
    assert done.returncode == 1 and "int32[4]" in done.stderr, done.stderr
    assert not (tmp_path / "y.bundle").exists()


@pytest.mark.parametrize("change", [as_int32, flipped_shape, dropped_input])
def test_a_bundle_whose_index_types_were_changed_is_refused_by_every_reader(one, tmp_path, change):
    edited = edit_index(one["bundle"], tmp_path / "edited.bundle", change)
    with Bundle(edited) as bundle:
        (key,) = bundle.index.entries
        with pytest.raises(BundleError, match="index gives program 'p' inputs"):
            bundle.entry(key)
    with pytest.raises(BundleError, match="index gives program 'p' inputs"):
        load_manifest(edited).run("p", [X])
    check = pjrt_pool("bundle", "check", str(edited))
    assert check.returncode == 1, check.stdout + check.stderr
    assert "p: would miss" in check.stdout and "index gives program 'p'" in check.stdout
    if change is as_int32:
        inputs = tmp_path / "ints.npz"
        np.savez(inputs, np.arange(4, dtype=np.int32))
        run = pjrt_pool("run", str(edited), "p", "--inputs", str(inputs))
    else:
        run = pjrt_pool("run", str(edited), "p")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1, run.stdout + run.stderr
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert "index gives program 'p'" in lines[0]
    # The untouched bundle runs, with the entry's own types.
    good = pjrt_pool("run", str(one["bundle"]), "p", "--json")
    assert good.returncode == 0, good.stderr


def test_merge_refuses_two_programs_of_one_name_and_environment(one, tmp_path):
    """An updated model merged after the old one: same name and types, other program (D)."""
    cache = DiskCache(one["cache"], create=False)
    bundles = []
    for variant in (1, 2):
        executable, _ = compile_program(lowered(variant), cache_dir=one["cache"])
        spec = ProgramSpec.from_executable("p", executable)
        path = tmp_path / f"v{variant}.bundle"
        create_bundle(path, [(spec, cache, "")])
        bundles.append(path)
    for order in (bundles, bundles[::-1]):
        with pytest.raises(BundleError, match="different programs built for one environment") as e:
            merge_bundles(tmp_path / "out.bundle", order)
        assert str(order[0]) in str(e.value) and str(order[1]) in str(e.value)
        assert not (tmp_path / "out.bundle").exists()
    done = pjrt_pool("bundle", "merge", *map(str, bundles), "-o", str(tmp_path / "cli.bundle"))
    assert done.returncode == 1 and "one environment" in done.stderr, done.stderr
    # The same bundle twice, or one program's entries of two environments, still merge.
    merge_bundles(tmp_path / "same.bundle", [bundles[0], bundles[0]])
