"""`pjrt-pool warm --ray` and `pjrt-pool run --ray`: a local Ray cluster started for the run,
and a head that does not answer (one clear error, at once)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")

from conftest import CLI_COMMAND, repo_environment

from pool.cluster import connect_ray
from pool.cluster.ray.local import LOOPBACK

SPEC = (
    "import jax, jax.numpy as jnp\n"
    "def programs():\n"
    "    s = [jax.ShapeDtypeStruct((8,), jnp.float32)]\n"
    "    return [(f'p{i}', (lambda i: lambda x: x * i + 1)(i), s) for i in range(6)]\n"
)


def _cli(*words: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI_COMMAND, *words],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=repo_environment(empty_unsets=False),
        check=False,
    )


def _silent_address() -> str:
    """A loopback address where nothing listens (its port was free a moment ago)."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return f"{LOOPBACK}:{probe.getsockname()[1]}"


def test_a_head_that_does_not_answer_is_one_clear_error(tmp_path: Path) -> None:
    address = _silent_address()
    started = time.monotonic()
    with (
        pytest.raises(ConnectionError, match=f"no Ray head answers at {address}"),
        connect_ray(address),
    ):
        pass
    assert time.monotonic() - started < 15
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    for words in (
        ["warm", str(spec), "--ray", address],
        ["warm", str(spec), "--ray", "local:none"],
    ):
        done = _cli(*words, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, done.stderr[-3000:]
        assert len(lines) == 1 and lines[0].startswith(f"pjrt-pool warm: --ray {words[-1]}: ")
    done = _cli("warm", str(spec), "--ray", address, "--scheduler", "local:2")
    assert done.returncode == 2 and "not allowed with argument" in done.stderr


@pytest.mark.slow
def test_warm_and_run_on_a_local_ray_cluster(tmp_path: Path) -> None:
    before = _local_clusters()  # other clusters of this machine's, which are not this test's
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    cache, manifest = tmp_path / "cache", tmp_path / "m.json"
    common = ["--workers", "1", "--cache-dir", str(cache)]
    done = _cli(
        "warm", str(spec), "--ray", "local:2", *common, "--json", "--manifest", str(manifest)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["counts"] == {"compiled": 6}
    inputs = tmp_path / "x.npy"

    np.save(inputs, np.arange(8, dtype=np.float32))
    done = _cli("run", str(manifest), "p3", "--ray", "local:1", "--batch", str(inputs), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["counts"] == {"ran": 1, "failed": 0} and report["ray"] == "local:1"
    assert report["runs"][0]["outputs"][0]["sum"] == float((np.arange(8) * 3 + 1).sum())
    # Nothing of the local clusters outlived the commands: no process of theirs, no directory.
    assert _local_clusters() <= before


def _local_clusters() -> set[str]:
    """The local Ray clusters' directories (LocalRayCluster's) on this machine, and those
    that processes name (a node's processes name its directory on their command lines)."""
    found = {str(path) for path in Path("/tmp").glob("pjrt-ray-*")}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for word in _cmdline(int(pid)).split():
            if "/tmp/pjrt-ray-" in word:
                found.add("/tmp/pjrt-ray-" + word.split("/tmp/pjrt-ray-")[1].split("/")[0])
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
