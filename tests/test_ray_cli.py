"""`pjrt-pool warm --ray` and `pjrt-pool run --ray` with a head that does not answer: one clear
error, at once. (Against a cluster: tests/test_ray.py; with local:N, docs/ray.md's example.)"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

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
