"""Bundles: made from real caches, run read-only in fresh processes, merged, checked, imported.

Two caches hold the same three programs: one compiled in this process's
environment, one by a Pool whose workers ran with PJRT_NPROC=3 (an
environment the key records: another host, as far as a loader can tell).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from cache_helpers import lowered
from conftest import REPO, pjrt_pool, run_python

from pool import Pool
from pool.manifest import Manifest, ManifestError, load_manifest
from worker import compile_program
from worker.bundle.importing import import_bundle
from worker.bundle.reader import Bundle
from worker.bundle.writer import create_bundle, merge_bundles
from worker.cache import DiskCache
from worker.errors import BundleError, NotInCacheError
from worker.records import ProgramSpec

NAMES = ("p0", "p1", "p2")
SECRET = "a bundle signing secret of some length"


def expected(variant: int, x: np.ndarray) -> np.ndarray:
    scale = np.float32(variant + 2)
    return np.sin(x) * scale + scale


X = np.linspace(-1, 1, 4, dtype=np.float32)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Cache "here" (this process's environment) and cache "nproc3" (PJRT_NPROC=3), manifests."""
    root = tmp_path_factory.mktemp("bundles")
    here_cache, other_cache = root / "here", root / "nproc3"
    specs = []
    for variant, name in enumerate(NAMES):
        executable, _ = compile_program(lowered(variant), cache_dir=here_cache)
        specs.append(ProgramSpec.from_executable(name, executable))
    Manifest(specs, str(here_cache), "cpu").write(root / "here.json")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PJRT_NPROC", "3")
        with Pool(1, cache_dir=other_cache) as pool:
            programs = [(name, lowered(variant)) for variant, name in enumerate(NAMES)]
            other = pool.compile_many(programs)
    Manifest(other, str(other_cache), "cpu").write(root / "nproc3.json")
    assert {s.key for s in specs}.isdisjoint(s.key for s in other)
    return {
        "root": root,
        "here_cache": here_cache,
        "other_cache": other_cache,
        "here": root / "here.json",
        "other": root / "nproc3.json",
    }


def make_bundle(manifest: Path, output: Path) -> Path:
    loaded = load_manifest(manifest)
    cache = DiskCache(loaded.cache_dir, create=False)
    create_bundle(output, [(spec, cache, "") for spec in loaded.specs.values()])
    return output


@pytest.fixture(scope="module")
def bundles(warmed: dict[str, Path]) -> dict[str, Path]:
    root = warmed["root"]
    here = make_bundle(warmed["here"], root / "here.bundle")
    other = make_bundle(warmed["other"], root / "nproc3.bundle")
    merged = root / "merged.bundle"
    merge_bundles(merged, [here, other])
    return {"here": here, "other": other, "merged": merged}


# -- the container ------------------------------------------------------------------


def test_a_bundle_is_a_plain_deterministic_tar_with_an_index(warmed, bundles, tmp_path):
    with tarfile.open(bundles["here"]) as archive:
        members = archive.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names) and names[-1] == "index.json" and len(names) == 4
    assert all(m.isreg() and m.mtime == 0 and m.uid == m.gid == 0 for m in members)
    assert all(m.mode == 0o644 and m.uname == m.gname == "" for m in members)
    with Bundle(bundles["here"]) as bundle:
        index = json.loads(bundle.index_bytes)
    assert [p["name"] for p in index["programs"]] == list(NAMES)
    (environment,) = index["environments"].values()
    parts = environment["parts"]
    assert set(parts["plugin"]) == {"sha256", "api_version", "platform_version", "device_kind"}
    assert parts["host"]["cpu_features"]
    assert parts["environment"] == {"xla_flags": []}  # jaxlib's client: no flags added
    assert environment["cpu_flags"]  # the builder's CPU flags, for messages
    for entry in index["entries"].values():
        assert set(entry) == {"environment", "program_sha256", "options", "size", "sha256"}
    # Compile options are held once, however many entries share them (jax.jit's: ~1 KB).
    assert {e["options"] for e in index["entries"].values()} == set(index["compile_options"])
    assert len(index["compile_options"]) == 1
    # The same inputs give the same bytes, whenever the cache's files were last touched.
    for path in (warmed["here_cache"] / "entries").iterdir():
        os.utime(path, (1, 1))
    again = make_bundle(warmed["here"], tmp_path / "again.bundle")
    assert again.read_bytes() == bundles["here"].read_bytes()


def test_the_index_is_signed_with_a_secret_and_checked_by_readers(warmed, monkeypatch, tmp_path):
    monkeypatch.setenv("PJRT_POOL_CACHE_SECRET", SECRET)
    cache = DiskCache(warmed["here_cache"], create=False)
    spec = load_manifest(warmed["here"]).spec("p0")
    with pytest.raises(BundleError, match="unsigned, and this process signs"):
        create_bundle(tmp_path / "x.bundle", [(spec, cache, "")])  # its entries are unsigned
    signed_cache = tmp_path / "signed"
    executable, _ = compile_program(lowered(0), cache_dir=signed_cache)
    signed_spec = ProgramSpec.from_executable("p0", executable)
    signed = tmp_path / "signed.bundle"
    create_bundle(signed, [(signed_spec, DiskCache(signed_cache, create=False), "")])
    with tarfile.open(signed) as archive:
        assert "index.mac" in archive.getnames()
    Bundle(signed).close()
    monkeypatch.setenv("PJRT_POOL_CACHE_SECRET", "another secret, just as long")
    with pytest.raises(BundleError, match="signed with another secret"):
        Bundle(signed)
    monkeypatch.delenv("PJRT_POOL_CACHE_SECRET")
    Bundle(signed).close()  # without a secret, digests only (as the cache reads)


# -- running straight from a bundle -------------------------------------------------


READ_PATH_LEAVES_OUT = ("worker.cache.space", "worker.cache.trust")
"""What a float32 program's run from a bundle has no use for: the cache's space accounting and
directory checks. (ml_dtypes' types, which pjrt-pool loads only when a program, array or name
needs one, jaxlib's client loads itself.)"""

READ_ONLY_RUN = """
import json, sys
from pool.manifest import load_manifest
import numpy as np
manifest = load_manifest("app.bundle")
x = np.linspace(-1, 1, 4, dtype=np.float32)
(out,) = manifest.run("p1", [x])
print(json.dumps({
    "out": out.tolist(),
    "key": manifest.spec("p1").key,
    "jax": sorted(m for m in sys.modules if m == "jax" or m.startswith("jax.")),
    "compiler": sorted(
        m for m in ("worker.compile.compiler", "worker.compile.slots") if m in sys.modules
    ),
    "unneeded": sorted(m for m in UNNEEDED if m in sys.modules),
}))
""".replace("UNNEEDED", repr(READ_PATH_LEAVES_OUT))


def read_only_place(tmp_path: Path, bundle: Path) -> tuple[Path, Path, dict[str, str]]:
    """A directory holding only the bundle and an empty home, both without write permission."""
    place, home = tmp_path / "app", tmp_path / "home"
    place.mkdir()
    home.mkdir()
    (place / "app.bundle").write_bytes(bundle.read_bytes())
    (place / "app.bundle").chmod(0o444)
    for folder in (place, home):
        folder.chmod(0o555)
    env = {
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "PJRT_POOL_CACHE_DIR": "",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    return place, home, env


def everything_under(*folders: Path) -> dict[str, tuple[int, int]]:
    return {
        str(path): (path.stat().st_size, path.stat().st_mtime_ns)
        for folder in folders
        for path in [folder, *folder.rglob("*")]
    }


def test_a_bundle_runs_from_a_read_only_directory_in_a_fresh_process(bundles, tmp_path):
    place, home, env = read_only_place(tmp_path, bundles["here"])
    before = everything_under(place, home)
    inherited = {k: v for k, v in os.environ.items() if k != "PJRT_POOL_CACHE_DIR"}
    environment = {**inherited, **env, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", READ_ONLY_RUN]
    done = subprocess.run(
        command, cwd=place, env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr
    result = json.loads(done.stdout)
    np.testing.assert_allclose(result["out"], expected(1, X), rtol=1e-6)
    assert result["jax"] == [] and result["compiler"] == [] and result["unneeded"] == []
    with Bundle(bundles["here"]) as bundle:
        assert result["key"] in bundle.index.programs["p1"].keys
    assert everything_under(place, home) == before  # nothing written, nothing created

    cli = pjrt_pool("run", "app.bundle", "p2", "--json", env=env, cwd=place)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["outputs"][0]["shape"] == [4]
    assert everything_under(place, home) == before


def damaged_copy(bundle: Path, program: str, place: Path) -> tuple[Path, str]:
    """A copy of a bundle whose entry of one program has other bytes of the same size."""
    data = bytearray(bundle.read_bytes())
    with Bundle(bundle) as opened:
        key = opened.index.programs[program].keys[0]
        member = opened._entries[key]
    data[member.offset + member.size - 1] ^= 0xFF  # same size, other bytes: damaged
    damaged = place / "damaged.bundle"
    damaged.write_bytes(bytes(data))
    return damaged, key


def test_only_the_programs_that_run_are_read(bundles, tmp_path):
    """A damaged member of another program does not stop a run; it stops its own, named."""
    damaged, p0_key = damaged_copy(bundles["here"], "p0", tmp_path)
    manifest = load_manifest(damaged)
    (out,) = manifest.run("p1", [X])
    np.testing.assert_allclose(out, expected(1, X), rtol=1e-6)
    with pytest.raises(BundleError, match=f"entries/{p0_key}.pjx is damaged or was changed"):
        manifest.run("p0", [X])


def test_a_bundle_runs_through_a_pool_each_worker_loading_its_own_entry_read_only(
    bundles, tmp_path, monkeypatch
):
    """The README's manifest.run(..., pool=a_pool) of a bundle: it said "a Pool's workers load
    from its cache directory, not from a bundle" (issue 53)."""
    cache = tmp_path / "cache"
    merged = load_manifest(bundles["merged"])
    with Pool(1, cache_dir=cache) as pool:
        for variant, name in enumerate(NAMES):
            (out,) = merged.run(name, [X], pool=pool)
            np.testing.assert_allclose(out, expected(variant, X), rtol=1e-6)
        assert pool.statistics.loaded == 3 and pool.statistics.compiled == 0
    assert not any((cache / "entries").iterdir())  # read from the bundle: nothing written
    # Workers of another environment (PJRT_NPROC=3) load the entry built for theirs, which
    # the bundle of this environment's entries alone lacks: the worker judges for itself.
    monkeypatch.setenv("PJRT_NPROC", "3")
    with Pool(1, cache_dir=cache) as pool:
        (out,) = merged.run("p2", [X], pool=pool)
        np.testing.assert_allclose(out, expected(2, X), rtol=1e-6)
    missing = pytest.raises(NotInCacheError, match=r"environment\.PJRT_NPROC: built with None")
    with Pool(1, cache_dir=cache) as pool, missing:
        load_manifest(bundles["here"]).run("p2", [X], pool=pool)
    monkeypatch.delenv("PJRT_NPROC")
    # A damaged entry fails its run with the worker's BundleError; the pool goes on.
    damaged, key = damaged_copy(bundles["here"], "p0", tmp_path)
    manifest = load_manifest(damaged)
    with Pool(1, cache_dir=cache) as pool:
        with pytest.raises(BundleError, match=f"entries/{key}.pjx is damaged or was changed"):
            manifest.run("p0", [X], pool=pool)
        np.testing.assert_allclose(manifest.run("p1", [X], pool=pool)[0], expected(1, X), rtol=1e-6)
    with pytest.raises(ManifestError, match="carries its executables"):
        load_manifest(bundles["here"], cache_dir="/somewhere")


# -- a mixed fleet: merged bundles ------------------------------------------------


PICK = """
import json
import numpy as np
from pool.manifest import load_manifest
manifest = load_manifest({path!r})
x = np.linspace(-1, 1, 4, dtype=np.float32)
(out,) = manifest.run("p2", [x])
print(json.dumps({{"key": manifest.spec("p2").key, "out": out.tolist()}}))
"""


def test_a_merged_bundle_runs_the_entry_built_for_each_host(warmed, bundles):
    with Bundle(bundles["merged"]) as bundle:
        assert len(bundle.index.environments) == 2
        assert all(len(program.keys) == 2 for program in bundle.index.programs.values())
    here_key = load_manifest(warmed["here"]).spec("p2").key
    other_key = load_manifest(warmed["other"]).spec("p2").key
    code = PICK.format(path=str(bundles["merged"]))
    for env, key in (({"PJRT_NPROC": "3"}, other_key), ({}, here_key)):
        result = json.loads(run_python(code, env={"PJRT_POOL_CACHE_DIR": "", **env}).stdout)
        assert result["key"] == key, env
        np.testing.assert_allclose(result["out"], expected(2, X), rtol=1e-6)
    # A host whose environment matches no entry: a clear miss naming each difference.
    done = run_python(code, env={"PJRT_NPROC": "5"}, check=False)
    assert done.returncode != 0 and "NotInCacheError" in done.stderr
    assert "environment.PJRT_NPROC: built with '3', here '5'" in done.stderr
    assert "environment.PJRT_NPROC: built with None, here '5'" in done.stderr


def test_merging_refuses_two_programs_of_one_name_with_other_signatures(warmed, bundles, tmp_path):
    executable, _ = compile_program(lowered(0, size=8), cache_dir=warmed["here_cache"])
    spec = ProgramSpec.from_executable("p0", executable)  # p0, but (8,) instead of (4,)
    odd = tmp_path / "odd.bundle"
    create_bundle(odd, [(spec, DiskCache(warmed["here_cache"], create=False), "")])
    with pytest.raises(BundleError, match=r"p0.*another signature.*float32\[8\]"):
        merge_bundles(tmp_path / "out.bundle", [bundles["here"], odd])
    assert not (tmp_path / "out.bundle").exists()


# -- the preflight -----------------------------------------------------------------


def test_check_says_loads_or_would_miss_with_the_differing_part(warmed, bundles):
    good = pjrt_pool("bundle", "check", str(bundles["here"]))
    assert good.returncode == 0, good.stderr
    assert good.stdout.count(": loads") == 3 and "3 of 3 programs would load here" in good.stdout
    bad = pjrt_pool("bundle", "check", str(bundles["other"]), "--json")
    assert bad.returncode == 1, bad.stderr
    report = json.loads(bad.stdout)
    assert not report["ok"] and report["would_miss"] == 3
    for program in report["programs"]:
        assert program["status"] == "would miss"
        (elsewhere,) = program["elsewhere"]
        assert elsewhere["differences"] == ["environment.PJRT_NPROC: built with '3', here None"]
    merged = pjrt_pool("bundle", "check", str(bundles["merged"]), env={"PJRT_NPROC": "3"})
    assert merged.returncode == 0, merged.stdout + merged.stderr
    # A manifest and its cache: the same judgement, from the cache's entries.
    manifest = pjrt_pool("bundle", "check", str(warmed["other"]))
    assert manifest.returncode == 1
    assert "environment.PJRT_NPROC: built with '3', here None" in manifest.stdout
    assert pjrt_pool("bundle", "check", str(warmed["here"])).returncode == 0


# -- importing ---------------------------------------------------------------------


def test_import_publishes_every_entry_and_writes_this_hosts_manifest(bundles, tmp_path):
    cache = tmp_path / "cache"
    host_manifest = tmp_path / "host.json"
    done = pjrt_pool(
        "bundle",
        "import",
        str(bundles["merged"]),
        "--cache-dir",
        str(cache),
        "--manifest",
        str(host_manifest),
    )
    assert done.returncode == 0, done.stderr
    assert "imported 6 entries" in done.stdout and "(3 of 3 programs)" in done.stdout
    entries = sorted(p.name for p in (cache / "entries").iterdir())
    with Bundle(bundles["merged"]) as bundle:
        assert entries == sorted(f"{key}.pjx" for key in bundle.index.entries)
        for key in bundle.index.entries:  # byte for byte
            assert (cache / "entries" / f"{key}.pjx").read_bytes() == bundle.entry_bytes(key)
    again = pjrt_pool("bundle", "import", str(bundles["merged"]), "--cache-dir", str(cache))
    assert again.returncode == 0 and "6 were there already" in again.stdout
    manifest = load_manifest(host_manifest)
    with Pool(1, cache_dir=cache) as pool:
        (out,) = manifest.run("p0", [X], pool=pool)
        assert pool.statistics.compiled == 0
    np.testing.assert_allclose(out, expected(0, X), rtol=1e-6)


# -- damaged and hostile bundles: refused, nothing published ------------------------


def rebuild(source: Path, target: Path, change: Callable[[list], list]) -> Path:
    """Writes a tar of source's members after change(list of (TarInfo, bytes or None))."""
    with tarfile.open(source) as archive:
        members = [(m, archive.extractfile(m).read()) for m in archive.getmembers()]
    with tarfile.open(target, "w", format=tarfile.USTAR_FORMAT) as archive:
        for info, data in change(members):
            archive.addfile(info, None if data is None else io.BytesIO(data))
    return target


def regular(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def special(name: str, kind: bytes, link: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info, None


def entry_names(members: list) -> list[str]:
    return [info.name for info, _ in members if info.name.startswith("entries/")]


def swap_data(members: list, name: str, data: bytes) -> list:
    out = []
    for info, old in members:
        if info.name == name:
            info.size = len(data)
            old = data
        out.append((info, old))
    return out


def _other_entry(members: list) -> list:
    """The members with the first entry's data swapped for another's (of another size)."""
    first, second = entry_names(members)[:2]
    data = dict((info.name, data) for info, data in members)
    replacement = data[second] if len(data[second]) != len(data[first]) else data[second] + b"x"
    return swap_data(members, first, replacement)


def _other_program_text(members: list) -> list:
    """The members with the index naming another program text for the first entry."""
    out = []
    for info, data in members:
        if info.name == "index.json":
            index = json.loads(data)
            first = sorted(index["entries"])[0]
            index["entries"][first]["program_sha256"] = "0" * 64
            data = json.dumps(index).encode()
            info.size = len(data)
        out.append((info, data))
    return out


def _cut_short_or_long(source: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """The bundle truncated, with bytes appended, or with a byte of an entry flipped."""
    made: dict[str, tuple[Path, str]] = {}
    data = source.read_bytes()
    for label, cut, says in (
        ("truncated in a header", 100, "truncated"),
        ("truncated in an entry", 512 + 700, "truncated"),
        ("truncated before the end", len(data.rstrip(b"\0")) + 1, "truncated"),
    ):
        (tmp_path / f"{label}.bundle").write_bytes(data[:cut])
        made[label] = (tmp_path / f"{label}.bundle", says)
    # Issue 63: cut in tar's zero padding, after the end marker's first block, it passed.
    for cut in (1, 512, 2560):
        label = f"cut by {cut} bytes in its padding"
        (tmp_path / f"{label}.bundle").write_bytes(data[:-cut])
        made[label] = (tmp_path / f"{label}.bundle", "it was cut short after it was made")
    (tmp_path / "padded.bundle").write_bytes(data + bytes(512))
    made["zeros appended"] = (tmp_path / "padded.bundle", "it was added to after it was made")
    (tmp_path / "appended.bundle").write_bytes(data + b"more")
    made["appended"] = (tmp_path / "appended.bundle", "after tar's end-of-archive marker")
    flipped = bytearray(data)
    flipped[600] ^= 0xFF  # inside the first entry's data: its digest no longer matches
    (tmp_path / "flipped.bundle").write_bytes(bytes(flipped))
    made["flipped byte"] = (
        tmp_path / "flipped.bundle",
        "is damaged or was changed after the bundle was made",
    )
    return made


def tampered(source: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each kind of damage and hostility: the bundle, and what the refusal must say."""
    made: dict[str, tuple[Path, str]] = {}

    def make(label: str, change: Callable[[list], list], says: str) -> None:
        made[label] = (rebuild(source, tmp_path / f"{label}.bundle", change), says)

    key = "ab" * 32
    make("added", lambda m: [*m, regular(f"entries/{key}.pjx", b"x" * 99)], f"{key}.pjx was added")
    make(
        "removed",
        lambda m: [item for item in m if item[0].name != entry_names(m)[0]],
        "was removed",
    )

    make("swapped for another entry", _other_entry, r"has \d+ bytes where the index says \d+")

    make("index edited", _other_program_text, "does not match the key parts the index gives")
    make("traversal", lambda m: [*m, regular("../escape.pjx", b"x")], "outside the bundle")
    make("absolute", lambda m: [*m, regular("/tmp/escape.pjx", b"x")], "outside the bundle")
    make(
        "dot-dot in entries",
        lambda m: [*m, regular("entries/../../escape.pjx", b"x")],
        "outside the bundle",
    )
    make("stray file", lambda m: [*m, regular("notes.txt", b"hi")], "not part of a pjrt-pool")
    make(
        "symlink",
        lambda m: [*m, special(f"entries/{key}.pjx", tarfile.SYMTYPE, "/etc/passwd")],
        "is a symbolic link",
    )
    make(
        "hard link",
        lambda m: [*m, special(f"entries/{key}.pjx", tarfile.LNKTYPE, "index.json")],
        "is a hard link",
    )
    make(
        "device", lambda m: [*m, special(f"entries/{key}.pjx", tarfile.CHRTYPE)], "character device"
    )
    make("directory", lambda m: [special("entries", tarfile.DIRTYPE), *m], "is a directory")
    make(
        "no index", lambda m: [item for item in m if item[0].name != "index.json"], "no index.json"
    )
    make(
        "nested index",
        lambda m: (
            [item for item in m if item[0].name != "index.json"]
            + [regular("index.json", b"[" * 100_000 + b"]" * 100_000)]
        ),
        "is not JSON",
    )
    make(
        "oversized index",
        lambda m: (
            [item for item in m if item[0].name != "index.json"]
            + [regular("index.json", b"{" + b" " * (64 << 20) + b"}")]
        ),
        "more than a bundle index may be",
    )
    return made | _cut_short_or_long(source, tmp_path)


def test_damaged_and_hostile_bundles_are_refused_with_nothing_published(bundles, tmp_path):
    cache = DiskCache(tmp_path / "cache")
    escape = [tmp_path / "escape.pjx", Path("/tmp/escape.pjx"), cache.directory / "escape.pjx"]
    for label, (path, says) in tampered(bundles["here"], tmp_path).items():
        with pytest.raises(BundleError, match=says) as refused:
            import_bundle(path, cache)
        assert str(path) in str(refused.value), label
        assert list(cache.entries_dir.iterdir()) == [], label
        assert not any(p.exists() for p in escape), label
        if label not in ("flipped byte", "index edited"):  # a run reads its program's alone
            with pytest.raises(ManifestError, match=says):
                load_manifest(path)
    # A run reads only what its program needs: the edited entry is refused when its program runs.
    edited = load_manifest(tmp_path / "index edited.bundle")
    refused = []
    for name in NAMES:
        try:
            edited.run(name, [X])
        except BundleError as error:
            refused.append(name)
            assert "does not match the key parts" in str(error)
    assert len(refused) == 1
    done = pjrt_pool(
        "bundle", "import", str(tmp_path / "added.bundle"), "--cache-dir", str(cache.directory)
    )
    assert done.returncode == 1 and "was added" in done.stderr
    check = pjrt_pool("bundle", "check", str(tmp_path / "symlink.bundle"))
    assert check.returncode == 1 and "symbolic link" in check.stderr


def test_a_damaged_bundle_exits_1_from_every_command(bundles, tmp_path):
    """Issue 63: a bundle cut in its padding passed bundle check, run, bundle import and
    load_manifest; and a damaged bundle exited 1 from bundle check and import but 2 from
    run. Now each refuses it, with one status. bundle check reads every entry's digest,
    those built for elsewhere too: a byte flipped in any entry fails it."""
    data = bundles["here"].read_bytes()
    cut = tmp_path / "cut.bundle"
    cut.write_bytes(data[:-2560])
    flipped = bytearray(data)
    flipped[600] ^= 0xFF  # inside the first entry
    damaged = tmp_path / "flipped.bundle"
    damaged.write_bytes(bytes(flipped))
    with Bundle(bundles["here"]) as bundle:
        first = sorted(bundle.index.entries)[0]
        name = next(p.name for p in bundle.index.programs.values() if first in p.keys)
    for path, says in ((cut, "cut short"), (damaged, "is damaged or was changed")):
        for command in (
            ("bundle", "check", str(path)),
            ("run", str(path), name),
            ("bundle", "import", str(path), "--cache-dir", str(tmp_path / "imported")),
        ):
            done = pjrt_pool(*command)
            assert done.returncode == 1 and says in done.stderr, (command, done.stderr)
            assert "Traceback" not in done.stderr
    listed = pjrt_pool("run", str(cut))
    assert listed.returncode == 1 and "cut short" in listed.stderr


def test_run_without_a_name_lists_and_says_what_it_does_not_take(bundles):
    """Issue 63: `pjrt-pool run BUNDLE --workers 2` without NAME listed the programs and
    dropped --workers without a word. Options for running are refused there, saying so;
    --json lists as JSON."""
    for options in (["--workers", "2"], ["--inputs", "x.npz", "--prime"]):
        done = pjrt_pool("run", str(bundles["here"]), *options)
        assert done.returncode == 2 and done.stdout == "", done.stderr
        (line,) = done.stderr.splitlines()
        assert f"{', '.join(o for o in options if o.startswith('--'))} " in line
        assert "for running a program: name the program to run" in line
    listed = pjrt_pool("run", str(bundles["here"]), "--json")
    assert listed.returncode == 0, listed.stderr
    programs = json.loads(listed.stdout)
    assert [p["name"] for p in programs] == list(NAMES)
    assert all(p["input_types"] and p["output_types"] for p in programs)


def test_a_signed_bundle_whose_index_was_changed_is_refused(warmed, monkeypatch, tmp_path):
    monkeypatch.setenv("PJRT_POOL_CACHE_SECRET", SECRET)
    cache_dir = tmp_path / "signed"
    executable, _ = compile_program(lowered(1), cache_dir=cache_dir)
    signed = tmp_path / "signed.bundle"
    spec = ProgramSpec.from_executable("p1", executable)
    create_bundle(signed, [(spec, DiskCache(cache_dir, create=False), "")])

    def rename(members: list) -> list:
        out = []
        for info, data in members:
            if info.name == "index.json":
                data = data.replace(b'"p1"', b'"px"')
                info.size = len(data)
            out.append((info, data))
        return out

    changed = rebuild(signed, tmp_path / "changed.bundle", rename)
    cache = DiskCache(tmp_path / "cache")
    with pytest.raises(BundleError, match=r"index\.json was changed after signing"):
        import_bundle(changed, cache)
    unsigned = rebuild(
        signed, tmp_path / "unsigned.bundle", lambda m: [i for i in m if i[0].name != "index.mac"]
    )
    with pytest.raises(BundleError, match="is not signed"):
        import_bundle(unsigned, cache)
    assert list(cache.entries_dir.iterdir()) == []
    import_bundle(signed, cache)
    assert len(list(cache.entries_dir.iterdir())) == 1


def test_import_refuses_a_bundle_larger_than_the_cache_bound(bundles, monkeypatch, tmp_path):
    monkeypatch.setenv("PJRT_POOL_CACHE_MAX_SIZE", "8K")
    cache = DiskCache(tmp_path / "cache")
    with pytest.raises(BundleError, match="more than the cache's size bound"):
        import_bundle(bundles["here"], cache)
    assert list(cache.entries_dir.iterdir()) == []


def test_bundle_commands_report_usage_errors(warmed, bundles, tmp_path):
    missing = pjrt_pool("bundle", "create", str(tmp_path / "nope.json"), "-o", str(tmp_path / "b"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    directory = pjrt_pool("bundle", "create", str(warmed["here"]), "-o", str(tmp_path))
    assert directory.returncode == 2 and "is a directory" in directory.stderr
    assert pjrt_pool("bundle").returncode == 2
    made = pjrt_pool("bundle", "create", str(warmed["here"]), "-o", str(tmp_path / "b.bundle"))
    assert made.returncode == 0 and "3 programs" in made.stdout
    digest = hashlib.sha256((tmp_path / "b.bundle").read_bytes()).hexdigest()
    assert digest in made.stdout
    merged = pjrt_pool(
        "bundle",
        "merge",
        str(bundles["here"]),
        str(bundles["other"]),
        "-o",
        str(tmp_path / "m.bundle"),
    )
    assert merged.returncode == 0 and "6 entries built in 2 environments" in merged.stdout
    assert (tmp_path / "m.bundle").read_bytes() == bundles["merged"].read_bytes()
    cache = tmp_path / "cache"
    pooled = pjrt_pool(
        "run",
        str(bundles["merged"]),
        "p0",
        "--workers",
        "1",
        env={"PJRT_POOL_CACHE_DIR": str(cache)},
    )
    assert pooled.returncode == 0, pooled.stderr
    assert "p0: loaded from the bundle in" in pooled.stdout and "(a pool of 1)" in pooled.stdout
    assert not any((cache / "entries").iterdir())
    inputs = tmp_path / "x.npy"
    np.save(inputs, X)
    batch = pjrt_pool(
        "run", str(bundles["here"]), "p0", "--scheduler", "local:1", "--batch", str(inputs)
    )
    assert batch.returncode == 2 and "--batch runs a manifest's program" in batch.stderr


def test_a_cpu_features_difference_names_the_flags_this_host_lacks():
    """A pure function of two sets of key parts (no other CPU is at hand to build on)."""
    from worker.identity.environment import host_cpu_flags
    from worker.identity.keys import differing_parts

    here = {"host": {"machine": "x86_64", "cpu_features": "here"}, "plugin": {"sha256": "a"}}
    built = {"host": {"machine": "x86_64", "cpu_features": "there"}, "plugin": {"sha256": "b"}}
    flags = [*host_cpu_flags()[1:], "avx512_imaginary"]
    lines = differing_parts(built, here, flags)
    assert lines == [
        "plugin.sha256: built with 'b', here 'a'",
        "host.cpu_features: built with 'there', here 'here' (this host lacks avx512_imaginary; "
        f"has {host_cpu_flags()[0]}, which the builder had not)",
    ]
