"""Helpers for the disk cache tests: programs on disk, and child processes that compile them.

The test process lowers programs with JAX and writes them as JSON; children
import only `worker` (never JAX), compile with worker.compile_program and
print what happened as one JSON line: the CompileStatistics of each compile,
the cache counters, the keys, and the cache warnings they saw.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from worker.records import ArrayType, LoweredProgram

REPO = Path(__file__).resolve().parent.parent
"""The repository root (children import this module, so not from conftest and pytest)."""


@functools.cache
def lowered(variant: int = 0, size: int = 4) -> LoweredProgram:
    """Returns a small program, different for each variant (its constants differ)."""
    import jax
    import jax.numpy as jnp

    import pool
    import worker

    worker.get_runtime("cpu")  # lowering then asks the loaded plugin, not a probe process
    scale = float(variant + 2)
    return pool.lower(
        lambda x: jnp.sin(x) * scale + scale, [jax.ShapeDtypeStruct((size,), jnp.float32)]
    )


def save_program(program: LoweredProgram, path: Path) -> Path:
    """Writes a program as JSON (the test's own format; the cache never sees it)."""
    path.write_text(
        json.dumps(
            {
                "code": base64.b64encode(program.code).decode(),
                "text": program.text,
                "input_types": None
                if program.input_types is None
                else [t.to_json() for t in program.input_types],
                "platform": program.platform,
                "compile_options": None
                if program.compile_options is None
                else program.compile_options.hex(),
            }
        )
    )
    return path


def load_program(path: str | os.PathLike[str]) -> LoweredProgram:
    """Reads what save_program wrote."""
    data = json.loads(Path(path).read_text())
    inputs = data["input_types"]
    return LoweredProgram(
        code=base64.b64decode(data["code"]),
        text=data["text"],
        input_types=None if inputs is None else tuple(map(ArrayType.from_json, inputs)),
        platform=data["platform"],
        compile_options=None
        if data["compile_options"] is None
        else bytes.fromhex(data["compile_options"]),
    )


CHILD_START = r"""
import json, os, sys, time, warnings
spec = json.loads(sys.argv[1])
warnings.simplefilter("always")
caught = warnings.catch_warnings(record=True)
seen = caught.__enter__()

sys.path.insert(0, spec["tests"])
from cache_helpers import load_program  # imports worker.records only
"""
"""The start of a child program: its spec (argv[1]), the warnings it sees (`seen`), and
load_program."""

CHILD = (
    CHILD_START
    + r"""
import worker
from worker.cache import CacheUnavailableWarning, open_cache

if spec.get("hang_in_fsync"):
    # Simulates a writer that dies mid-write: it signals once its entry's
    # temporary file is written, then blocks in fsync until it is killed.
    real_fsync = os.fsync
    def fsync(fd):
        if "/entries/" in os.readlink(f"/proc/self/fd/{fd}"):
            open(spec["hang_in_fsync"], "w").close()
            time.sleep(3600)
        return real_fsync(fd)
    os.fsync = fsync

programs = [load_program(p) for p in spec["programs"]]
runtime = worker.get_runtime("cpu")
cache = open_cache(spec.get("cache_dir"))
# Hashing the plugin is memoized per process: done before the barrier so
# that children start compiling together.
keys = [worker.program_key(p, runtime, cache if cache.usable else None)[0] for p in programs]
if spec.get("ready"):
    open(spec["ready"], "w").close()
if spec.get("barrier"):
    while not os.path.exists(spec["barrier"]):
        time.sleep(0.002)
options = {k: spec[k] for k in ("cache_dir", "max_size", "lock_timeout") if k in spec}
start = time.perf_counter()
stats = []
outputs = []
for _ in range(spec.get("repeat", 1)):
    for program in programs:
        executable, statistics = worker.compile_program(program, **options)
        stats.append(statistics._asdict())
        if spec.get("run"):
            executable.run([[0.5] * program.input_types[0].shape[0]])
        if spec.get("inputs") is not None:
            outputs.append([o.tolist() for o in executable.run(spec["inputs"])])
print(json.dumps({
    "stats": stats,
    "keys": keys,
    "outputs": outputs,
    "seconds": time.perf_counter() - start,
    "counters": open_cache(spec.get("cache_dir")).counters._asdict(),
    "jax": "jax" in sys.modules,
    "warnings": [str(w.message) for w in seen if issubclass(w.category, CacheUnavailableWarning)],
}))
"""
)

HOLD_LOCK = r"""
import json, sys, time
spec = json.loads(sys.argv[1])
from pathlib import Path
from worker.cache.locking import try_acquire
lock = try_acquire(Path(spec["lock"]), 30)
assert lock is not None
open(spec["ready"], "w").close()
time.sleep(3600)
"""


def start(
    spec: dict[str, Any], env: dict[str, str] | None = None, code: str = CHILD
) -> subprocess.Popen[str]:
    """Starts a child running `code` (default: CHILD) with a JSON spec."""
    from pool.spawn import child_environment  # not at the top: CHILD imports this module

    spec = {"tests": str(REPO / "tests"), **spec}
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(spec)],
        env=child_environment(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(child: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    """Waits for a CHILD and returns its report; raises with its stderr if it failed."""
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        stdout, stderr = child.communicate()
        raise AssertionError(f"child timed out\n{stderr[-4000:]}") from None
    if child.returncode != 0:
        raise AssertionError(f"child failed with {child.returncode}\n{stderr[-4000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def compile_in_child(spec: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs one CHILD to the end and returns its report."""
    return finish(start(spec, env))


def wait_for(path: Path, child: subprocess.Popen[str] | None = None, timeout: float = 60) -> None:
    """Waits for a file to appear (a child's signal); fails early if the child died."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if child is not None and child.poll() is not None:
            raise AssertionError(f"child exited with {child.returncode}: {child.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear in {timeout} s")
        time.sleep(0.005)


def kill(child: subprocess.Popen[str]) -> None:
    """SIGKILLs a child and reaps it."""
    if child.poll() is None:
        os.kill(child.pid, signal.SIGKILL)
    child.communicate()


def totals(reports: list[dict[str, Any]]) -> dict[str, int]:
    """Sums compiled/loaded and the counters over child reports."""
    summed: dict[str, int] = {}
    for report in reports:
        for stats in report["stats"]:
            for name in ("compiled", "loaded"):
                summed[name] = summed.get(name, 0) + stats[name]
        for name, value in report["counters"].items():
            summed[name] = summed.get(name, 0) + value
    return summed


def entries_size(entries_dir: Path) -> int:
    """Bytes in an entries/ directory (entries and temporary files), each inode once."""
    seen: dict[int, int] = {}
    try:
        listing = list(os.scandir(entries_dir))
    except FileNotFoundError:
        return 0
    for item in listing:
        try:
            stat = item.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        seen[stat.st_ino] = stat.st_size
    return sum(seen.values())


CORRUPTIONS = (
    "truncated",
    "zero-length",
    "header bit flip",
    "payload bit flip",
    "foreign entry",
    "garbage",
    "rejected payload",
    "foreign stamp",
)
"""Ways an entry goes bad: the first six fail verification, the last two the plugin refuses."""


def corrupt(path: Path, how: str, other: Path | None = None) -> None:
    """Damages the entry file at path in place, one of CORRUPTIONS.

    "foreign entry" copies `other` (another key's entry) over it; "rejected
    payload" keeps a valid envelope around bytes the plugin cannot parse;
    "foreign stamp" keeps the executable but stamps it with another plugin build.
    """
    from worker.cache import entry as entry_format
    from worker.compile.stamp import stamp

    data = path.read_bytes()
    if how == "truncated":
        damaged = data[: len(data) // 2]
    elif how == "zero-length":
        damaged = b""
    elif how == "header bit flip":
        damaged = bytearray(data)
        damaged[20] ^= 0x01  # inside the JSON header, after the 16-byte prefix
    elif how == "payload bit flip":
        damaged = bytearray(data)
        damaged[-100] ^= 0x01
    elif how == "foreign entry":
        assert other is not None
        damaged = other.read_bytes()
    elif how == "garbage":
        damaged = os.urandom(len(data))
    elif how in ("rejected payload", "foreign stamp"):
        entry = entry_format.decode(data)
        payload = (
            b"not an executable " * 40
            if how == "rejected payload"
            else stamp(entry.payload, {"plugin_sha256": "0" * 64})
        )
        damaged = entry_format.encode(entry.key, entry.parts, entry.metadata, payload)
    else:
        raise ValueError(how)
    path.write_bytes(bytes(damaged))


def plant(
    cache_dir: Path, parts: dict[str, Any], payload: bytes, metadata: dict[str, Any] | None = None
) -> Path:
    """Writes an entry with a valid envelope (digests, key) around any payload; returns its path.

    What someone who can write the cache directory could do: the key is a
    hash of public facts, so they can file any machine code under it.
    """
    from worker.cache import entry as entry_format
    from worker.cache import key_of

    key = key_of(parts)
    path = cache_dir / "entries" / f"{key}.pjx"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(entry_format.encode(key, parts, metadata or {}, payload))
    return path


def without_compile_options(payload: bytes) -> bytes:
    """Returns a serialized executable with its compile options removed (its stamp kept).

    A plugin's is XLA's ExecutableAndOptionsProto; jaxlib's client's is the same after a
    header of its own (its length, as a varint, then the header). Both CPU plugins and
    jaxlib's client abort the process deserializing it ("Check failed: replica_count > 0"):
    a real entry that crashes every loader.
    """
    from worker.identity.options import read_varint

    header = b""
    tag, _ = read_varint(payload, 0)
    if tag & 7 != 2:  # no length-delimited field first: jaxlib's header precedes XLA's bytes
        length, offset = read_varint(payload, 0)
        header, payload = payload[: offset + length], payload[offset + length :]
    kept = bytearray(header)
    offset = 0
    while offset < len(payload):
        start = offset
        tag, offset = read_varint(payload, offset)
        assert tag & 7 == 2, "a serialized executable holds length-delimited fields"
        length, offset = read_varint(payload, offset)
        offset += length
        if tag >> 3 != 2:  # ExecutableAndOptionsProto.compile_options
            kept += payload[start:offset]
    return bytes(kept)


def replace_payload_keeping_signature(path: Path, payload: bytes) -> None:
    """Swaps a signed entry's payload, fixing every digest but keeping the old MAC.

    What someone without the secret can do to a signed entry: everything but
    a MAC that matches.
    """
    import hashlib
    import struct

    from worker.cache import entry as entry_format

    data = path.read_bytes()
    header = entry_format.decode_header(data)
    assert header.mac is not None, "the entry is not signed"
    fields = dict(header.fields, payload_size=len(payload))
    fields["payload_sha256"] = hashlib.sha256(payload).hexdigest()
    text = json.dumps(fields, sort_keys=True).encode()
    prefix = struct.pack(
        "<8sIII", entry_format.MAGIC, entry_format.FORMAT_VERSION, entry_format.SIGNED, len(text)
    )
    digest = hashlib.sha256(prefix + text).digest()
    path.write_bytes(prefix + text + digest + header.mac + payload)


def cpu_plugin_params() -> list[Any]:
    """pytest parameters for both CPU plugins: the default one, and xla-cpu-pjrt if installed."""
    import pytest  # not at the top: children import this module
    from conftest import DEFAULT_PLUGIN, SECOND_PLUGIN

    return [
        pytest.param(DEFAULT_PLUGIN, id="lammps-jax-pjrt-cpu"),
        pytest.param(
            SECOND_PLUGIN,
            id="xla-cpu-pjrt",
            marks=pytest.mark.skipif(SECOND_PLUGIN is None, reason="xla-cpu-pjrt is not installed"),
        ),
    ]
