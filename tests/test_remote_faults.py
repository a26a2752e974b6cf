"""The remote tier under faults (issue 43): a missing bucket, planted and orphaned leases,
limits out of range, damage that must be mended, what gc cannot read, links in a file://
remote, and the errors a user meets on the command line.

Hosts are child processes (test_remote_cache.HOST) or RemoteCache objects in this process;
the remote is moto's S3 server on the loopback or a file:// directory (the `remote`
fixture). Every child is waited for with a timeout, so that a stall fails, never hangs.
"""

from __future__ import annotations

import pytest
from cache_helpers import load_program, lowered

import worker

LEASE_ENV = "PJRT_POOL_CACHE_REMOTE_LEASE"


def key_of_program(path: str) -> str:
    """The cache key a host computes for a saved program (this process's plugin)."""
    return worker.program_key(load_program(path), worker.get_runtime("cpu"), None)[0]


def damaged(data: bytes) -> bytes:
    """data with one byte flipped near its end: the same size, another SHA-256."""
    return data[:-7] + bytes([data[-7] ^ 0x10]) + data[-6:]


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
