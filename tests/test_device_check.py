"""tools/device_check.py rehearses on CPU: every step runs and its summary says all is right.

On a GPU machine the same script measures the CUDA figures of docs/performance.md;
here it must at least run end to end, so that the one-shot device run does
not fail on a mistake CI could have caught.
"""

from __future__ import annotations

import json

import pytest
from conftest import DEFAULT_PLUGIN, run_tool


@pytest.mark.slow
def test_device_check_quick_rehearsal_on_cpu():
    plugin = {"PJRT_POOL_PLUGIN_CPU": DEFAULT_PLUGIN} if DEFAULT_PLUGIN else {}
    arguments = ("--platform", "cpu", "--quick", "--rounds", "2")
    done = run_tool("device_check.py", *arguments, timeout=300, env=plugin)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["platform"] == "cpu" and summary["programs"] == 5
    assert summary["in_process"]["ok"] == 5 and summary["tolerance"]["max_relative_error"] <= 1e-3
    assert summary["serial_jax"]["compile_s"] > 0
    for stage in [*summary["pools"], summary["slots_off"], summary["warm_autotune"]]:
        assert stage["ok"] == 5 and not stage["compile_failures"], stage
        assert stage["compiled"] == 5 and stage["phases"]["compiled"] == 5
        assert stage["startup"]["workers"] == stage["workers"]
    assert summary["slots_off"]["compile_slots"] is None
    crash = summary["crash_isolation"]
    assert crash["killed_task_failed_as_crash"], crash
    assert crash["others_ok"] == crash["others_total"] == 5
    assert summary["rounds"]["failures_per_round"] == [0, 0]
    assert set(summary["tiny_round_trip"]) == {"in_process_us", "pool_us", "jax_jit_us"}
    assert summary["budget"]["skipped"] == []
