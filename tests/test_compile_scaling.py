"""What makes parallel compiles measurable and scalable on a GPU host (issue 11, items 2 and 4).

Per-phase timing of compiles and start-ups (worker.phases), a machine-wide
cap on concurrent compiles (worker.compile.slots) and XLA's per-fusion autotune
results shared through the cache directory (worker.plugin.startup). The GPU effects
are measured by tools/device_check.py; here the mechanisms run on the CPU
plugin, with real processes, files and locks.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_PLUGIN, REPO, run_python

from pool import Pool, compile_program, lower
from worker.compile.slots import SLOTS_ENV, compile_slots, slots_dir
from worker.phases import PHASE_LOG_ENV, last_phases, process_phases
from worker.plugin.startup import AUTOTUNE_FLAG, share_autotune_results


def _records(path: Path, kind: str | None = None) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if kind is None or r["kind"] == kind]


def _program(factor: float):
    return lower(lambda x: jnp.tanh(x * factor), [jax.ShapeDtypeStruct((16,), jnp.float32)])


def test_compile_program_logs_where_its_time_went(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    log = tmp_path / "phases.jsonl"
    monkeypatch.setenv(PHASE_LOG_ENV, str(log))
    program = _program(1.25)
    before = process_phases().get("compile", 0.0)
    compile_program(program)
    compile_program(program)
    compiled, loaded = _records(log, "compile")
    assert compiled["kind"] == "compile" and compiled["outcome"] == "compiled"
    assert compiled["program"] == program.name and compiled["pid"] == os.getpid()
    for phase in ("key", "lookup", "lock_wait", "slot_wait", "compile", "serialize", "publish"):
        assert compiled[phase] >= 0.0, phase
    assert loaded["outcome"] == "loaded" and loaded["cache_key"] == compiled["cache_key"]
    assert "compile" not in loaded and loaded["lookup"] >= 0.0
    assert set(last_phases()) == {"key", "lookup"}  # the load, this thread's last compile_program
    assert process_phases()["compile"] > before


def _environment_check(cache_dir: str):
    def check() -> None:  # a closure: cloudpickle sends it by value to the workers
        found = os.environ.get("PJRT_POOL_CACHE_DIR")
        if found != cache_dir:
            raise AssertionError(f"the worker's cache directory is {found}, not {cache_dir}")

    return check


def test_pool_workers_log_start_up_and_compile_phases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    log = tmp_path / "phases.jsonl"
    monkeypatch.setenv(PHASE_LOG_ENV, str(log))
    cache = tmp_path / "pool-cache"
    with Pool(2, cache_dir=cache, initializer=_environment_check(str(cache))) as pool:
        pids = {info["pid"] for info in pool.worker_info}
        pool.compile_many([_program(2.0), _program(3.0)])
    records = _records(log)
    startups = [r for r in records if r["kind"] == "startup"]
    assert {r["pid"] for r in startups} == pids
    for record in startups:
        for phase in ("spawn_to_main", "plugin_load", "client"):
            assert record[phase] >= 0.0, (phase, record)
    compiles = [r for r in records if r["kind"] == "compile"]
    assert sorted(r["outcome"] for r in compiles) == ["compiled", "compiled"]
    assert {r["pid"] for r in compiles} <= pids


def test_compile_slots_default_to_a_cap_on_gpu_platforms_only(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(SLOTS_ENV, raising=False)
    assert compile_slots("cpu") is None
    assert compile_slots("cuda") == max(1, (os.cpu_count() or 1) // 4)
    monkeypatch.setenv(SLOTS_ENV, "3")
    assert compile_slots("cpu") == compile_slots("cuda") == 3
    monkeypatch.setenv(SLOTS_ENV, "0")
    assert compile_slots("cuda") is None


@pytest.mark.parametrize("value", ["many", "-1", "1.5"])
def test_a_bad_slot_count_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, value: str):
    monkeypatch.setenv(SLOTS_ENV, value)
    with pytest.raises(ValueError, match=SLOTS_ENV):
        compile_program(_program(4.0 + len(value)))


_HOLD_A_SLOT = """
    import sys
    from worker.compile.slots import compile_slot

    with compile_slot("cpu"):
        print("held", flush=True)
        sys.stdin.readline()
"""

_COMPILE = """
    import jax, jax.numpy as jnp, numpy as np
    from pool import compile_program, lower

    program = lower(lambda x: x * 5.0 + 1.0, [jax.ShapeDtypeStruct((4,), jnp.float32)])
    print("compiling", flush=True)
    executable, statistics = compile_program(program)
    (out,) = executable.run([np.arange(4, dtype=np.float32)])
    assert statistics.compiled == 1 and np.allclose(out, np.arange(4) * 5.0 + 1.0)
    print("done", flush=True)
"""


def _child(code: str, env: dict[str, str]) -> subprocess.Popen[str]:
    environment = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environment,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_compile_waits_for_a_slot_held_by_another_process(tmp_path: Path):
    """One slot: a compile in another process waits while a process holds it, then runs."""
    env = {SLOTS_ENV: "1", PHASE_LOG_ENV: str(tmp_path / "phases.jsonl")}
    if DEFAULT_PLUGIN:
        env["PJRT_POOL_PLUGIN_CPU"] = DEFAULT_PLUGIN
    holder = _child(_HOLD_A_SLOT, env)
    compiler = None
    try:
        assert holder.stdout.readline().strip() == "held"
        compiler = _child(_COMPILE, env)
        assert compiler.stdout.readline().strip() == "compiling"
        time.sleep(1.0)
        assert compiler.poll() is None, "compiled while the only slot was held elsewhere"
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(30) == 0
        assert compiler.stdout.readline().strip() == "done"
        assert compiler.wait(30) == 0
    finally:
        for process in (holder, compiler):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    (record,) = _records(tmp_path / "phases.jsonl", "compile")
    assert record["outcome"] == "compiled" and record["slot_wait"] > 0.0


def test_a_killed_slot_holder_frees_its_slot(tmp_path: Path):
    env = {SLOTS_ENV: "1"}
    holder = _child(_HOLD_A_SLOT, env)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    if DEFAULT_PLUGIN:
        env["PJRT_POOL_PLUGIN_CPU"] = DEFAULT_PLUGIN
    assert "done" in run_python(_COMPILE, env=env, timeout=60).stdout


def test_the_slot_directory_is_private():
    directory = slots_dir("cpu")
    for folder in (directory.parent, directory):
        info = folder.lstat()
        assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
        assert info.st_mode & 0o077 == 0


def test_autotune_results_are_shared_only_for_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_dir: Path
):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/somewhere")
    assert share_autotune_results("cpu") is None
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/somewhere"

    # The CPU plugin's XLA (jaxlib 0.11.2's) knows the GPU flag: use it as the "CUDA" plugin.
    assert DEFAULT_PLUGIN is not None
    monkeypatch.setenv("PJRT_POOL_PLUGIN_CUDA", DEFAULT_PLUGIN)
    directory = share_autotune_results("cuda")
    assert directory is not None and directory.parent == cache_dir / "autotune"
    assert directory.is_dir() and directory.stat().st_mode & 0o077 == 0
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/somewhere --{AUTOTUNE_FLAG}={directory}"

    # Set up once: a second call (or the user's own flag) leaves XLA_FLAGS alone.
    assert share_autotune_results("cuda") is None
    monkeypatch.setenv("XLA_FLAGS", f"--{AUTOTUNE_FLAG}=")
    assert share_autotune_results("cuda") is None
    assert os.environ["XLA_FLAGS"] == f"--{AUTOTUNE_FLAG}="


def test_no_autotune_flag_for_a_plugin_that_does_not_know_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """An older XLA aborts on a flag it does not know: only a plugin that has it gets it."""
    plugin = tmp_path / "jax_plugins" / "xla_cuda12" / "xla_cuda_plugin.so"
    plugin.parent.mkdir(parents=True)
    plugin.write_bytes(b"\x7fELF an old plugin without the flag")
    monkeypatch.setenv("PJRT_POOL_PLUGIN_CUDA", str(plugin))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert share_autotune_results("cuda") is None
    assert "XLA_FLAGS" not in os.environ


@pytest.mark.parametrize("flag", [AUTOTUNE_FLAG, "xla_gpu_no_such_flag_for_pjrt_pool"])
def test_xla_aborts_on_flags_its_plugin_does_not_have(tmp_path: Path, flag: str):
    """Why the flag is added only to plugins whose binary names it (jaxlib 0.11.2's XLA has it)."""
    plugin = DEFAULT_PLUGIN
    assert plugin is not None
    has_flag = flag.encode() in Path(plugin).read_bytes()
    code = """
        import numpy as np, jax, jax.numpy as jnp
        from pool import compile_program, lower
        program = lower(lambda x: x + 1.0, [jax.ShapeDtypeStruct((3,), jnp.float32)])
        (out,) = compile_program(program)[0].run([np.zeros(3, np.float32)])
        assert np.allclose(out, 1.0)
    """
    env = {"PJRT_POOL_PLUGIN_CPU": plugin, "XLA_FLAGS": f"--{flag}={tmp_path}"}
    done = run_python(code, env=env, check=False)
    assert (done.returncode == 0) == has_flag, done.stderr[-2000:]
    if not has_flag:
        assert "Unknown flag in XLA_FLAGS" in done.stderr


def test_outputs_stay_right_with_one_compile_slot(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(SLOTS_ENV, "1")
    programs = [_program(f) for f in (5.0, 6.0, 7.0, 8.0)]
    x = np.linspace(-1, 1, 16, dtype=np.float32)
    with Pool(2) as pool:
        pool.compile_many(programs)
        for factor, program in zip((5.0, 6.0, 7.0, 8.0), programs, strict=True):
            (out,) = pool.run(program, [x])
            np.testing.assert_allclose(out, np.tanh(x * factor), rtol=1e-6)
