"""Signed cache entries, end to end in real processes, on both CPU plugins.

Children (cache_helpers.CHILD, no JAX) compile and run programs with a
signing secret in their environment; the test process plays the attacker
who can write the cache directory but does not hold the secret.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cache_helpers import (
    compile_in_child,
    cpu_plugin_params,
    lowered,
    plant,
    replace_payload_keeping_signature,
    save_program,
)

from pool.cli.main import main as cli_main
from worker.cache import DiskCache, SignatureError, Signer, entry, signer_from_environment

SECRET = "a-secret-only-the-team-holds-0123456789"
X = [0.5, 1.0, 1.5, 2.0]
PLUGINS = cpu_plugin_params()


def expected(variant: int) -> list[float]:
    scale = variant + 2.0
    return (np.sin(np.array(X, np.float32)) * scale + scale).tolist()


def run(programs: list[str], plugin: str | None, secret: str = SECRET) -> dict:
    """Compiles (or loads) and runs programs in a child with a signing secret ("" for none)."""
    env = {"PJRT_POOL_CACHE_SECRET": secret, "PJRT_POOL_CACHE_KEY_FILE": ""}
    if plugin:
        env["PJRT_POOL_PLUGIN_CPU"] = plugin
    return compile_in_child({"programs": programs, "inputs": [X]}, env)


def entry_path(cache_dir: Path, key: str) -> Path:
    return cache_dir / "entries" / f"{key}.pjx"


@pytest.mark.parametrize("plugin", PLUGINS)
def test_signed_entries_load_and_others_are_refused(tmp_path, cache_dir, plugin):
    p = str(save_program(lowered(0), tmp_path / "p.json"))
    q = str(save_program(lowered(1), tmp_path / "q.json"))

    first = run([p, q], plugin)
    assert [s["compiled"] for s in first["stats"]] == [1, 1]
    key_p, key_q = first["keys"]
    assert entry.read_header(entry_path(cache_dir, key_p)).mac is not None  # signed
    other_code = entry.decode(entry_path(cache_dir, key_q).read_bytes()).payload

    again = run([p], plugin)  # the same secret: loads
    assert again["stats"][0]["loaded"] == 1 and again["outputs"] == [[expected(0)]]

    # Another program's machine code under p's key, every digest right, the MAC kept.
    replace_payload_keeping_signature(entry_path(cache_dir, key_p), other_code)
    tampered = run([p], plugin)
    assert tampered["stats"][0]["compiled"] == 1 and tampered["counters"]["bad_signatures"] == 1
    assert tampered["outputs"] == [[expected(0)]]  # not q's [sin(x) * 3 + 3]

    # The same, unsigned.
    parts = entry.decode(entry_path(cache_dir, key_p).read_bytes()).parts
    plant(cache_dir, parts, other_code)
    unsigned = run([p], plugin)
    assert unsigned["stats"][0]["compiled"] == 1 and unsigned["counters"]["bad_signatures"] == 1
    assert unsigned["outputs"] == [[expected(0)]]
    assert entry.read_header(entry_path(cache_dir, key_p)).mac is not None  # signed again

    # A process without a secret checks digests only, and loads signed entries.
    plain = run([p], plugin, secret="")
    assert plain["stats"][0]["loaded"] == 1 and plain["outputs"] == [[expected(0)]]

    # Another secret: refused, and said so.
    other = run([p], plugin, secret="another-secret-of-another-team-987654")
    assert other["stats"][0]["compiled"] == 1 and other["counters"]["bad_signatures"] == 1


def test_the_refusal_says_which_signature_is_wrong(tmp_path):
    mine = Signer(SECRET.encode(), "test")
    theirs = Signer(b"another-secret-of-another-team-987654", "test")
    cache = DiskCache(tmp_path / "cache", signer=theirs)
    parts = {"p": 1}
    from worker.cache import key_of

    key = key_of(parts)
    assert cache.publish(key, parts, {}, b"payload")
    with pytest.raises(SignatureError, match=f"another secret \\(key id {theirs.key_id}"):
        DiskCache(tmp_path / "cache", signer=mine).read(key)
    plant(tmp_path / "cache", parts, b"payload")
    with pytest.raises(SignatureError, match="unsigned"):
        DiskCache(tmp_path / "cache", signer=mine).read(key)
    assert DiskCache(tmp_path / "cache", signer=None).read(key) is not None


def test_a_key_file_signs_and_must_be_private(tmp_path, cache_dir, monkeypatch):
    key_file = tmp_path / "cache.key"
    key_file.write_text(SECRET + "\n")
    key_file.chmod(0o600)
    p = str(save_program(lowered(0), tmp_path / "p.json"))
    env = {"PJRT_POOL_CACHE_SECRET": "", "PJRT_POOL_CACHE_KEY_FILE": str(key_file)}
    first = compile_in_child({"programs": [p], "inputs": [X]}, env)
    path = entry_path(cache_dir, first["keys"][0])
    # The same secret through the variable verifies what the key file signed.
    assert run([p], None)["stats"][0]["loaded"] == 1
    assert entry.read_header(path).fields["signer"] == Signer(SECRET.encode(), "x").key_id

    monkeypatch.setenv("PJRT_POOL_CACHE_KEY_FILE", str(key_file))
    key_file.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        signer_from_environment()
    monkeypatch.setenv("PJRT_POOL_CACHE_SECRET", "short")
    with pytest.raises(ValueError, match="at least 16"):
        signer_from_environment()


def test_verify_reports_unsigned_entries_as_bad_when_signing(
    tmp_path, cache_dir, capsys, monkeypatch
):
    p = str(save_program(lowered(0), tmp_path / "p.json"))
    run([p], None, secret="")  # written unsigned
    monkeypatch.setenv("PJRT_POOL_CACHE_SECRET", SECRET)
    assert cli_main(["cache", "verify"]) == 1
    assert "unsigned" in capsys.readouterr().out
    assert cli_main(["cache", "info"]) == 0
    assert "signing              on (key id" in capsys.readouterr().out
