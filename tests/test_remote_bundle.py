"""Bundles at a URL (worker.bundle.remote): loaded, run, checked and imported with ranged reads.

The bundle lies on moto's S3 server (reached through a FaultProxy that
counts requests and bytes), in a file:// directory, or on an HTTP server
that answers ranged GETs (RangeServer); the test process plays the
attacker who can write the bucket.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from cache_helpers import lowered
from conftest import pjrt_pool, run_python
from remote_helpers import Hang, RangeServer, closed_port
from test_bundle import rebuild, swap_data

from pool.manifest import Manifest, ManifestError, load_manifest
from worker import compile_program
from worker.bundle.index import Index
from worker.bundle.reader import Bundle
from worker.bundle.writer import create_bundle
from worker.cache import DiskCache
from worker.errors import BundleError
from worker.records import ProgramSpec

COUNT = 40
"""Programs in the bundle: about 330 KB, so the index and a few entries fill the first read."""
X = np.linspace(-1, 1, 4, dtype=np.float32)
SECRET = "a bundle signing secret of some length"


def expected(variant: int) -> np.ndarray:
    scale = np.float32(variant + 2)
    return np.sin(X) * scale + scale


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A cache with COUNT programs, its manifest, and a bundle of them."""
    root = tmp_path_factory.mktemp("remote-bundle")
    cache = root / "cache"
    specs = []
    for variant in range(COUNT):
        executable, _ = compile_program(lowered(variant), cache_dir=cache, remote=False)
        specs.append(ProgramSpec.from_executable(f"p{variant}", executable))
    Manifest(specs, str(cache), "cpu").write(root / "app.json")
    bundle = root / "app.bundle"
    create_bundle(bundle, [(spec, DiskCache(cache, create=False), "") for spec in specs])
    return {"root": root, "cache": cache, "manifest": root / "app.json", "bundle": bundle}


class Place:
    """Where a test's bundle lies: its URL, how to write it there, what was read."""

    def __init__(self, url: str, env: dict[str, str], write, counter) -> None:
        self.url, self.env, self.write, self._counter = url, env, write, counter

    def read(self) -> tuple[int, int]:
        """(GET requests, body bytes) the server answered so far."""
        return self._counter()


@pytest.fixture(params=["s3", "file", "http"])
def place(request, tmp_path, monkeypatch) -> Place:
    if request.param == "s3":
        proxy, remote = request.getfixturevalue("s3_proxy")
        for name, value in remote.env.items():
            if name.startswith("AWS"):
                monkeypatch.setenv(name, value)
        return Place(
            f"s3://{remote.bucket}/fleet/app.bundle",
            {name: value for name, value in remote.env.items() if name.startswith("AWS")},
            lambda data: remote.write("app.bundle", data),
            lambda: (proxy.seen.get("GET", 0), proxy.sent),
        )
    folder = tmp_path / "served"
    folder.mkdir()

    def write(data: bytes) -> None:
        (folder / "app.bundle").write_bytes(data)

    if request.param == "file":
        return Place(f"file://{folder}/app.bundle", {}, write, lambda: (-1, -1))
    server = RangeServer(folder)
    request.addfinalizer(server.close)
    return Place(
        f"{server.url}/app.bundle", {}, write, lambda: (server.seen.get("GET", 0), server.sent)
    )


def test_a_bundle_at_a_url_runs_by_name_reading_only_the_entry_it_uses(made, place):
    data = made["bundle"].read_bytes()
    place.write(data)
    manifest = load_manifest(place.url)
    assert manifest.names == [f"p{variant}" for variant in range(COUNT)]
    archive = manifest.bundle.archive
    opened = archive.requests, archive.bytes_read
    assert opened[0] == 1  # one read of the end: the index, and the object's size
    assert opened[1] <= 64 << 10 < len(data) // 4
    # The entry the end did not hold: its position in the archive is by key.
    first = min(manifest.names, key=lambda name: manifest.spec(name).key)
    [out] = manifest.run(first, [X])
    np.testing.assert_allclose(out, expected(int(first[1:])), rtol=1e-6)
    entry = manifest.bundle.index.entries[manifest.spec(first).key].size
    assert archive.requests == 2
    assert archive.bytes_read - opened[1] == 512 + entry
    gets, sent = place.read()
    if gets >= 0:  # what the server saw agrees
        assert gets == 2 and sent == archive.bytes_read
    assert archive.bytes_read < len(data) // 4


def test_an_index_longer_than_the_first_read_costs_one_read_more(made, place, monkeypatch):
    import worker.bundle.remote

    monkeypatch.setattr(worker.bundle.remote, "_FIRST_TAIL", 4096)
    data = made["bundle"].read_bytes()
    place.write(data)
    manifest = load_manifest(place.url)
    archive = manifest.bundle.archive
    index = len(manifest.bundle.index_bytes)
    assert 4 * 4096 < index < 16 * 4096
    assert archive.requests == 3  # the end, 4x as much, then 16x as much
    assert archive.bytes_read == 16 * 4096
    [out] = manifest.run("p11", [X])
    np.testing.assert_allclose(out, expected(11), rtol=1e-6)


def signed_bundle(made: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    """A bundle of p1 and p2 signed with SECRET, which is set from now on."""
    monkeypatch.setenv("PJRT_POOL_CACHE_SECRET", SECRET)
    cache = made["root"] / "signed-cache"
    specs = []
    for variant in (1, 2):
        executable, _ = compile_program(lowered(variant), cache_dir=cache, remote=False)
        specs.append(ProgramSpec.from_executable(f"p{variant}", executable))
    signed = made["root"] / "signed.bundle"
    create_bundle(signed, [(spec, DiskCache(cache, create=False), "") for spec in specs])
    return signed


def test_a_signed_bundle_at_a_url_is_checked_against_the_secret(made, place, monkeypatch):
    signed = signed_bundle(made, monkeypatch)
    place.write(signed.read_bytes())
    manifest = load_manifest(place.url)
    assert "index.mac" in {member.name for member in manifest.bundle.archive.members}
    [out] = manifest.run("p2", [X])
    np.testing.assert_allclose(out, expected(2), rtol=1e-6)
    monkeypatch.setenv("PJRT_POOL_CACHE_SECRET", SECRET + " but another")
    with pytest.raises(ManifestError, match="signature does not match"):
        load_manifest(place.url)
    place.write(made["bundle"].read_bytes())  # unsigned
    with pytest.raises(ManifestError, match="is not signed"):
        load_manifest(place.url)


def test_a_signed_index_at_a_url_is_refused_by_its_mac_before_it_is_parsed(
    made, place, monkeypatch, tmp_path
):
    """An index swapped for 1 MB of nested brackets: the MAC refuses it, the parser never sees
    it (as for a file), though the URL's layout is computed from the index."""
    signed = signed_bundle(made, monkeypatch)
    nested = b"[" * (1 << 19) + b"]" * (1 << 19)
    hostile = rebuild(
        signed, tmp_path / "nested.bundle", lambda m: swap_data(m, "index.json", nested)
    )
    place.write(hostile.read_bytes())

    def parsed(cls, data, where):
        raise AssertionError(f"{where}: index.json was parsed before its MAC was checked")

    monkeypatch.setattr(Index, "decode", classmethod(parsed))
    for path in (place.url, hostile):
        with pytest.raises(BundleError, match=r"index\.json was changed after signing"):
            Bundle(path)


def test_a_tampered_entry_at_a_url_is_refused_and_the_others_still_run(made, place):
    data = bytearray(made["bundle"].read_bytes())
    with Bundle(made["bundle"]) as local:
        key = local.index.programs["p3"].keys[0]
        member = local._entries[key]
    data[member.offset + member.size - 100] ^= 0x01  # in its payload
    place.write(bytes(data))
    manifest = load_manifest(place.url)
    with pytest.raises(BundleError, match=r"damaged or was changed|digest|cannot be used"):
        manifest.run("p3", [X])
    [out] = manifest.run("p5", [X])
    np.testing.assert_allclose(out, expected(5), rtol=1e-6)


def test_a_damaged_header_or_a_moved_member_is_refused(made, place):
    data = bytearray(made["bundle"].read_bytes())
    with Bundle(made["bundle"]) as local:
        key = local.index.programs["p4"].keys[0]
        member = local._entries[key]
    header = member.offset - 512
    damaged = bytearray(data)
    damaged[header + 10] ^= 0x01  # its name: the header's checksum fails
    place.write(bytes(damaged))
    with pytest.raises(BundleError, match="checksum"):
        load_manifest(place.url).run("p4", [X])
    # A block more in front of the end: every later member moves.
    grown = data[:header] + bytes(512) + data[header:]
    place.write(bytes(grown[: len(data)]))
    with pytest.raises(ManifestError, match=r"index lists put it|after its last member"):
        load_manifest(place.url)


def test_a_bundle_replaced_while_it_is_used_is_never_mixed_with_the_old(made, place):
    data = made["bundle"].read_bytes()
    place.write(data)
    manifest = load_manifest(place.url)
    time.sleep(0.01)  # another modification time, for the file's tag
    place.write(data[:-1] + b"\x01")  # another version (its entries alike)
    with pytest.raises(BundleError, match="changed while it was read"):
        manifest.run(min(manifest.names, key=lambda name: manifest.spec(name).key), [X])


def test_check_refuses_a_bundle_with_any_damaged_header_as_a_file_check_does(made, place):
    data = bytearray(made["bundle"].read_bytes())
    with Bundle(made["bundle"]) as local:
        member = local._entries[local.index.programs["p12"].keys[0]]
    data[member.offset - 512 + 20] ^= 0x01
    place.write(bytes(data))
    with Bundle(place.url) as bundle:
        bundle.entry(bundle.index.programs["p13"].keys[0])  # the others are used
        before = bundle.archive.requests
        with pytest.raises(BundleError, match="checksum"):
            bundle.archive.check_headers()
        assert bundle.archive.requests - before == 1  # 40 headers: one batch
    checked = pjrt_pool("bundle", "check", place.url, env=place.env)
    assert checked.returncode == 1 and "fails its checksum" in checked.stderr


def test_truncated_and_oversized_objects_are_refused_before_any_entry_is_read(made, place):
    data = made["bundle"].read_bytes()
    place.write(data[: len(data) - 20000])
    with pytest.raises(ManifestError, match=r"truncated|no member header|end with its index"):
        load_manifest(place.url)
    place.write(data + b"appended" * 10000)
    with pytest.raises(ManifestError, match=r"after its last member|not a pjrt-pool"):
        load_manifest(place.url)
    place.write(b"\x00" * 4096)
    with pytest.raises(ManifestError, match="no member header"):
        load_manifest(place.url)


def test_an_entry_over_the_bound_is_refused_before_its_payload_is_read(made, place, monkeypatch):
    place.write(made["bundle"].read_bytes())
    monkeypatch.setenv("PJRT_POOL_CACHE_MAX_SIZE", "1K")
    manifest = load_manifest(place.url)
    before = manifest.bundle.archive.bytes_read
    with pytest.raises(BundleError, match="cannot be used"):
        manifest.run("p0", [X])
    entry = manifest.bundle.index.entries[manifest.spec("p0").key].size
    read = manifest.bundle.archive.bytes_read - before
    assert read == 0 or read == 512 + entry  # in the end read at open, or one ranged read


def test_a_missing_bundle_and_a_bad_url_say_what_is_wrong(place):
    with pytest.raises(ManifestError, match="does not exist"):
        load_manifest(place.url.replace("app.bundle", "other.bundle"))
    with pytest.raises(ManifestError, match="names a folder"):
        load_manifest(place.url.replace("app.bundle", ""))
    with pytest.raises(ManifestError, match="scheme 'ftp'"):
        load_manifest("ftp://host/app.bundle")


@pytest.mark.slow
def test_a_dead_or_hanging_server_fails_within_the_deadline_naming_the_url(monkeypatch):
    monkeypatch.setenv("PJRT_POOL_CACHE_REMOTE_DEADLINE", "2")
    monkeypatch.setenv("PJRT_POOL_CACHE_REMOTE_TIMEOUT", "1")
    hang = Hang()
    hang.start()
    for port in (closed_port(), hang.port):
        for url in (
            f"http://127.0.0.1:{port}/b/app.bundle",
            f"http://user:hunter2@127.0.0.1:{port}/b/app.bundle",
        ):
            started = time.monotonic()
            with pytest.raises(ManifestError) as caught:
                load_manifest(url)
            assert time.monotonic() - started < 6
            assert f"http://127.0.0.1:{port}/b/app.bundle" in str(caught.value)
            assert "hunter2" not in str(caught.value)
    url = f"http://user:hunter2@127.0.0.1:{closed_port()}/b/app.bundle"
    checked = pjrt_pool("bundle", "check", url, "--json")
    assert checked.returncode == 1 and "/b/app.bundle" in checked.stderr
    assert "hunter2" not in checked.stdout + checked.stderr
    presigned = "https://host/app.bundle?X-Amz-Credential=me&X-Amz-Signature=s3cr3t"
    with pytest.raises(ManifestError, match="presigned") as caught:
        load_manifest(presigned)
    assert "s3cr3t" not in str(caught.value)


@pytest.mark.slow
def test_check_import_and_run_take_a_url(made, place, tmp_path):
    place.write(made["bundle"].read_bytes())
    checked = pjrt_pool("bundle", "check", place.url, "--json", env=place.env)
    assert checked.returncode == 0, checked.stderr
    report = json.loads(checked.stdout)
    assert report["loads"] == COUNT
    cache = tmp_path / "imported"
    host = tmp_path / "host.json"
    imported = pjrt_pool(
        "bundle", "import", place.url, "--cache-dir", str(cache), "--manifest", str(host),
        env=place.env,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    assert f"imported {COUNT} entries" in imported.stdout
    loaded = load_manifest(host)
    [out] = loaded.run("p9", [X])
    np.testing.assert_allclose(out, expected(9), rtol=1e-6)
    merged = tmp_path / "merged.bundle"
    merging = pjrt_pool("bundle", "merge", place.url, "-o", str(merged), env=place.env)
    assert merging.returncode == 0, merging.stderr
    assert merged.read_bytes() == made["bundle"].read_bytes()  # deterministic, and whole
    ran = pjrt_pool("run", place.url, "p2", "--json", env=place.env)
    assert ran.returncode == 0, ran.stderr
    local = pjrt_pool("run", str(made["bundle"]), "p2", "--json")
    assert json.loads(ran.stdout)["outputs"] == json.loads(local.stdout)["outputs"]


def test_import_from_a_url_refuses_a_tampered_bundle_and_writes_nothing(made, place, tmp_path):
    data = bytearray(made["bundle"].read_bytes())
    with Bundle(made["bundle"]) as local:
        member = local._entries[local.index.programs["p30"].keys[0]]
    data[member.offset + member.size // 2] ^= 0x40
    place.write(bytes(data))
    cache = tmp_path / "imported"
    imported = pjrt_pool("bundle", "import", place.url, "--cache-dir", str(cache), env=place.env)
    assert imported.returncode == 1
    assert "damaged or was changed" in imported.stderr or "cannot be used" in imported.stderr
    assert not cache.exists()


def test_create_reads_the_entries_the_cache_lacks_from_the_remote(
    made, remote, tmp_path, monkeypatch
):
    for name, value in remote.env.items():
        if name.startswith("AWS"):
            monkeypatch.setenv(name, value)
    # Host A warms into its cache and the remote; this host's cache is empty.
    warm_cache = tmp_path / "a"
    names = ("p1", "p2")
    specs = []
    for name in names:
        program = lowered(int(name[1:]))
        executable, _ = compile_program(program, cache_dir=warm_cache, remote=remote.url)
        specs.append(ProgramSpec.from_executable(name, executable))
    assert any(name.startswith("records/") for name in remote.names())
    manifest = tmp_path / "here.json"
    empty = tmp_path / "empty"
    Manifest(specs, str(empty), "cpu").write(manifest)
    output = tmp_path / "out.bundle"
    env = {**remote.env, "PJRT_POOL_CACHE_REMOTE": ""}
    without = pjrt_pool("bundle", "create", str(manifest), "-o", str(output), env=env)
    assert without.returncode == 2 and "does not exist" in without.stderr
    made_it = pjrt_pool(
        "bundle", "create", str(manifest), "-o", str(output), "--remote", remote.url, env=env
    )
    assert made_it.returncode == 0, made_it.stderr
    assert not empty.exists()  # create reads; it writes no cache
    loaded = load_manifest(output)
    for name in names:
        [out] = loaded.run(name, [X])
        np.testing.assert_allclose(out, expected(int(name[1:])), rtol=1e-6)
    # A remote entry that fails its checks is refused, never bundled.
    blob = next(name for name in remote.names() if name.startswith("blobs/"))
    damaged = bytearray(remote.read(blob))
    damaged[-10] ^= 0x01
    remote.write(blob, bytes(damaged))
    refused = pjrt_pool(
        "bundle", "create", str(manifest), "-o", str(tmp_path / "bad.bundle"),
        "--remote", remote.url, env=env,
    )  # fmt: skip
    assert refused.returncode == 1 and "nor in the remote" in refused.stderr
    assert not (tmp_path / "bad.bundle").exists()


def test_a_bundle_file_is_opened_without_importing_the_remote_tier(made):
    code = f"""
        import json, sys
        import numpy as np
        from pool.manifest import load_manifest
        manifest = load_manifest({str(made["bundle"])!r})
        manifest.run("p1", [np.ones(4, np.float32)])
        print(json.dumps(sorted(m for m in sys.modules if "remote" in m or m == "obstore")))
    """
    assert json.loads(run_python(code).stdout) == []


def test_throttling_is_retried_and_a_refusal_is_a_clear_error(made, s3_proxy, monkeypatch):
    proxy, remote = s3_proxy
    for name, value in remote.env.items():
        if name.startswith("AWS"):
            monkeypatch.setenv(name, value)
    remote.write("app.bundle", made["bundle"].read_bytes())
    url = f"s3://{remote.bucket}/fleet/app.bundle"
    proxy.faults = [("GET", 503), ("GET", 429)]
    manifest = load_manifest(url)
    [out] = manifest.run("p6", [X])
    np.testing.assert_allclose(out, expected(6), rtol=1e-6)
    assert proxy.answered == [("GET", 503), ("GET", 429)]
    proxy.always["GET"] = 403
    started = time.monotonic()
    with pytest.raises(BundleError, match=f"bundle {url}: reading .* failed: .*403") as caught:
        manifest.run("p8", [X])
    assert time.monotonic() - started < 10 and "testing" not in str(caught.value)
    with pytest.raises(ManifestError, match=f"bundle {url}: cannot reach it"):
        load_manifest(url)
