"""Fleet operations on the remote tier: cache push / pull / gc, prefetch, warm --remote.

Every "host" is a child process with its own local cache directory; the
remote is moto's S3 server on the loopback or a file:// directory (the
`remote` fixture, conftest.py), for the same tests. The commands run as the
console script does, in child processes, with the environment that reaches
the remote.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cache_helpers import finish, lowered, save_program, start
from conftest import CLI_COMMAND, pjrt_pool, repo_environment
from remote_helpers import Hang, Remote, record_fields

from pool.manifest import Manifest
from worker.records import ProgramSpec

X = [0.5, 1.0, 1.5, 2.0]
NO_REMOTE = {"PJRT_POOL_CACHE_REMOTE": ""}

HOST = r"""
import json, sys
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["tests"])
from cache_helpers import load_program
import worker
from worker.cache import open_cache
from worker.cache.remote import remote_counters
from worker.records import ProgramSpec

stats, outputs, specs = [], [], []
for index, path in enumerate(spec["programs"]):
    executable, statistics = worker.compile_program(load_program(path), cache_dir=spec["cache_dir"])
    stats.append(statistics._asdict())
    outputs.append([o.tolist() for o in executable.run([spec["x"]])])
    specs.append(ProgramSpec.from_executable(f"p{index}", executable).to_json())
print(json.dumps({
    "stats": stats,
    "outputs": outputs,
    "specs": specs,
    "counters": open_cache(spec["cache_dir"]).counters._asdict(),
    "remote": remote_counters()._asdict(),
}))
"""


def expected(variant: int) -> list[float]:
    scale = variant + 2.0
    return (np.sin(np.array(X, np.float32)) * scale + scale).tolist()


def programs(tmp_path: Path, *variants: int) -> list[str]:
    return [str(save_program(lowered(v), tmp_path / f"p{v}.json")) for v in variants]


def host(tmp_path: Path, name: str, paths: list[str], env: dict[str, str]) -> dict:
    """Runs one host: a child that compiles (or loads, or fetches) programs into cache-<name>."""
    spec = {"programs": paths, "cache_dir": str(tmp_path / f"cache-{name}"), "x": X}
    return finish(start(spec, env, code=HOST), 180)


def pjrt_pool_json(*args: str, env: dict[str, str], timeout: float = 300) -> tuple[int, dict, str]:
    """Runs the command line in a child (conftest.pjrt_pool); returns its exit status, its
    JSON report and stderr."""
    done = pjrt_pool(*args, env=env, timeout=timeout)
    try:
        report = json.loads(done.stdout) if done.stdout.strip() else {}
    except ValueError:
        raise AssertionError(f"not JSON:\n{done.stdout}\n{done.stderr}") from None
    return done.returncode, report, done.stderr


def entries(cache: Path) -> set[str]:
    return {p.stem for p in (cache / "entries").glob("*.pjx")}


def close(a: list[float], b: list[float]) -> bool:
    return np.allclose(np.array(a), np.array(b), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_push_from_host_a_then_pull_into_host_b_which_compiles_nothing(tmp_path, remote):
    paths = programs(tmp_path, 0, 1)
    a = host(tmp_path, "a", paths, NO_REMOTE)  # host A compiles, with no remote at all
    assert [s["compiled"] for s in a["stats"]] == [1, 1]
    assert remote.names() == []
    cache_a, cache_b = tmp_path / "cache-a", tmp_path / "cache-b"
    keys = entries(cache_a)

    push = ["cache", "push", "--remote", remote.url, "--cache-dir", str(cache_a), "--json"]
    code, report, err = pjrt_pool_json(*push, env=remote.env)
    assert code == 0, err
    assert report["counts"] == {"written": 2} and set(report["keys"]) == keys
    assert len([n for n in remote.names() if n.startswith("blobs/")]) == 2
    code, report, err = pjrt_pool_json(*push, env=remote.env)  # create-only: nothing written again
    assert code == 0 and report["counts"] == {"already there": 2}, err

    pull = ["cache", "pull", "--remote", remote.url, "--cache-dir", str(cache_b), "--json"]
    code, report, err = pjrt_pool_json(*pull, env=remote.env)  # every key the remote lists
    assert code == 0, err
    assert report["counts"] == {"fetched": 2} and entries(cache_b) == keys
    code, report, err = pjrt_pool_json(*pull, env=remote.env)
    assert code == 0 and report["counts"] == {"already local": 2}, err

    b = host(tmp_path, "b", paths, NO_REMOTE)  # host B, with no remote: all local now
    assert [s["compiled"] for s in b["stats"]] == [0, 0]
    assert [s["loaded"] for s in b["stats"]] == [1, 1]
    assert b["outputs"] == a["outputs"] and close(b["outputs"][1][0], expected(1))


@pytest.mark.slow
def test_pull_of_a_manifest_with_a_tampered_object_refuses_it_and_fetches_the_others(
    tmp_path, remote: Remote
):
    paths = programs(tmp_path, 2, 3, 4)
    a = host(tmp_path, "a", paths, remote.env)  # host A compiles and publishes
    assert a["remote"]["published"] == 3
    specs = [ProgramSpec.from_json(s) for s in a["specs"]]
    manifest = tmp_path / "m.json"
    Manifest(specs, None, "cpu").write(manifest)
    tampered = specs[1].key
    record = record_fields(remote.read(f"records/{tampered}/unsigned.json"))
    blob = f"blobs/{record['sha256']}.pjx"
    data = remote.read(blob)
    remote.write(blob, data[:-9] + bytes([data[-9] ^ 0x40]) + data[-8:])

    cache_b = tmp_path / "cache-b"
    pull = ["cache", "pull", "--manifest", str(manifest), "--cache-dir", str(cache_b), "--json"]
    code, report, err = pjrt_pool_json(*pull, env=remote.env)  # --remote from the environment
    assert code == 1, err
    assert report["counts"] == {"fetched": 2, "refused": 1}
    assert report["keys"][tampered] == "refused"
    assert entries(cache_b) == {specs[0].key, specs[2].key}
    assert "refused the entry" in err

    # Host B loads the two it fetched, compiles the refused one, and gets the right numbers.
    b = host(tmp_path, "b", paths, remote.env)
    assert [s["compiled"] for s in b["stats"]] == [0, 1, 0]
    assert b["remote"]["hits"] == 0 and b["remote"]["refused"] == 1
    for outputs, variant in zip(b["outputs"], (2, 3, 4), strict=True):
        assert close(outputs[0], expected(variant))


PREFETCH = r"""
import json, sys
from pool.manifest import load_manifest
from worker.cache.remote import open_remote
manifest = load_manifest(sys.argv[1], sys.argv[2])
report = manifest.prefetch(concurrency=int(sys.argv[3]))
print(json.dumps({**report.to_json(), "remote": open_remote().counters._asdict()}))
"""


def prefetch_in_child(manifest: Path, cache: Path, concurrency: int, env: dict) -> dict:
    """Manifest.prefetch in a fresh process; returns its report and the remote's counters."""
    command = [sys.executable, "-c", PREFETCH, str(manifest), str(cache), str(concurrency)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=repo_environment(env), check=True
    )
    return json.loads(done.stdout)


@pytest.mark.slow
def test_manifest_prefetch_fetches_concurrently_and_a_dead_remote_costs_one_deadline(
    tmp_path, remote: Remote
):
    paths = programs(tmp_path, 5, 6)
    a = host(tmp_path, "a", paths, remote.env)
    specs = [ProgramSpec.from_json(s) for s in a["specs"]]
    manifest = tmp_path / "m.json"
    Manifest(specs, None, "cpu").write(manifest)
    report = prefetch_in_child(manifest, tmp_path / "cache-b", 4, remote.env)
    assert report["counts"] == {"fetched": 2} and report["remote"]["hits"] == 2

    # A remote that accepts connections and never answers: every key fails, in one deadline
    # (six keys one at a time would take six).
    many = [specs[0]._replace(name=f"q{i}", key=f"{i:064x}") for i in range(6)]
    Manifest(many, None, "cpu").write(manifest)
    hang = Hang()
    hang.start()
    dead = {
        "PJRT_POOL_CACHE_REMOTE": f"http://127.0.0.1:{hang.port}/cache",
        "PJRT_POOL_CACHE_REMOTE_DEADLINE": "2",
    }
    began = time.monotonic()
    report = prefetch_in_child(manifest, tmp_path / "cache-c", 1, dead)
    took = time.monotonic() - began
    assert report["counts"] == {"failed": 6}, report
    assert report["remote"]["errors"] == 1
    assert took < 2 * 4, took  # one deadline and an interpreter's start, not six deadlines


@pytest.mark.slow
def test_gc_deletes_old_records_then_unreferenced_blobs_and_keeps_referenced_ones(
    tmp_path, remote: Remote
):
    paths = programs(tmp_path, 7, 8)
    host(tmp_path, "a", paths[:1], remote.env)  # the old entry
    (old_record,) = [n for n in remote.names() if n.startswith("records/")]
    time.sleep(3)
    between = time.time()
    time.sleep(3)
    host(tmp_path, "a2", paths[1:], remote.env)  # the young one
    names = remote.names()
    (young_record,) = [n for n in names if n.startswith("records/") and n != old_record]
    old_blob = f"blobs/{record_fields(remote.read(old_record))['sha256']}.pjx"
    young_blob = f"blobs/{record_fields(remote.read(young_record))['sha256']}.pjx"
    assert {old_blob, young_blob} <= set(names)

    def gc(*extra: str) -> dict:
        older = f"{time.time() - between:.1f}s"
        command = ["cache", "gc", "--remote", remote.url, "--older-than", older, "--json"]
        code, report, err = pjrt_pool_json(*command, *extra, env=remote.env)
        assert code == 0, err
        return report

    report = gc("--grace", "0", "--dry-run")
    assert report["old_records"] == [old_record] and report["deleted_blobs"] == [old_blob]
    assert remote.names() == names  # a dry run deletes nothing

    report = gc()  # the default grace keeps a young unreferenced blob (a publish in flight)
    assert report["old_records"] == [old_record] and report["deleted_blobs"] == []
    assert old_record not in remote.names() and old_blob in remote.names()

    # Program index names (programs/<program>/<key>: hints for refusals) go with their key.
    old_key, young_key = old_record.split("/")[1], young_record.split("/")[1]
    stale, live = f"programs/{'a' * 64}/{old_key}", f"programs/{'a' * 64}/{young_key}"
    remote.write(stale, b"")
    remote.write(live, b"")
    report = gc("--grace", "0")
    assert report["old_records"] == [] and report["deleted_blobs"] == [old_blob]
    deleted = report["deleted_index_names"]  # with the ones publish wrote, where it writes them
    assert stale in deleted and {name.rsplit("/", 1)[1] for name in deleted} == {old_key}
    assert live in remote.names() and stale not in remote.names()
    assert report["kept_records"] == 1 and report["kept_blobs"] == 1
    left = set(remote.names())
    assert young_record in left and young_blob in left and old_blob not in left

    # The young entry is still served; the collected one is compiled again.
    b = host(tmp_path, "b", paths, remote.env)
    assert [s["compiled"] for s in b["stats"]] == [1, 0]
    assert b["remote"]["hits"] == 1 and b["remote"]["refused"] == 0
    assert close(b["outputs"][0][0], expected(7)) and close(b["outputs"][1][0], expected(8))

    # Host B published the collected entry again: a size bound that holds only that newest
    # entry deletes the older record, then its blob.
    (new_record,) = [n for n in remote.names() if n.startswith("records/") and n != young_record]
    new_blob = f"blobs/{record_fields(remote.read(new_record))['sha256']}.pjx"
    bound = str(len(remote.read(new_blob)))
    command = ["cache", "gc", "--remote", remote.url, "--max-size", bound, "--grace", "0"]
    code, report, err = pjrt_pool_json(*command, "--json", env=remote.env)
    assert code == 0, err
    assert report["old_records"] == [young_record] and report["deleted_blobs"] == [young_blob]
    kinds = ("records/", "blobs/")
    assert {n for n in remote.names() if n.startswith(kinds)} == {new_record, new_blob}


def test_gc_deletes_leases_that_expired_and_keeps_standing_ones(tmp_path, remote):
    from worker.cache.remote.lease import Lease, lease_name

    dead, released, live, garbage = (f"{i:064x}" for i in range(1, 5))
    for key, expires in ((dead, -3600), (released, -1), (live, 600)):
        remote.write(lease_name(key), Lease(key, "host:1:0", time.time() + expires).encode())
    remote.write(lease_name(garbage), b"{not a lease")
    command = ["cache", "gc", "--remote", remote.url, "--older-than", "30d", "--json"]
    code, report, err = pjrt_pool_json(*command, "--grace", "0", "--dry-run", env=remote.env)
    assert code == 0, err
    ended = sorted(lease_name(key) for key in (dead, released, garbage))
    assert report["deleted_leases"] == ended
    assert len([n for n in remote.names() if n.startswith("leases/")]) == 4
    code, report, err = pjrt_pool_json(*command, env=remote.env)  # the default grace: all young
    assert code == 0 and report["deleted_leases"] == [], err
    code, report, err = pjrt_pool_json(*command, "--grace", "0", env=remote.env)
    assert code == 0 and report["deleted_leases"] == ended, err
    assert [n for n in remote.names() if n.startswith("leases/")] == [lease_name(live)]


SPEC = """
import os

import jax
import jax.numpy as jnp

TRACED = os.environ.get("FLEET_TRACED")


def _scaled(factor):
    def program(x):
        if TRACED:  # lowering traces this: the test learns that warming got this far
            open(TRACED, "a").close()
        return jnp.sin(x) * factor + jnp.cos(x)

    return program


def programs():
    first, count = int(os.environ["FLEET_FIRST"]), int(os.environ["FLEET_COUNT"])
    shape = [jax.ShapeDtypeStruct((8,), jnp.float32)]
    return [(f"p{i}", _scaled(float(i)), shape) for i in range(first, first + count)]
"""


def warm(tmp_path: Path, name: str, env: dict[str, str], *extra: str) -> tuple[int, dict, str]:
    spec = tmp_path / "fleet_spec.py"
    spec.write_text(SPEC)
    cache = str(tmp_path / f"cache-{name}")
    command = ["warm", str(spec), "--cache-dir", cache, "--workers", "1", "--json", *extra]
    return pjrt_pool_json(*command, env=env)


@pytest.mark.slow
def test_warm_remote_from_two_caches_compiles_once_and_reports_the_remote(tmp_path, remote):
    env = {**remote.env, "PJRT_POOL_CACHE_REMOTE": "", "FLEET_FIRST": "0", "FLEET_COUNT": "3"}
    code, a, err = warm(tmp_path, "a", env, "--remote", remote.url)
    assert code == 0, err
    assert a["counts"] == {"compiled": 3}
    assert a["remote"]["published"] == 3 and a["remote"]["prefetched"] == {"missing": 3}

    code, b, err = warm(tmp_path, "b", env, "--remote", remote.url)
    assert code == 0, err
    assert b["counts"] == {"loaded": 3} and b["statistics"]["compiled"] == 0
    assert b["remote"]["prefetched"] == {"fetched": 3} and b["remote"]["hits"] == 3
    assert b["remote"]["published"] == 0
    assert entries(tmp_path / "cache-b") == entries(tmp_path / "cache-a")

    code, again, err = warm(tmp_path, "b", env, "--remote", remote.url)  # all local now
    assert code == 0 and again["remote"]["prefetched"] == {"already local": 3}, err
    assert again["remote"]["hits"] == 0


@pytest.mark.slow
def test_warm_remote_waits_for_another_hosts_lease_and_reports_the_compile_saved(tmp_path, remote):
    from worker.cache.remote.lease import Lease, lease_name

    env = {**remote.env, "PJRT_POOL_CACHE_REMOTE": "", "FLEET_FIRST": "9", "FLEET_COUNT": "1"}
    code, d, err = warm(tmp_path, "d", env)  # host D compiles locally, with no remote
    assert code == 0, err
    key = d["programs"][0]["key"]
    # Host D holds the key's lease, as a host compiling it would.
    remote.write(lease_name(key), Lease(key, "host-d:1:x", time.time() + 90).encode())
    traced = tmp_path / "traced"
    env_c = {**env, "FLEET_TRACED": str(traced)}
    spec = tmp_path / "fleet_spec.py"
    command = [*CLI_COMMAND, "warm", str(spec), "--cache-dir", str(tmp_path / "cache-c")]
    command += ["--workers", "1", "--json", "--remote", remote.url]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    host_c = subprocess.Popen(command, text=True, env=repo_environment(env_c), **pipes)
    try:
        deadline = time.monotonic() + 120
        while not traced.exists() and host_c.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(3)  # host C has prefetched (a miss) and its worker waits on the lease
        push = [
            "cache",
            "push",
            "--remote",
            remote.url,
            "--cache-dir",
            str(tmp_path / "cache-d"),
            "--json",
        ]
        code, _, err = pjrt_pool_json(*push, env=remote.env)
        assert code == 0, err
        out, err = host_c.communicate(timeout=150)
    finally:
        host_c.kill()
    assert host_c.returncode == 0, err
    c = json.loads(out)
    assert c["counts"] == {"loaded": 1} and c["statistics"]["compiled"] == 0
    assert c["remote"]["waited"] == 1 and c["remote"]["hits"] == 1
    assert c["remote"]["prefetched"] == {"missing": 1}


def test_bad_arguments_say_what_was_wrong(tmp_path, monkeypatch, capsys):
    from pool.cli.main import main

    monkeypatch.delenv("PJRT_POOL_CACHE_REMOTE", raising=False)
    cache = ["--cache-dir", str(tmp_path / "cache")]

    def run(*argv: str) -> tuple[int, str]:
        code = main(list(argv))
        return code, capsys.readouterr().err

    code, err = run("cache", "pull", *cache)
    assert code == 2 and "--remote URL" in err
    code, err = run("cache", "gc", "--remote", f"file://{tmp_path}/r", "--older-than", "soon")
    assert code == 2 and "not a duration" in err
    code, err = run("cache", "gc", "--remote", f"file://{tmp_path}/r")
    assert code == 2 and "--older-than DURATION, --max-size SIZE" in err
    code, err = run("cache", "pull", "--remote", f"file://{tmp_path}/r", "--concurrency", "0")
    assert code == 2 and "above 0" in err
    code, err = run("cache", "push", "--remote", "http://127.0.0.1:9/cache", *cache)
    assert code == 1 and "cannot write" in err
    code, err = run("cache", "pull", "--remote", "ftp://host/x", *cache)
    assert code == 2 and "scheme" in err
    assert not (tmp_path / "r").exists()  # nothing was made for a refused command
