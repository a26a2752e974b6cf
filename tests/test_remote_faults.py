"""The remote tier under faults (issue 43): a missing bucket, planted and orphaned leases,
limits out of range, damage that must be mended, what gc cannot read, links in a file://
remote, and the errors a user meets on the command line.

Hosts are child processes (test_remote_cache.HOST) or RemoteCache objects in this process;
the remote is moto's S3 server on the loopback or a file:// directory (the `remote`
fixture). Every child is waited for with a timeout, so that a stall fails, never hangs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from pathlib import Path

import pytest
from cache_helpers import finish, kill, load_program, lowered, start, wait_for
from remote_helpers import S3_ENV, Remote, record_bytes, record_fields
from test_remote_cache import HOST, close, expected, host, host_spec, programs
from test_remote_cache import _entry as entry
from test_remote_cache import _tier as tier
from test_remote_fleet import pjrt_pool_json

import worker
from worker.cache.remote import RemoteCacheWarning, parse_remote
from worker.cache.remote.layout import blob_name, record_name
from worker.cache.remote.lease import Lease, lease_name
from worker.cache.remote.outcomes import Published

LEASE_ENV = "PJRT_POOL_CACHE_REMOTE_LEASE"


def key_of_program(path: str) -> str:
    """The cache key a host computes for a saved program (this process's plugin)."""
    return worker.program_key(load_program(path), worker.get_runtime("cpu"), None)[0]


def damaged(data: bytes) -> bytes:
    """data with one byte flipped near its end: the same size, another SHA-256."""
    return data[:-7] + bytes([data[-7] ^ 0x10]) + data[-6:]


# 1. A push to a bucket that does not exist.


@pytest.mark.slow
def test_a_push_to_a_bucket_that_does_not_exist_fails_and_names_it(tmp_path, s3_endpoint):
    (p,) = programs(tmp_path, 40)
    host(tmp_path, "a", [p], {"PJRT_POOL_CACHE_REMOTE": ""})  # compiled locally only
    bucket = f"no-such-{uuid.uuid4().hex[:12]}"
    env = {**S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint, "PJRT_POOL_CACHE_REMOTE": ""}
    push = ["cache", "push", "--remote", f"s3://{bucket}/x", "--cache-dir"]
    code, report, err = pjrt_pool_json(*push, str(tmp_path / "cache-a"), "--json", env=env)
    assert code == 1, err
    assert report["counts"] == {"failed": 1}, report
    # Said once, as one line naming the bucket (never also as a raw Python warning).
    said = [line for line in err.splitlines() if bucket in line]
    assert len(said) == 1 and "does not exist" in said[0], err
    assert "RemoteCacheWarning" not in err and "Traceback" not in err, err

    # compile_program on a host whose remote is that bucket: an error, warned, not "there".
    b = host(tmp_path, "b", [p], {**env, "PJRT_POOL_CACHE_REMOTE": f"s3://{bucket}/x"})
    assert b["stats"][0]["compiled"] == 1
    assert b["remote"]["already_there"] == 0 and b["remote"]["published"] == 0
    assert b["remote"]["errors"] == 1, b["remote"]
    assert [w for w in b["warnings"] if bucket in w and "does not exist" in w], b["warnings"]


# 2. A planted lease.


@pytest.mark.slow
def test_a_planted_lease_holds_a_host_no_longer_than_its_own_lease_length(tmp_path, remote):
    (p,) = programs(tmp_path, 41)
    key = key_of_program(p)
    # Unsigned, so anyone who can write the bucket can: "a compile of 30 years, until 2057".
    planted = Lease(key, "mallory:1:0", time.time() + 1e9, expected=1e9)
    remote.write(lease_name(key), planted.encode())
    b = host(tmp_path, "b", [p], {**remote.env, LEASE_ENV: "2"}, timeout=40)
    assert b["stats"][0]["compiled"] == 1 and b["remote"]["waited"] == 0
    assert close(b["outputs"][0][0], expected(41))
    assert 1.5 < b["remote_seconds"] < 2 + 5, b  # one lease length (2 s), and the requests
    assert b["remote"]["published"] == 1


# 3. A lease holder that dies while two hosts wait.

HOLDER = r"""
import json, sys, time
spec = json.loads(sys.argv[1])
from worker.cache.remote import open_remote
tier = open_remote()
assert tier.claim(spec["key"]) == "mine", tier.counters
open(spec["ready"], "w").close()
time.sleep(300)  # compiling, until it is killed
"""


@pytest.mark.slow
def test_when_a_lease_holder_dies_one_waiting_host_takes_over_and_the_other_waits(tmp_path, remote):
    (p,) = programs(tmp_path, 42)
    key = key_of_program(p)
    env = {**remote.env, LEASE_ENV: "3"}
    barrier = tmp_path / "go"
    waiters = []
    for name in "bc":
        spec = {**host_spec(tmp_path, name, [p]), "ready": str(tmp_path / f"ready-{name}")}
        waiters.append(start({**spec, "barrier": str(barrier)}, env, code=HOST))
    try:
        for name, child in zip("bc", waiters, strict=True):
            wait_for(tmp_path / f"ready-{name}", child)  # plugins loaded: they miss together
        # Host A takes the key's lease and is killed before its first renewal (1 s).
        holder = start({"key": key, "ready": str(tmp_path / "held")}, env, code=HOLDER)
        try:
            wait_for(tmp_path / "held", holder)
        finally:
            kill(holder)
        barrier.touch()  # B and C miss the key while A's dead lease still stands (3 s)
        reports = [finish(child, 60) for child in waiters]
    finally:
        for child in waiters:
            if child.poll() is None:
                kill(child)
    compiled = sorted(r["stats"][0]["compiled"] for r in reports)
    assert compiled == [0, 1], [r["remote"] for r in reports]
    assert sorted(r["remote"]["waited"] for r in reports) == [0, 1]
    assert sum(r["remote"]["leases"] for r in reports) == 1  # one took A's lease over
    assert all(close(r["outputs"][0][0], expected(42)) for r in reports)


# 4. Limits the code cannot use.


@pytest.mark.parametrize(
    ("name", "value"),
    [("PJRT_POOL_CACHE_REMOTE_DEADLINE", "inf"), ("PJRT_POOL_CACHE_REMOTE_TIMEOUT", "1e12")],
)
def test_a_time_limit_out_of_range_is_refused_naming_the_range(tmp_path, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"{name}='{value}': .* at most 86400"):
        worker.compile_program(lowered(43), cache_dir=tmp_path / "c", remote=f"file://{tmp_path}/r")


@pytest.mark.parametrize("value", ["inf", "1e12", "nan", "0", "-1", "abc"])
def test_every_time_setting_takes_seconds_above_0_up_to_a_day(monkeypatch, value):
    from worker.cache.remote.lease import lease_seconds
    from worker.cache.remote.location import DEADLINE_ENV, TIMEOUT_ENV, Limits

    for name, read in [(DEADLINE_ENV, Limits.from_environment), (LEASE_ENV, lease_seconds)]:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"{name}=.*above 0 and at most 86400"):
            read()
        monkeypatch.delenv(name)
    monkeypatch.setenv(TIMEOUT_ENV, "86400")
    assert Limits.from_environment().timeout == 86400.0


# 6. Errors as a user meets them on the command line.

SETTINGS = {
    "public key": ("PJRT_POOL_CACHE_PUBLIC_KEY", "zz"),
    "key file mode": ("PJRT_POOL_CACHE_PRIVATE_KEY_FILE", "{key_file}"),
    "timeout": ("PJRT_POOL_CACHE_REMOTE_TIMEOUT", "abc"),
    "deadline": ("PJRT_POOL_CACHE_REMOTE_DEADLINE", "inf"),
}
COMMANDS = {
    "warm": ["warm", "spec.py"],
    "run": ["run", "m.json", "add"],
    "cache push": ["cache", "push"],
    "cache pull": ["cache", "pull"],
    "cache gc": ["cache", "gc", "--older-than", "30d"],
}


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Path:
    """A directory with a spec, a manifest and a remote, as the commands below name them."""
    from test_cli_errors import TINY_SPEC

    monkeypatch.chdir(tmp_path)
    (tmp_path / "spec.py").write_text(TINY_SPEC)
    (tmp_path / "m.json").write_text('{"format": 1, "programs": []}')
    monkeypatch.setenv("PJRT_POOL_CACHE_REMOTE", f"file://{tmp_path}/remote")
    return tmp_path


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_remote_setting_the_tier_cannot_use_is_one_line_and_exit_2(
    workspace, monkeypatch, capsys, command, setting
):
    from pool.cli.main import main
    from worker.cache.remote import generate_private_key

    name, value = SETTINGS[setting]
    if setting == "key file mode":
        generate_private_key(workspace / "ci.pem")
        os.chmod(workspace / "ci.pem", 0o644)
        value = str(workspace / "ci.pem")
    monkeypatch.setenv(name, value)
    assert main(COMMANDS[command]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].count(name) == 1, lines


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_remote_url_with_an_empty_segment_is_a_usage_error(workspace, capsys, command):
    from pool.cli.main import main

    url = "s3://bucket//prefix"
    assert main([*COMMANDS[command], "--remote", url]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--remote" in lines[0] and "empty segment" in lines[0], lines
    with pytest.raises(ValueError, match="empty segment"):
        parse_remote("file:///srv//cache")


@pytest.mark.parametrize("command", ["push", "pull"])
def test_a_manifest_key_that_is_not_one_is_a_usage_error_for_push_and_pull(
    workspace, capsys, command
):
    from pool.cli.main import main

    program = {"name": "add", "key": "zz", "platform": "cpu", "input_types": None}
    program |= {"output_types": [], "output_bytes": []}
    (workspace / "bad.json").write_text(json.dumps({"format": 1, "programs": [program]}))
    assert main(["cache", command, "--manifest", "bad.json"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "'zz'" in lines[0] and "64" in lines[0], lines


# 7. Damage a reader refuses is mended by the next publish.


def test_a_blob_damaged_in_place_is_replaced_by_the_next_publish(remote, monkeypatch):
    key, parts, data = entry(44)
    assert tier(remote, monkeypatch).publish(key, parts, data) is Published.WRITTEN
    blob = blob_name(hashlib.sha256(data).hexdigest())
    remote.write(blob, damaged(remote.read(blob)))
    b = tier(remote, monkeypatch)
    with pytest.warns(RemoteCacheWarning, match="refused the entry"):
        assert b.fetch(key, 1 << 20) is None
    _, _, again = entry(44)  # host B compiles it again: other bytes
    assert b.publish(key, parts, again) is Published.REPAIRED
    assert b.counters.repaired == 1 and b.counters.already_there == 0
    fetched = b.fetch(key, 1 << 20)  # B's own refusal is mended too
    assert fetched is not None and fetched[0] == again
    fetched = tier(remote, monkeypatch).fetch(key, 1 << 20)
    assert fetched is not None and fetched[0] == again
    assert tier(remote, monkeypatch).publish(key, parts, again) is Published.ALREADY_THERE


def test_cache_push_rewrites_a_blob_damaged_in_place_and_counts_it_repaired(
    remote, monkeypatch, tmp_path
):
    from worker.cache.remote import push
    from worker.cache.store import DiskCache

    key, _, data = entry(45)
    cache = DiskCache(tmp_path / "local")
    assert cache.publish_file(key, data)
    assert push(tier(remote, monkeypatch), cache).counts() == {"written": 1}
    blob = blob_name(hashlib.sha256(data).hexdigest())
    remote.write(blob, damaged(data))  # the same name: the blob of the very bytes pushed
    report = push(tier(remote, monkeypatch), cache)
    assert report.counts() == {"repaired": 1} and report.ok
    assert remote.read(blob) == data
    fetched = tier(remote, monkeypatch).fetch(key, 1 << 20)
    assert fetched is not None and fetched[0] == data
    assert push(tier(remote, monkeypatch), cache).counts() == {"already there": 1}


def test_an_unsigned_record_planted_under_the_signers_name_is_replaced_by_the_next_publish(
    tmp_path, remote, monkeypatch
):
    from worker.cache.remote import Limits, RemoteCache, generate_private_key
    from worker.cache.remote.signing_keys import RecordKeys, keys_from_environment

    for name, value in remote.env.items():
        monkeypatch.setenv(name, value)
    public = generate_private_key(tmp_path / "ci.pem")
    monkeypatch.setenv("PJRT_POOL_CACHE_PRIVATE_KEY_FILE", str(tmp_path / "ci.pem"))
    keys = keys_from_environment()
    monkeypatch.delenv("PJRT_POOL_CACHE_PRIVATE_KEY_FILE")
    assert keys is not None and keys.raw_public.hex() == public
    location, limits = parse_remote(remote.url, read_only=False), Limits(timeout=2, deadline=4)

    def signed(private: bool) -> RemoteCache:
        return RemoteCache(location, limits, keys=keys if private else RecordKeys(keys.public))

    key, parts, data = entry(46)
    # An attacker, holding no private key, plants a record under CI's name and its blob.
    _, _, planted = entry(46)
    digest = hashlib.sha256(planted).hexdigest()
    remote.write(blob_name(digest), planted)
    fields = {"format": 2, "key": key, "parts": parts, "sha256": digest}
    fields |= {"size": len(planted), "signer": keys.signer}
    remote.write(record_name(key, keys.signer), record_bytes(fields))
    with pytest.warns(RemoteCacheWarning, match="signature"):
        assert signed(private=False).fetch(key, 1 << 20) is None
    ci = signed(private=True)
    assert ci.publish(key, parts, data) is Published.REPAIRED and ci.counters.repaired == 1
    fetched = signed(private=False).fetch(key, 1 << 20)
    assert fetched is not None and fetched[0] == data
    assert record_fields(remote.read(record_name(key, keys.signer)))["sha256"] != digest


def test_a_record_of_a_newer_format_is_left_by_a_publish(remote, monkeypatch):
    key, parts, data = entry(47)
    newer = b"pjrt-pool remote record 3 -\n{}"
    remote.write(record_name(key, "unsigned"), newer)
    assert tier(remote, monkeypatch).publish(key, parts, data) is Published.ALREADY_THERE
    assert remote.read(record_name(key, "unsigned")) == newer


# 8. gc and the layout: what this version cannot read, and links.


def test_gc_keeps_the_blobs_a_record_of_a_newer_format_may_name(remote: Remote, monkeypatch):
    from worker.cache.remote import collect

    key, _, data = entry(48)
    digest = hashlib.sha256(data).hexdigest()
    remote.write(blob_name(digest), data)
    newer = {"format": 3, "key": key, "blobs": [digest]}  # a newer pjrt-pool's layout
    body = json.dumps(newer).encode()
    remote.write(record_name(key, "unsigned"), b"pjrt-pool remote record 3 -\n" + body)
    time.sleep(0.05)
    report = collect(tier(remote, monkeypatch), 30 * 86400.0, grace=0)
    assert report.blobs == [] and report.newer_records == [record_name(key, "unsigned")]
    assert blob_name(digest) in remote.names() and record_name(key, "unsigned") in remote.names()


@pytest.mark.parametrize("folder", ["blobs", "records", "leases"])
def test_a_file_remote_refuses_a_link_in_place_of_a_folder(tmp_path, folder):
    from worker.cache.remote import Limits, RemoteCache, collect
    from worker.cache.remote.objects import RemoteError

    root, outside = tmp_path / "remote", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / folder).symlink_to(outside)
    victim = outside / f"{'a' * 64}.pjx"  # named as a blob: a collection would delete it
    victim.write_bytes(b"not the remote's")
    os.utime(victim, (1e9, 1e9))
    location, limits = parse_remote(f"file://{root}", read_only=False), Limits(2, 4)
    key, parts, data = entry(49)
    writer = RemoteCache(location, limits)
    with pytest.warns(RemoteCacheWarning, match=f"symlink.*/{folder}'"):
        if folder == "leases":
            assert writer.claim(key) == "none"
        else:
            assert writer.publish(key, parts, data) is Published.FAILED
    assert sorted(outside.iterdir()) == [victim]  # nothing written through the link
    if folder == "blobs":
        with pytest.raises(RemoteError, match="symlink"):
            collect(RemoteCache(location, limits), 0.0, grace=0)
        assert victim.read_bytes() == b"not the remote's"
