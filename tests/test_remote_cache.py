"""The remote cache tier (worker.cache.remote), end to end in real processes.

Every "host" is a child process (no JAX) with its own local cache directory
and the same remote: moto's S3 server (ThreadedMotoServer, started here on
127.0.0.1 at a random port) or a file:// directory, for the same tests.
The test process plays the attacker who can write the bucket.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from cache_helpers import CHILD_START, finish, lowered, save_program, start
from remote_helpers import (
    RESET,
    S3_ENV,
    SHORT,
    Hang,
    Remote,
    closed_port,
    record_bytes,
    record_fields,
)

from worker.cache.remote import parse_remote
from worker.cache.remote.layout import BadRecordError, Record, decode_record, record_name
from worker.cache.remote.location import redact, redact_text
from worker.identity.keys import key_of

X = [0.5, 1.0, 1.5, 2.0]

HOST = (
    CHILD_START
    + r"""
import worker
from worker.cache import CacheUnavailableWarning, open_cache
from worker.cache.remote import remote_counters
from worker.phases import process_phases

programs = [load_program(p) for p in spec["programs"]]
worker.get_runtime("cpu")  # loaded (and hashed) before the barrier: hosts then miss together
if spec.get("ready"):
    open(spec["ready"], "w").close()
    while spec["barrier"] and not os.path.exists(spec["barrier"]):
        time.sleep(0.002)
start = time.perf_counter()
stats, outputs = [], []
for program in programs:
    executable, statistics = worker.compile_program(program, cache_dir=spec["cache_dir"])
    stats.append(statistics._asdict())
    outputs.append([o.tolist() for o in executable.run([spec["x"]])])
print(json.dumps({
    "stats": stats,
    "outputs": outputs,
    "seconds": time.perf_counter() - start,
    "remote_seconds": process_phases().get("remote", 0.0),
    "counters": open_cache(spec["cache_dir"]).counters._asdict(),
    "remote": remote_counters()._asdict(),
    "client_imported": "obstore" in sys.modules,
    "crypto_imported": "cryptography" in sys.modules,
    "warnings": [str(w.message) for w in seen if issubclass(w.category, CacheUnavailableWarning)],
}))
"""
)


def expected(variant: int) -> list[float]:
    scale = variant + 2.0
    return (np.sin(np.array(X, np.float32)) * scale + scale).tolist()


def close(a: list[float], b: list[float]) -> bool:
    return np.allclose(np.array(a), np.array(b), rtol=1e-6, atol=1e-6)


def host_spec(tmp_path: Path, name: str, programs: list[str]) -> dict:
    return {"programs": programs, "cache_dir": str(tmp_path / f"cache-{name}"), "x": X}


def host(
    tmp_path: Path, name: str, programs: list[str], env: dict[str, str], timeout: float = 120
) -> dict:
    """Runs one host: a child with its own local cache that compiles (or fetches) programs."""
    return finish(start(host_spec(tmp_path, name, programs), env, code=HOST), timeout)


def programs(tmp_path: Path, *variants: int) -> list[str]:
    return [str(save_program(lowered(v), tmp_path / f"p{v}.json")) for v in variants]


@pytest.mark.slow
def test_host_b_fetches_what_host_a_compiled(tmp_path, remote):
    (p,) = programs(tmp_path, 0)
    a = host(tmp_path, "a", [p], remote.env)
    assert a["stats"][0]["compiled"] == 1
    assert a["remote"]["published"] == 1 and a["remote"]["misses"] == 1
    names = remote.names()
    assert len([n for n in names if n.startswith("blobs/")]) == 1
    assert len([n for n in names if n.startswith("records/")]) == 1

    b = host(tmp_path, "b", [p], remote.env)
    assert b["stats"][0]["compiled"] == 0 and b["stats"][0]["loaded"] == 1
    assert b["remote"]["hits"] == 1 and b["remote"]["published"] == 0
    assert close(b["outputs"][0][0], expected(0)) and b["outputs"] == a["outputs"]
    assert (tmp_path / "cache-b" / "entries").glob("*.pjx")  # published locally

    # The second load on host B is local: the remote is never asked, its client never imported.
    again = host(tmp_path, "b", [p], remote.env)
    assert again["stats"][0]["loaded"] == 1 and again["counters"]["hits"] == 1
    assert again["remote"] == dict.fromkeys(again["remote"], 0)
    assert again["client_imported"] is False and again["crypto_imported"] is False


def _published(tmp_path: Path, remote: Remote, program: str) -> tuple[str, str, bytes]:
    """Publishes a program from host A; returns its record's and blob's names and the blob."""
    host(tmp_path, "a", [program], remote.env)
    (record,) = [n for n in remote.names() if n.startswith("records/")]
    (blob,) = [n for n in remote.names() if n.startswith("blobs/")]
    return record, blob, remote.read(blob)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped", "truncated", "oversized", "foreign_record"])
def test_a_damaged_remote_object_is_refused_and_recompiled(tmp_path, remote, damage):
    (p,) = programs(tmp_path, 1)
    record_path, blob_path, blob = _published(tmp_path, remote, p)
    if damage == "flipped":
        remote.write(blob_path, blob[:-5] + bytes([blob[-5] ^ 1]) + blob[-4:])
    elif damage == "truncated":
        remote.write(blob_path, blob[: len(blob) // 2])
    elif damage == "oversized":
        remote.write(blob_path, blob + os.urandom(1 << 20))
    else:  # a record that names the entry but claims it for other key parts
        fields = record_fields(remote.read(record_path))
        fields["parts"]["platform"] = "elsewhere"
        remote.write(record_path, record_bytes(fields))

    b = host(tmp_path, "b", [p], remote.env)
    assert b["stats"][0]["compiled"] == 1
    assert b["remote"]["refused"] == 1 and b["remote"]["hits"] == 0
    assert close(b["outputs"][0][0], expected(1))
    refused = [w for w in b["warnings"] if "refused the entry" in w]
    assert len(refused) == 1, b["warnings"]
    # B's publish mends the damage (conditionally on the version read), never loads it.
    assert b["remote"]["repaired"] == 1 and b["remote"]["already_there"] == 0
    assert b["remote"]["published"] == 0
    c = host(tmp_path, "c", [p], remote.env)
    assert c["stats"][0]["compiled"] == 0 and c["remote"]["hits"] == 1
    assert c["remote"]["refused"] == 0 and c["outputs"] == b["outputs"]


@pytest.mark.slow
def test_an_entry_over_the_local_bound_is_not_fetched(tmp_path, remote):
    (p,) = programs(tmp_path, 2)
    _published(tmp_path, remote, p)
    b = host(tmp_path, "b", [p], {**remote.env, "PJRT_POOL_CACHE_MAX_SIZE": "1K"})
    assert b["stats"][0]["compiled"] == 1 and b["remote"]["refused"] == 1
    assert any("over this cache's bound" in w for w in b["warnings"])


def _keypair(tmp_path: Path, name: str) -> tuple[str, str]:
    from worker.cache.remote import generate_private_key

    path = tmp_path / f"{name}.pem"
    return str(path), generate_private_key(path)


@pytest.mark.slow
def test_signed_records_verify_with_the_public_key_only(tmp_path, remote):
    p, q, r = programs(tmp_path, 3, 4, 5)
    private, public = _keypair(tmp_path, "ci")
    ci = {**remote.env, "PJRT_POOL_CACHE_PRIVATE_KEY_FILE": private}
    serving = {**remote.env, "PJRT_POOL_CACHE_PUBLIC_KEY": public}

    signed = host(tmp_path, "ci", [p], ci)
    assert signed["remote"]["published"] == 1
    (record_path,) = [n for n in remote.names() if n.startswith("records/")]
    assert record_path.endswith(
        f"/ed25519-{hashlib.sha256(bytes.fromhex(public)).hexdigest()[:16]}.json"
    )

    # A serving host verifies with the public key alone; it never writes (q stays local).
    b = host(tmp_path, "b", [p, q], serving)
    assert [s["compiled"] for s in b["stats"]] == [0, 1]
    assert b["remote"]["hits"] == 1 and b["remote"]["published"] == 0
    assert close(b["outputs"][0][0], expected(3)) and close(b["outputs"][1][0], expected(4))
    assert len([n for n in remote.names() if n.startswith("records/")]) == 1

    # An attacker who can write the bucket but holds no private key forges r's record.
    unsigned = host(tmp_path, "mallory", [r], remote.env)  # publishes an unsigned record
    assert unsigned["remote"]["published"] == 1
    (forged_from,) = [
        n for n in remote.names() if n.startswith("records/") and n.endswith("/unsigned.json")
    ]
    key = forged_from.split("/")[1]
    fields = record_fields(remote.read(forged_from))
    _, other_public = _keypair(tmp_path, "mallory")
    fields["signer"] = record_path.rsplit("/", 1)[1].removesuffix(".json")
    remote.write(record_name(key, fields["signer"]), record_bytes(fields, "00" * 64))
    c = host(tmp_path, "c", [r], serving)
    assert c["stats"][0]["compiled"] == 1 and c["remote"]["refused"] == 1
    assert any("signature" in w for w in c["warnings"])

    # Another public key names other records: nothing of CI's is taken for its own.
    d = host(tmp_path, "d", [p], {**remote.env, "PJRT_POOL_CACHE_PUBLIC_KEY": other_public})
    assert d["stats"][0]["compiled"] == 1 and d["remote"]["misses"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["refused", "hang"])
def test_a_dead_remote_costs_one_deadline(tmp_path, fault):
    progs = programs(tmp_path, 6, 7, 8)
    hang = None
    if fault == "hang":
        hang = Hang()
        hang.start()
        port = hang.port
    else:
        port = closed_port()
    env = {
        **S3_ENV,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "PJRT_POOL_CACHE_REMOTE": "s3://fleet/prefix?token=SECRET-TOKEN",
        "PJRT_POOL_CACHE_REMOTE_TIMEOUT": "1",
        "PJRT_POOL_CACHE_REMOTE_DEADLINE": "2",
    }
    try:
        report = host(tmp_path, "a", progs, env)
    finally:
        if hang is not None:
            hang.socket.close()
    assert [s["compiled"] for s in report["stats"]] == [1, 1, 1]
    assert [
        close(o[0], expected(v)) for o, v in zip(report["outputs"], (6, 7, 8), strict=True)
    ] == [True] * 3
    assert report["remote"]["errors"] == 1  # one lookup failed; the others never asked
    assert report["remote_seconds"] < 2.5, report
    if fault == "hang":
        assert report["remote_seconds"] > 1.5  # it did wait, for the deadline
    off = [w for w in report["warnings"] if "switched off" in w]
    assert len(off) == 1 and "s3://fleet/prefix" in off[0], report["warnings"]
    assert "SECRET-TOKEN" not in json.dumps(report)


@pytest.mark.slow
def test_throttling_is_retried_with_backoff(tmp_path, s3_proxy):
    proxy, remote = s3_proxy
    (p,) = programs(tmp_path, 11)
    proxy.faults = [("GET", 503), ("GET", 429), ("PUT", 503), ("PUT", 429)]
    a = host(tmp_path, "a", [p], remote.env)
    assert proxy.faults == [] and len(proxy.answered) == 4
    assert a["remote"]["errors"] == 0 and a["remote"]["published"] == 1
    # Nothing switched the tier off; the one warning says, once, that the records are unsigned.
    (unsigned,) = a["warnings"]
    assert "publishes unsigned records" in unsigned, a["warnings"]
    b = host(tmp_path, "b", [p], remote.env)
    assert b["stats"][0]["compiled"] == 0 and b["remote"]["hits"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["reset", "short"])
def test_a_reset_or_a_cut_body_never_gives_a_wrong_result(tmp_path, s3_proxy, fault):
    """A connection closed without an answer, or an answer whose body stops halfway,
    on host B's reads: retried, verified, and the right numbers."""
    proxy, remote = s3_proxy
    (p,) = programs(tmp_path, 12)
    host(tmp_path, "a", [p], remote.env)
    code = RESET if fault == "reset" else SHORT
    proxy.faults = [("GET", code), ("GET", code)]  # the record's read, then the blob's
    b = host(tmp_path, "b", [p], remote.env)
    assert len(proxy.answered) == 2, proxy.answered
    assert close(b["outputs"][0][0], expected(12))
    assert b["seconds"] < 20, b
    # The client retries both (a reset, a body short of its length), then verifies.
    assert b["stats"][0]["compiled"] == 0 and b["remote"]["hits"] == 1, b
    assert b["remote"]["errors"] == 0 and b["warnings"] == []


@pytest.mark.slow
def test_a_refused_write_makes_the_process_read_only(tmp_path, s3_proxy):
    proxy, remote = s3_proxy
    p, q = programs(tmp_path, 12, 13)
    proxy.always = {"PUT": 403}
    a = host(tmp_path, "a", [p, q], remote.env)
    assert [s["compiled"] for s in a["stats"]] == [1, 1]
    assert proxy.seen.get("PUT") == 1  # q's entry was never offered: read-only after p's 403
    assert a["remote"]["errors"] == 1 and a["remote"]["published"] == 0
    assert a["remote"]["misses"] == 2  # still read
    (warning,) = [w for w in a["warnings"] if "refused a write" in w]
    assert "reading it only" in warning and remote.url in warning
    assert remote.names() == []


@pytest.mark.slow
def test_a_key_is_loaded_from_the_remote_without_its_program(tmp_path, remote):
    (p,) = programs(tmp_path, 14)
    a = host(tmp_path, "a", [p], remote.env)
    (record,) = [n for n in remote.names() if n.startswith("records/")]
    key = record.split("/")[1]
    code = f"""
import json, sys
from worker.cache.remote import remote_counters
from worker.compile.by_key import load_cached_executable
executable = load_cached_executable({key!r}, {str(tmp_path / "cache-k")!r})
out = executable.run([{X!r}])[0].tolist()
print(json.dumps({{"out": out, "remote": remote_counters()._asdict()}}))
"""
    from conftest import run_python

    done = run_python(code, env=remote.env)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["remote"]["hits"] == 1 and report["out"] == a["outputs"][0][0]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.mark.slow
def test_an_http_remote_is_read_only(tmp_path):
    (p, q) = programs(tmp_path, 9, 10)
    root = tmp_path / "served"
    host(tmp_path, "a", [p], {"PJRT_POOL_CACHE_REMOTE": f"file://{root}"})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: _Quiet(*a, directory=str(root))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    before = sorted(str(x) for x in root.rglob("*"))
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        b = host(tmp_path, "b", [p, q], {"PJRT_POOL_CACHE_REMOTE": url})
    finally:
        server.shutdown()
    assert [s["compiled"] for s in b["stats"]] == [0, 1]
    assert b["remote"]["hits"] == 1 and b["remote"]["misses"] == 1
    assert b["remote"]["published"] == 0 and b["remote"]["errors"] == 0
    assert sorted(str(x) for x in root.rglob("*")) == before


def test_remote_urls_are_checked_and_shown_without_credentials():
    assert parse_remote("s3://bucket/prefix").scheme == "s3"
    assert parse_remote("https://host/x").read_only
    assert not parse_remote("file:///srv/cache").read_only
    for bad, says in [
        ("", "empty"),
        ("ftp://host/x", "scheme"),
        ("s3:///prefix", "no bucket"),
        ("file://relative/x", "absolute"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_remote(bad)
    assert redact("https://user:pw@host:8443/p?sig=abc#f") == "https://host:8443/p"
    assert "abc" not in redact_text("GET https://u:pw@host/p?X-Amz-Signature=abc failed")


def test_a_record_is_refused_unless_it_is_what_its_name_says():
    parts = {"a": 1}
    key = key_of(parts)
    good = Record(key, parts, "ab" * 32, 10).encode()
    assert decode_record(good, key, "unsigned").size == 10
    for data, says in [
        (record_bytes({}).replace(b"{}", b"[" * 100 + b"]" * 100), "not JSON"),
        (b"x" * (300 << 10), "over"),
        (good, "not the"),
        (b"pjrt-pool remote record 3 -\n{}", "format '3'"),
        (b"pjrt-pool remote record 2 xyz\n{}", "not hex"),
        (b"just text", "no header"),
    ]:
        with pytest.raises(BadRecordError, match=says):
            decode_record(data, key, "ed25519-0000000000000000" if data is good else "unsigned")
    bad_size = record_fields(good)
    bad_size["size"] = -1
    with pytest.raises(BadRecordError, match="byte count"):
        decode_record(record_bytes(bad_size), key, "unsigned")


def test_compile_program_refuses_a_malformed_remote(tmp_path):
    import worker

    with pytest.raises(ValueError, match="scheme"):
        worker.compile_program(lowered(0), cache_dir=tmp_path / "c", remote="ftp://x/y")


def test_the_remote_package_imports_no_client():
    from conftest import run_python

    done = run_python(
        "import sys, worker.compile.compiler, worker.cache.remote\n"
        "print('obstore' in sys.modules, 'cryptography' in sys.modules)"
    )
    assert done.stdout.split() == ["False", "False"]


@pytest.mark.slow
def test_pool_workers_publish_through_the_environment(tmp_path, remote, monkeypatch, cache_dir):
    """A Pool's workers inherit PJRT_POOL_CACHE_REMOTE: what they compile reaches other hosts."""
    from pool import Pool

    for name, value in remote.env.items():
        monkeypatch.setenv(name, value)
    with Pool(workers=1) as workers:
        spec = workers.compile(lowered(15))
    assert [n for n in remote.names() if n.startswith("records/")] == [
        f"records/{spec.key}/unsigned.json"
    ]
    (p,) = programs(tmp_path, 15)
    b = host(tmp_path, "b", [p], remote.env)
    assert b["stats"][0]["compiled"] == 0 and b["remote"]["hits"] == 1


@pytest.mark.slow
def test_three_hosts_missing_one_program_compile_it_once(tmp_path):
    """file://: its create-only write is atomic (a hard link), so the race is real here."""
    from cache_helpers import wait_for

    (p,) = programs(tmp_path, 16)
    env = {"PJRT_POOL_CACHE_REMOTE": f"file://{tmp_path / 'remote'}"}
    barrier = tmp_path / "go"
    children = []
    for name in "abc":
        spec = {**host_spec(tmp_path, name, [p]), "ready": str(tmp_path / f"ready-{name}")}
        spec["barrier"] = str(barrier)
        children.append(start(spec, env, code=HOST))
    for name, child in zip("abc", children, strict=True):
        wait_for(tmp_path / f"ready-{name}", child)
    barrier.touch()
    reports = [finish(child) for child in children]
    # Each of the others either waited on the lease or came after the publish.
    assert sum(r["stats"][0]["compiled"] for r in reports) == 1, reports
    assert sum(r["remote"]["hits"] for r in reports) == 2
    assert all(close(r["outputs"][0][0], expected(16)) for r in reports)
    # The holder released its lease: left, expired, for the next host to take over (or gc).
    assert all(_expired(lease) for lease in (tmp_path / "remote" / "leases").glob("*.json"))


def _expired(path: Path) -> bool:
    from worker.cache.remote.lease import decode_lease, parse_lease_name

    key = parse_lease_name(f"leases/{path.name}")
    lease = decode_lease(path.read_bytes(), key)
    return lease is not None and lease.expired()


@pytest.mark.slow
def test_a_dead_hosts_lease_is_waited_out_then_taken_over(tmp_path, remote):
    from worker.cache.remote.lease import Lease, decode_lease, lease_name

    p, q = programs(tmp_path, 17, 18)
    from cache_helpers import load_program

    import worker

    runtime = worker.get_runtime("cpu")
    key_p, key_q = (worker.program_key(load_program(x), runtime, None)[0] for x in (p, q))
    # p: a lease standing 2 s more, of a host that died; q: one that expired an hour ago.
    remote.write(lease_name(key_p), Lease(key_p, "dead:1:0", time.time() + 2).encode())
    remote.write(lease_name(key_q), Lease(key_q, "dead:2:0", time.time() - 3600).encode())
    b = host(tmp_path, "b", [p, q], remote.env)
    assert [s["compiled"] for s in b["stats"]] == [1, 1]
    assert b["remote"]["waited"] == 0 and b["remote"]["leases"] == 2  # both taken over
    assert 1.5 < b["remote_seconds"] < 10, b
    assert b["remote"]["published"] == 2
    leases = [n for n in remote.names() if n.startswith("leases/")]
    assert sorted(leases) == sorted([lease_name(key_p), lease_name(key_q)])
    # Each was released after its publish: expired, and B's, no more the dead hosts'.
    for key in (key_p, key_q):
        lease = decode_lease(remote.read(lease_name(key)), key)
        assert lease is not None and lease.expired() and not lease.holder.startswith("dead")


@pytest.mark.slow
def test_a_host_waits_for_the_lease_holder_instead_of_compiling(tmp_path, remote):
    from cache_helpers import load_program, wait_for

    import worker
    from worker.cache.remote.lease import Lease, lease_name

    (p,) = programs(tmp_path, 19)
    staging = tmp_path / "staging"
    host(tmp_path, "x", [p], {"PJRT_POOL_CACHE_REMOTE": f"file://{staging}"})
    key = worker.program_key(load_program(p), worker.get_runtime("cpu"), None)[0]
    # A live host holds p's lease (for 60 s) and is compiling it.
    remote.write(lease_name(key), Lease(key, "busy:1:0", time.time() + 60).encode())
    spec = {**host_spec(tmp_path, "b", [p]), "ready": str(tmp_path / "ready"), "barrier": ""}
    child = start(spec, remote.env, code=HOST)
    wait_for(tmp_path / "ready", child)
    time.sleep(1.0)
    assert child.poll() is None  # waiting, not compiling
    # The holder publishes: blob first, then the record.
    for path in sorted(staging.rglob("*.pjx")) + sorted(staging.rglob("*.json")):
        remote.write(str(path.relative_to(staging)), path.read_bytes())
    b = finish(child)
    assert b["stats"][0]["compiled"] == 0 and b["remote"]["waited"] == 1
    assert b["remote"]["leases"] == 0 and b["remote_seconds"] < 10
    assert close(b["outputs"][0][0], expected(19))


# In-process hosts: RemoteCache objects sharing one remote, threads standing for hosts.


def _entry(variant: int, size: int = 64) -> tuple[str, dict, bytes]:
    """A key, its parts and a valid entry file of about size bytes (no plugin needed)."""
    from worker.cache import entry as entry_format

    parts = {"program_sha256": f"p{variant}", "compile_options": "o", "env": "tests"}
    key = key_of(parts)
    return key, parts, entry_format.encode(key, parts, {"created": 0.0}, os.urandom(size))


def _tier(remote: Remote, monkeypatch, timeout: float = 2, deadline: float = 4):
    """A host's RemoteCache on remote (a fresh one: nothing refused, no lease held)."""
    from worker.cache.remote import Limits, RemoteCache

    for name, value in remote.env.items():
        monkeypatch.setenv(name, value)
    location = parse_remote(remote.url, read_only=False)
    return RemoteCache(location, Limits(timeout=timeout, deadline=deadline))


def _all(threads: list[threading.Thread], seconds: float = 60) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds)
        assert not thread.is_alive(), "a host hung"


@pytest.mark.slow
def test_a_large_entry_over_a_slow_steady_link_moves_both_ways(s3_proxy, monkeypatch):
    """The request timeout bounds stalls, not transfers; the deadline grows with the size."""
    proxy, remote = s3_proxy
    key, parts, data = _entry(20, 2 << 20)
    # 2 MiB at 256 KiB every 0.2 s (1.3 MB/s): 1.6 s, past both the request timeout (0.5 s)
    # and the deadline (1 s), steady all along.
    proxy.pace = (256 << 10, 0.2)
    writer = _tier(remote, monkeypatch, timeout=0.5, deadline=1)
    began = time.monotonic()
    writer.publish(key, parts, data)
    assert writer.counters.published == 1 and writer.counters.errors == 0, writer.counters
    assert time.monotonic() - began > 1.5  # it did move slowly
    reader = _tier(remote, monkeypatch, timeout=0.5, deadline=1)
    began = time.monotonic()
    fetched = reader.fetch(key, 4 << 20)
    assert fetched is not None and fetched[0] == data, reader.counters
    assert time.monotonic() - began > 1.5 and reader.counters.errors == 0


@pytest.mark.slow
def test_when_a_dead_hosts_lease_expires_one_waiter_takes_it_over(remote, monkeypatch):
    from worker.cache.remote.lease import Lease, lease_name

    key, parts, data = _entry(21)
    remote.write(lease_name(key), Lease(key, "dead:1:0", time.time() + 1).encode())
    hosts = [_tier(remote, monkeypatch) for _ in range(4)]
    compiled: list[int] = []

    def host(index: int) -> None:
        if hosts[index].fetch_or_lead(key, 1 << 20) is None:  # compile, then publish
            compiled.append(index)
            time.sleep(0.3)
            hosts[index].publish(key, parts, data)

    _all([threading.Thread(target=host, args=(i,)) for i in range(4)])
    counters = [h.counters for h in hosts]
    assert len(compiled) == 1, counters
    assert sum(c.leases for c in counters) == 1 and sum(c.waited for c in counters) == 3
    assert sum(c.published for c in counters) == 1


@pytest.mark.parametrize("publish_before_look", [1, 2], ids=["while-claiming", "while-waiting"])
def test_a_host_whose_holder_publishes_as_it_looks_fetches_and_takes_no_lease(
    remote, monkeypatch, publish_before_look
):
    """The holder publishes (record, then release) just before a waiting host looks at the lease
    (while it claims, or on a poll while it waits): the waiter fetches the entry and takes no
    lease (a lease counts a compile; seen once in CI as 2 leases for one compile, when a
    waiter read the record before the lease and the holder published between the two)."""
    key, parts, data = _entry(25)
    holder, waiter = _tier(remote, monkeypatch), _tier(remote, monkeypatch)
    assert holder.fetch_or_lead(key, 1 << 20) is None  # the holder compiles
    looks = 0
    look = waiter.leases.look

    def look_after_the_holder_published(key: str):
        nonlocal looks
        looks += 1
        if looks == publish_before_look:
            holder.publish(key, parts, data)
        return look(key)

    monkeypatch.setattr(waiter.leases, "look", look_after_the_holder_published)
    fetched = waiter.fetch_or_lead(key, 1 << 20)
    assert fetched is not None and fetched[0] == data
    assert looks >= publish_before_look
    assert waiter.counters.leases == 0, waiter.counters
    assert holder.counters.leases == 1 and holder.counters.published == 1
    if publish_before_look == 2:  # it waited on the holder's lease
        assert waiter.counters.waited == 1, waiter.counters


def test_of_hosts_racing_for_an_expired_lease_exactly_one_takes_it(remote, monkeypatch):
    from worker.cache.remote.lease import Lease, lease_name

    key, _, _ = _entry(22)
    remote.write(lease_name(key), Lease(key, "dead:1:0", time.time() - 1).encode())
    hosts = [_tier(remote, monkeypatch) for _ in range(8)]
    start = threading.Barrier(len(hosts))
    claims: list[str] = []

    def host(tier) -> None:
        start.wait()
        claims.append(tier.claim(key))

    _all([threading.Thread(target=host, args=(h,)) for h in hosts])
    assert sorted(claims) == ["mine"] + ["theirs"] * 7, claims
    for tier in hosts:
        tier.release(key)


def test_a_holder_whose_lease_was_taken_over_releases_nothing(remote, monkeypatch):
    from worker.cache.remote.objects import Failure, RemoteError

    key, _, _ = _entry(23)
    monkeypatch.setenv("PJRT_POOL_CACHE_REMOTE_LEASE", "0.3")
    old = _tier(remote, monkeypatch)
    monkeypatch.delenv("PJRT_POOL_CACHE_REMOTE_LEASE")
    new, third = _tier(remote, monkeypatch), _tier(remote, monkeypatch)
    assert old.claim(key) == "mine"

    def cut_off(*args, **kwargs):
        raise RemoteError(Failure.UNAVAILABLE, "a partition")

    # The old holder is cut off: it cannot renew, its lease expires, another takes it over.
    monkeypatch.setattr(old.client, "put_if_match", cut_off, raising=False)
    time.sleep(0.5)
    assert new.claim(key) == "mine"
    monkeypatch.undo()
    for name, value in remote.env.items():
        monkeypatch.setenv(name, value)
    old.release(key)  # its compile ends: the new holder's lease stays
    assert third.claim(key) == "theirs"
    new.release(key)
    assert third.claim(key) == "mine"
    third.release(key)


@pytest.mark.slow
def test_a_holder_renews_its_lease_while_it_compiles(remote, monkeypatch):
    key, _, _ = _entry(24)
    monkeypatch.setenv("PJRT_POOL_CACHE_REMOTE_LEASE", "0.6")
    holder, other = _tier(remote, monkeypatch), _tier(remote, monkeypatch)
    assert holder.claim(key) == "mine"
    time.sleep(2.0)  # a compile three times the lease
    assert other.claim(key) == "theirs"
    holder.release(key)
    assert other.claim(key) == "mine"
    other.release(key)


def test_a_record_whose_blob_is_gone_is_a_miss_and_the_next_publish_repairs_it(remote, monkeypatch):
    from worker.cache.remote.layout import blob_name

    key, parts, first = _entry(25)
    _tier(remote, monkeypatch).publish(key, parts, first)
    remote.delete(blob_name(hashlib.sha256(first).hexdigest()))
    host = _tier(remote, monkeypatch)
    assert host.fetch(key, 1 << 20) is None
    # The host compiles it again (other bytes: a new payload) and publishes: the record
    # is replaced by one naming the blob just written.
    _, _, data = _entry(25)
    outcome = host.publish(key, parts, data)
    fetched = _tier(remote, monkeypatch).fetch(key, 1 << 20)
    assert fetched is not None and fetched[0] == data
    assert outcome.value == "repaired" and host.counters.repaired == 1
    assert host.counters.misses == 1 and host.counters.refused == 0
    assert _tier(remote, monkeypatch).publish(key, parts, data).value == "already there"


@pytest.mark.parametrize("lease", ["oversized", "garbage"])
def test_an_unreadable_lease_is_taken_over_counted_and_warned_about_once(
    remote, monkeypatch, lease
):
    from worker.cache.remote import RemoteCacheWarning
    from worker.cache.remote.lease import decode_lease, lease_name

    keys = [_entry(26)[0], _entry(27)[0]]
    for key in keys:
        remote.write(lease_name(key), b" " * 5000 if lease == "oversized" else b"{not json")
    host = _tier(remote, monkeypatch)
    with pytest.warns(RemoteCacheWarning, match="cannot be read") as caught:
        assert [host.claim(key) for key in keys] == ["mine", "mine"]
    assert len([w for w in caught if "cannot be read" in str(w.message)]) == 1
    assert host.counters.refused == 2 and host.counters.leases == 2
    found = decode_lease(remote.read(lease_name(keys[0])), keys[0])
    assert found is not None and not found.expired()
    for key in keys:
        host.release(key)


def test_a_signature_is_checked_before_the_record_is_parsed(tmp_path, monkeypatch):
    from worker.cache.remote import generate_private_key
    from worker.cache.remote.layout import OldRecordError
    from worker.cache.remote.signing_keys import keys_from_environment
    from worker.cache.remote.verify import OlderRecordError, RefusedObjectError, checked_record
    from worker.cache.signing import Signer

    ci, mallory = tmp_path / "ci.pem", tmp_path / "mallory.pem"
    generate_private_key(ci)
    generate_private_key(mallory)
    monkeypatch.setenv("PJRT_POOL_CACHE_PRIVATE_KEY_FILE", str(ci))
    keys = keys_from_environment()
    monkeypatch.setenv("PJRT_POOL_CACHE_PRIVATE_KEY_FILE", str(mallory))
    forger = keys_from_environment()
    parts = {"a": 1}
    key = key_of(parts)
    hmac, other_hmac = Signer(b"s" * 32, "test"), Signer(b"t" * 32, "test")
    signed = Record(key, parts, "ab" * 32, 10, keys.signer)
    maced = Record(key, parts, "ab" * 32, 10, f"hmac-{hmac.key_id}")

    def sign(record: Record, with_keys=None, with_hmac=None) -> bytes:
        from worker.cache.remote.verify import sign_record

        return record.encode(sign_record(record.body(), with_keys, with_hmac))

    good, forged = sign(signed, keys), sign(signed, forger)
    good_mac, forged_mac = sign(maced, with_hmac=hmac), sign(maced, with_hmac=other_hmac)
    assert checked_record(good, key, keys.signer, keys).sha256 == "ab" * 32
    assert checked_record(good_mac, key, maced.signer, None, hmac).size == 10
    unsigned = Record(key, parts, "ab" * 32, 10).encode()
    assert checked_record(unsigned, key, "unsigned", None).size == 10

    def never(*args, **kwargs):
        raise AssertionError("parsed or hashed before the signature was checked")

    monkeypatch.setattr("worker.cache.remote.layout.parse_json", never)
    monkeypatch.setattr("worker.cache.remote.verify.key_of", never)
    for data, signer, checking in [
        (forged, keys.signer, (keys, None)),
        (forged_mac, maced.signer, (None, hmac)),
        (unsigned.replace(b" -\n", f" {'00' * 64}\n".encode()), keys.signer, (keys, None)),
    ]:
        with pytest.raises(RefusedObjectError, match=r"signature|MAC"):
            checked_record(data, key, signer, *checking)
    # Format 1 (the signature inside the JSON) is refused as older, before parsing too.
    old = json.dumps({"format": 1, "key": key, "parts": parts, "signer": "unsigned"}).encode()
    with pytest.raises(OlderRecordError, match="format 1"):
        checked_record(old, key, "unsigned", None)
    with pytest.raises(OldRecordError):
        decode_record(old, key, "unsigned")


def test_a_record_of_an_older_format_is_a_miss_and_replaced_by_the_next_publish(
    remote, monkeypatch
):
    key, parts, data = _entry(28)
    old = {"format": 1, "key": key, "parts": parts, "sha256": "ab" * 32, "size": len(data)}
    remote.write(record_name(key, "unsigned"), json.dumps({**old, "signer": "unsigned"}).encode())
    host = _tier(remote, monkeypatch)
    with pytest.warns(match="format 1"):
        assert host.fetch(key, 1 << 20) is None
    assert host.counters.misses == 1 and host.counters.refused == 0
    assert host.publish(key, parts, data).value == "repaired"
    assert _tier(remote, monkeypatch).fetch(key, 1 << 20) is not None


def test_a_concurrent_prefetch_says_missing_for_a_missing_key_while_another_fails(
    s3_proxy, monkeypatch, tmp_path
):
    """Outcomes come from each lookup, not from the tier's state another thread changed."""
    from worker.cache.remote import prefetch
    from worker.cache.store import DiskCache

    proxy, remote = s3_proxy
    missing, failing = _entry(29)[0], _entry(30)[0]
    # The missing key's lookup is answered after the failing one switched the remote off.
    proxy.delays = {missing: 0.5}
    proxy.faults = [("GET", 403)]
    host = _tier(remote, monkeypatch)
    with pytest.warns(match="switched off"):
        report = prefetch(host, DiskCache(tmp_path / "cache"), [missing, failing], concurrency=2)
    assert {k: v.value for k, v in report.outcomes.items()} == {
        missing: "missing",
        failing: "failed",
    }


def test_a_refused_key_is_asked_for_again_after_a_while(remote, monkeypatch):
    import worker.cache.remote.tier as tier_module

    monkeypatch.setattr(tier_module, "REFUSAL_MEMORY", 0.3, raising=False)
    key, parts, data = _entry(31)
    host = _tier(remote, monkeypatch)
    assert host.publish(key, parts, data)
    with pytest.warns(match="refused"):
        host.refuse(key, "the plugin rejected it")
    assert host.was_refused(key) and host.fetch(key, 1 << 20) is None
    time.sleep(0.4)
    assert not host.was_refused(key)
    assert host.fetch(key, 1 << 20) is not None and host.counters.hits == 1


def test_gs_and_azure_endpoints_given_as_plain_http_are_reached(monkeypatch):
    """fake-gcs-server and Azurite listen on http: the client is told to allow it."""
    from worker.cache.remote.client import ObjectClient
    from worker.cache.remote.location import Limits

    seen: list[str] = []

    class Answer(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            seen.append(self.path)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    for name, value in {
        "GOOGLE_BASE_URL": endpoint,
        "GOOGLE_SKIP_SIGNATURE": "true",
        "AZURE_STORAGE_ENDPOINT": f"{endpoint}/account",
        "AZURE_STORAGE_ACCOUNT_NAME": "account",
        "AZURE_SKIP_SIGNATURE": "true",
    }.items():
        monkeypatch.setenv(name, value)
    try:
        for url in ("gs://bucket/fleet", "az://container/fleet"):
            client = ObjectClient(parse_remote(url), Limits(timeout=2, deadline=4, retries=0))
            assert client.get("x", 100, time.monotonic() + 4) is None  # a 404: reached
    finally:
        server.shutdown()
    assert seen == ["/bucket/fleet%2Fx", "/account/container/fleet/x"]


def test_a_waiter_waits_one_lease_length_or_twice_the_compile_time_expected_if_shorter():
    """Never longer than its own lease length, whatever a lease says (leases are unsigned)."""
    from worker.cache.remote.lease import POLL_MAX, Lease, decode_lease

    key = key_of({"a": 2})
    expecting = Lease(key, "host:1:0", time.time() + 60, expected=5.0)
    assert decode_lease(expecting.encode(), key) == expecting
    assert expecting.patience(120.0) == 2 * 5.0 + POLL_MAX
    unknown = Lease(key, "host:1:0", time.time() + 60)
    assert decode_lease(unknown.encode(), key) == unknown and unknown.patience(120.0) == 120.0
    assert Lease(key, "host:1:0", time.time() + 60, expected=1e6).patience(120.0) == 120.0
    assert Lease(key, "host:1:0", time.time() + 1e9, expected=1e9).patience(2.0) == 2.0
    assert decode_lease(expecting.encode().replace(b"5.0", b"-1"), key) is None
