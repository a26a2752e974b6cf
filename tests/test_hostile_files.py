"""Files and values from someone else: keys that are paths, memo files, swapped folders, bombs.

Played as an attacker who can write a shared cache directory (but holds no
signing secret) or hands over a manifest: real files, real symlinks, FIFOs
and ACLs, real plugins in real child processes and Pools. Each case is one
of issue 16's items 1 to 8.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from cache_helpers import compile_in_child, lowered, save_program
from conftest import run_python

import worker
from pool import ArrayType, Pool, ProgramSpec
from pool.cli.main import main as cli_main
from pool.manifest import Manifest, ManifestError, load_manifest
from worker.cache import (
    CacheUnavailableWarning,
    DiskCache,
    UntrustedCacheError,
    entry,
    open_cache,
)
from worker.cache.signing import Signer
from worker.compile.by_key import load_cached_executable
from worker.identity.build import memoized_by_file, plugin_digest
from worker.identity.keys import InvalidKeyError
from worker.plugin.locate import find_plugin

SECRET = "a-secret-only-the-team-holds-0123456789"
X = [0.5, 1.0, 1.5, 2.0]


def expected(variant: int) -> np.ndarray:
    scale = variant + 2.0
    return np.sin(np.array(X, np.float32)) * scale + scale


def victim_directory(tmp_path: Path) -> Path:
    """A user's project: what a key "<tmp>/victim/project" would name, with a file in it."""
    project = tmp_path / "victim" / "project.pjx"
    project.mkdir(parents=True)
    (project / "thesis.tex").write_text("years of work")
    return tmp_path / "victim" / "project"


def assert_untouched(stem: Path) -> None:
    assert (stem.parent / "project.pjx" / "thesis.tex").read_text() == "years of work"
    assert not (stem.parent / "project.lock").exists()


def manifest_naming(tmp_path: Path, key: str) -> Path:
    """A manifest whose one program has a real entry's types and the given key."""
    executable, _ = worker.compile_program(lowered(0))
    spec = ProgramSpec.from_executable("victim", executable).to_json()
    spec["key"] = key
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"format": 1, "platform": "cpu", "programs": [spec]}))
    return path


# -- 1. a manifest key is a path -------------------------------------------------------


@pytest.mark.parametrize("form", ["absolute", "relative"])
def test_a_key_that_is_a_path_is_refused_where_it_enters(tmp_path, cache_dir, capsys, form):
    stem = victim_directory(tmp_path)
    key = str(stem) if form == "absolute" else os.path.relpath(stem, cache_dir / "entries")
    manifest = manifest_naming(tmp_path, key)

    with pytest.raises(ManifestError, match="64 lowercase hexadecimal digits"):
        load_manifest(manifest)
    assert cli_main(["run", str(manifest), "victim"]) == 2  # a usage error, one line
    assert "64 lowercase hexadecimal digits" in capsys.readouterr().err
    assert_untouched(stem)

    spec = ProgramSpec("victim", "cpu", key, (ArrayType(np.dtype("float32"), (4,)),), (), ())
    with pytest.raises(ManifestError):
        Manifest([spec])
    with pytest.raises(InvalidKeyError):
        load_cached_executable(key)
    cache = open_cache()
    for call in (cache.path_of, cache.read, lambda k: cache.lock(k).__enter__()):
        with pytest.raises(InvalidKeyError):
            call(key)
    with Pool(workers=1) as pool:
        with pytest.raises(InvalidKeyError):
            pool.submit_spec(spec, [np.ones(4, np.float32)])
        (out,) = pool.run(lowered(0), [X])  # the pool is fine
    np.testing.assert_allclose(out, expected(0), rtol=1e-6)
    assert_untouched(stem)


# -- 2. memo files must not undo signing -------------------------------------------------


def _max_program(tmp_path: Path) -> str:
    import jax
    import jax.numpy as jnp

    import pool

    worker.get_runtime("cpu")
    program = pool.lower(jnp.maximum, [jax.ShapeDtypeStruct((2,), jnp.float32)] * 2)
    return str(save_program(program, tmp_path / "max.json"))


def _max_in_child(program: str, plugin: str = "") -> float:
    env = {
        "PJRT_POOL_CACHE_SECRET": SECRET,
        "PJRT_POOL_CACHE_KEY_FILE": "",
        "PJRT_POOL_PLUGIN_CPU": plugin,
    }
    report = compile_in_child({"programs": [program], "inputs": [[1.0, 2.0], [np.nan, 1.0]]}, env)
    return report["outputs"][0][0][0]  # max(1, NaN)


def test_a_tampered_flag_memo_does_not_undo_signing(tmp_path, cache_dir):
    program = _max_program(tmp_path)
    # A copy of the plugin that no installed RECORD vouches for: the flag is read from the
    # library and memoized (a known build's installed library needs no memo: KnownBuild.flags).
    plugin = str(tmp_path / "plugin.so")
    shutil.copyfile(find_plugin("pjrt_cpu").path, plugin)
    assert np.isnan(_max_in_child(program, plugin))  # the flag makes max propagate NaN
    (memo,) = (cache_dir / "plugins").glob("flag-xla_cpu_enable_fast_min_max-*.json")
    record = json.loads(memo.read_text())
    assert record["value"] is True

    # Without the secret: flip the answer (keeping a MAC if there is one), or drop the MAC.
    unsigned = {"identity": record["identity"], "value": False}
    for forged in ({**record, "value": False}, unsigned):
        memo.write_text(json.dumps(forged))
        assert np.isnan(_max_in_child(program, plugin)), forged  # fast min/max would give 1.0
        assert json.loads(memo.read_text()) == record  # computed again, and signed again
    assert "mac" in record  # signed, as the entries are


def test_records_of_plugin_builds_are_checked_like_entries(tmp_path):
    library = tmp_path / "plugin.so"
    library.write_bytes(b"a plugin build")
    real = hashlib.sha256(b"a plugin build").hexdigest()
    signed = DiskCache(tmp_path / "cache", signer=Signer(SECRET.encode(), "test"))
    from worker.identity import build as cache_key

    assert plugin_digest(str(library), signed.memos) == real
    (memo,) = signed.plugins_dir.glob("sha256-*.json")
    forged = {**json.loads(memo.read_text()), "value": "0" * 64}  # another build's digest
    memo.write_text(json.dumps(forged))
    cache_key._file_memo.clear()  # as a new process would
    assert plugin_digest(str(library), signed.memos) == real

    # Unsigned: what is read is still checked (a value of the wrong form is computed again),
    # and a record that is no regular file, too large or too deeply nested is ignored.
    plain = DiskCache(tmp_path / "plain", signer=None)
    cache_key._file_memo.clear()
    plugin_digest(str(library), plain.memos)
    (memo,) = plain.plugins_dir.glob("sha256-*.json")
    identity = json.loads(memo.read_text())["identity"]
    bombs = [
        json.dumps({"identity": identity, "value": "../../etc"}),
        json.dumps({"identity": identity, "value": real, "pad": "x" * (2 << 20)}),
        '{"identity": '
        + json.dumps(identity)
        + ', "value": '
        + "[" * 100_000
        + "]" * 100_000
        + "}",
    ]
    for bomb in bombs:
        memo.write_text(bomb)
        cache_key._file_memo.clear()
        assert plugin_digest(str(library), plain.memos) == real
    memo.unlink()
    os.mkfifo(memo)
    cache_key._file_memo.clear()
    assert memoized_by_file(str(library), plain.memos, "sha256", lambda: real) == real


# -- 3. folders swapped for symlinks while a process runs ---------------------------------


def _plant_victim_files(victim: Path) -> list[Path]:
    victim.mkdir()
    old = 1_000_000_000.0  # 2001: older than any grace
    files = [victim / f"{'a' * 64}.pjx", victim / f".tmp.{'b' * 64}.pjx.1.0badc0de"]
    for path in files:
        path.write_bytes(b"the victim's data")
        os.utime(path, (old, old))
    return files


def test_a_folder_swapped_for_a_symlink_is_never_used(tmp_path):
    cache = DiskCache(tmp_path / "cache")
    first, _ = worker.compile_program(lowered(0), disk_cache=False)
    assert cache.publish("1" * 64, {}, {}, first.serialize())
    victim = tmp_path / "victim"
    files = _plant_victim_files(victim)
    os.rename(cache.entries_dir, cache.directory / "e.old")
    cache.entries_dir.symlink_to(victim)

    assert cache.publish("2" * 64, {}, {}, b"an entry")  # into the folder it opened
    assert cache.trim(max_size=0).ran  # evicts every entry
    cache.clear()
    assert sorted(victim.iterdir()) == sorted(files)
    assert all(path.read_bytes() == b"the victim's data" for path in files)
    assert list((cache.directory / "e.old").iterdir()) == []  # what it evicted


@pytest.mark.parametrize("command", [["clear", "--yes"], ["prune", "--max-size", "0"]])
def test_cache_commands_never_delete_through_a_symlinked_folder(tmp_path, capsys, command):
    directory = tmp_path / "cache"
    DiskCache(directory)
    victim = tmp_path / "victim"
    files = _plant_victim_files(victim)
    (directory / "entries").rmdir()
    (directory / "entries").symlink_to(victim)

    with pytest.warns(CacheUnavailableWarning, match="cannot use cache directory"):
        assert cli_main(["cache", *command, "--cache-dir", str(directory)]) == 1
    assert "cannot be used" in capsys.readouterr().err
    assert sorted(victim.iterdir()) == sorted(files)


def test_eviction_removes_only_regular_files_named_like_entries(tmp_path):
    cache = DiskCache(tmp_path / "cache")
    keep = [cache.entries_dir / "notes.pjx", cache.entries_dir / ".tmp.notes"]
    for path in keep:
        path.write_text("not ours")
        os.utime(path, (1e9, 1e9))
    blocker = cache.entries_dir / f"{'c' * 64}.pjx"
    blocker.mkdir()
    (blocker / "inside").write_text("x")
    link = cache.entries_dir / f"{'d' * 64}.pjx"
    link.symlink_to(tmp_path / "elsewhere")
    assert cache.publish("e" * 64, {}, {}, b"an entry")

    assert cache.trim(max_size=0).evicted == 1
    assert cache.clear() == 0
    assert all(path.read_text() == "not ours" for path in keep)
    assert (blocker / "inside").exists() and link.is_symlink()


# -- 4. a spec's types are checked against the entry in a Pool ---------------------------


def test_a_spec_whose_types_do_not_fit_its_entry_is_refused_by_the_worker(cache_dir):
    import jax
    import jax.numpy as jnp

    import pool

    worker.get_runtime("cpu")
    program = pool.lower(lambda a: a @ a, [jax.ShapeDtypeStruct((64, 64), jnp.float32)])
    executable, _ = worker.compile_program(program)
    real = ProgramSpec.from_executable("matmul", executable)
    small = real._replace(input_types=(ArrayType(np.dtype("float32"), (4,)),))
    two = real._replace(input_types=real.input_types * 2)
    with Pool(workers=1) as pool_:
        secret = np.full((64, 64), 7.0, np.float32)
        (out,) = pool_.submit_spec(real, [secret]).result()  # leaves its inputs in the arena
        np.testing.assert_allclose(out, secret @ secret)
        with pytest.raises(ValueError, match=r"has shape \(4,\) but the program takes"):
            pool_.submit_spec(small, [np.ones(4, np.float32)]).result()
        with pytest.raises(TypeError, match=r"the program takes 1 argument \("):
            pool_.submit_spec(two, [secret, secret]).result()
        (again,) = pool_.submit_spec(real, [np.eye(64, dtype=np.float32)]).result()
    np.testing.assert_allclose(again, np.eye(64))


def test_check_run_inputs_compares_the_request_with_the_executables_inputs():
    from worker.serve.placed import InputLayout, check_run_inputs
    from worker.wire.places import PLACE
    from worker.wire.protocol import Run

    f32 = np.dtype("float32")
    own = InputLayout.of((ArrayType(f32, (64, 64)),))

    def run(sources, types=None):
        return Run(0, "p", None, "p", types, sources, None, True)

    assert check_run_inputs(run(((PLACE, 0, 0),)), own) == own.types
    with pytest.raises(ValueError, match="places 2 inputs for 1 input types"):
        check_run_inputs(run(((PLACE, 0, 0), (PLACE, 0, 16384))), own)
    with pytest.raises(ValueError, match="neither in shared memory nor a kept value"):
        check_run_inputs(run(((7, 0, 0),)), own)
    with pytest.raises(ValueError, match="unknown"):
        check_run_inputs(run(((PLACE, 0, 0),)), None)
    small = (ArrayType(f32, (4,)),)
    assert check_run_inputs(run(((PLACE, 0, 0),), small), own) == small  # converted later
    # Where a place lies is checked against its segment when it is read: an f32[64,64]
    # read past the end of the arena is refused, not read (test_pool_values.py runs one).


# -- 5. bombs: deep JSON, huge files, overflowing numbers -----------------------------------


def _entry_with_header(key: str, header: bytes) -> bytes:
    prefix = struct.pack("<8sIII", entry.MAGIC, entry.FORMAT_VERSION, 0, len(header))
    return prefix + header + hashlib.sha256(prefix + header).digest() + b"payload"


def test_damaged_files_are_damaged_not_fatal(tmp_path, cache_dir, capsys):
    executable, _ = worker.compile_program(lowered(0))
    key = executable.key
    path = cache_dir / "entries" / f"{key}.pjx"
    nested = b'{"key": "' + key.encode() + b'", "parts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    bomb = _entry_with_header(key, nested)  # its SHA-256 is right: no secret needed

    path.write_bytes(bomb)
    assert cli_main(["cache", "list"]) == 0
    assert cli_main(["cache", "verify"]) == 1
    assert "nested deeper" in capsys.readouterr().out
    healed, statistics = worker.compile_program(lowered(0))
    assert statistics.compiled == 1 and open_cache().counters.corrupt == 1
    np.testing.assert_allclose(healed.run([X])[0], expected(0), rtol=1e-6)

    os.truncate(path, 64 << 30)  # a sparse 64 GiB file: never read whole
    assert cli_main(["cache", "verify"]) == 1
    assert "the header says" in capsys.readouterr().out
    _, statistics = worker.compile_program(lowered(0))
    assert statistics.compiled == 1 and path.stat().st_size < 1 << 20

    (cache_dir / "usage.json").write_text('{"bytes": 1e400, "scanned": 1e400}')
    _, statistics = worker.compile_program(lowered(1))  # a miss reserves space: reads the ledger
    assert statistics.compiled == 1
    assert cli_main(["cache", "info"]) == 0
    assert "entries" in capsys.readouterr().out

    manifest = tmp_path / "deep.json"
    manifest.write_text('{"format": 1, "programs": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ManifestError, match="nested deeper"):
        load_manifest(manifest)
    assert cli_main(["run", str(manifest), "x"]) == 2


# -- 6. a key file that is a FIFO or a device -------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_a_key_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    if kind == "fifo":
        key_file = tmp_path / "key"
        os.mkfifo(key_file, 0o600)
    else:
        key_file = Path(kind)
    code = """
        from worker.cache import signer_from_environment
        try:
            signer_from_environment()
        except ValueError as error:
            print("refused:", error)
    """
    env = {"PJRT_POOL_CACHE_SECRET": "", "PJRT_POOL_CACHE_KEY_FILE": str(key_file)}
    done = run_python(code, env=env, timeout=30)  # before: blocked, or read forever
    assert "refused:" in done.stdout and "not a regular file" in done.stdout


def test_a_key_file_larger_than_a_secret_is_refused(tmp_path, monkeypatch):
    from worker.cache import signer_from_environment

    key_file = tmp_path / "key"
    key_file.write_bytes(b"x" * 100_000)
    key_file.chmod(0o600)
    monkeypatch.setenv("PJRT_POOL_CACHE_KEY_FILE", str(key_file))
    monkeypatch.delenv("PJRT_POOL_CACHE_SECRET", raising=False)
    with pytest.raises(ValueError, match="more than the 4096"):
        signer_from_environment()


# -- 7. POSIX ACLs -------------------------------------------------------------------------

_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP, _ACL_MASK, _ACL_OTHER = (
    0x01,
    0x02,
    0x04,
    0x08,
    0x10,
    0x20,
)
_UNDEFINED = 0xFFFFFFFF


def set_acl(path: Path, *named: tuple[int, int, int]) -> None:
    """Sets a POSIX access ACL (owner rwx, group rwx, mask rwx, other ---, plus named entries).

    Through the system.posix_acl_access xattr in the kernel's own format,
    what setfacl writes (setfacl is not installed on every machine).
    """
    entries = [(_ACL_USER_OBJ, 7, _UNDEFINED)]
    entries += [entry for entry in named if entry[0] == _ACL_USER]
    entries.append((_ACL_GROUP_OBJ, 7, _UNDEFINED))
    entries += [entry for entry in named if entry[0] == _ACL_GROUP]
    entries += [(_ACL_MASK, 7, _UNDEFINED), (_ACL_OTHER, 0, _UNDEFINED)]
    value = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
    try:
        os.setxattr(path, "system.posix_acl_access", value)
    except OSError as error:
        pytest.skip(f"this filesystem takes no POSIX ACLs: {error}")


@pytest.mark.skipif(not hasattr(os, "setxattr"), reason="no xattrs on this system")
def test_a_shared_directory_whose_acl_lets_others_write_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PJRT_POOL_CACHE_SHARED", "1")
    directory = tmp_path / "team-cache"
    directory.mkdir()
    os.chmod(directory, 0o2770)
    set_acl(directory, (_ACL_USER, 7, 54321))
    assert oct(directory.stat().st_mode & 0o7777) == "0o2770"  # the mode alone looks fine

    with pytest.raises(UntrustedCacheError, match="ACL that lets user uid 54321 write it"):
        DiskCache(directory, shared=True)
    with pytest.raises(UntrustedCacheError, match="ACL"):
        worker.compile_program(lowered(0), cache_dir=directory)

    set_acl(directory, (_ACL_USER, 5, 54321), (_ACL_GROUP, 5, 54321))  # read and enter only
    assert DiskCache(directory, shared=True).usable
    set_acl(directory, (_ACL_GROUP, 7, 54321))  # a group this process is not in
    with pytest.raises(UntrustedCacheError, match="group gid 54321"):
        DiskCache(directory, shared=True)


# -- 8. a umask of 000 -----------------------------------------------------------------------


def test_missing_parents_are_made_private_under_umask_000(tmp_path):
    directory = tmp_path / "a" / "b" / "cache"
    code = f"""
        import os
        os.umask(0)
        from worker.cache import DiskCache
        cache = DiskCache({str(directory)!r})
        print("usable", cache.usable)
    """
    done = run_python(code)
    assert "usable True" in done.stdout, done.stderr
    for parent in (tmp_path / "a", tmp_path / "a" / "b"):
        assert parent.stat().st_mode & 0o777 == 0o700
    assert directory.stat().st_mode & 0o777 == 0o700
