"""Many threads, mixed tasks, one pool: tools/stress_pool.py at a size fit for CI."""

from __future__ import annotations

import json

import pytest
from conftest import run_tool


@pytest.mark.slow
def test_eight_threads_of_mixed_tasks_are_all_right_and_leave_nothing_behind() -> None:
    done = run_tool("stress_pool.py", "--tasks", "400", timeout=600)
    summary = json.loads(done.stdout)
    assert summary["checks"] == dict.fromkeys(summary["checks"], True), summary
    assert summary["results"] == summary["tasks"] == 8 * 400
    assert done.returncode == 0
