"""pjrt-pool check-plugin: the conformance battery, its memo per plugin build, the warning."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import REPO, SECOND_PLUGIN, run_python
from jax import lax

from pool import Pool, compile_program, lower
from pool.cli.main import main
from pool.conformance import Case, battery, format_report, remember, run_cases, select
from pool.conformance.budgets import ELEMENTARY
from pool.conformance.type_probe import TypeProbe, element_types, probe_program
from worker.plugin.conformance_records import failing_cases, read_memo

ARCTAN = ["elementwise/arctan/float32/n64", "elementwise/atan2_const1/float32/n64"]
"""The default plugin miscompiles atan2(x, 1.0), which jnp.arctan lowers to, from ~50 elements
(lower() works around it; check-plugin --no-workarounds shows it)."""

SUBSET = [
    *ARCTAN,
    "elementwise/arctan/float32/n7",  # below the size where the miscompile shows
    "elementwise/atan2_const2/float32/n64",  # another constant: unaffected
    "elementwise/atan2/float32/n64",  # two arrays: unaffected
    "integer/bits/int32/n256",
    "convert/float32/to_float/n256",
    "sort/top_k/float32/n1000",
    "random/bits/uint32/n1000",
    "linalg/cholesky/float32/16x16",  # LAPACK: the second plugin cannot run it
]
"""The CI subset: the arctan miscompile, its neighbours, and one case of a few families."""


def test_jaxlibs_client_gives_jax_jits_outputs_bit_for_bit_where_checked(cache_dir, capsys):
    """The cpu platform runs on jaxlib's own client, jax.jit's XLA: --exact passes, every case
    bit for bit, and no XLA of another build is said."""
    assert main(["check-plugin", "--cases", ",".join(SUBSET), "--workers", "2", "--exact"]) == 0
    text = capsys.readouterr().out
    assert f"bit for bit: {len(SUBSET)} of {len(SUBSET)} compared cases" in text
    assert "XLA:" not in text and "runtime: jaxlib" in text


def test_float8_e5m2_programs_run(cache_dir):
    # ml_dtypes gives float8_e5m2 (alone of its types) the kind "f", which let it
    # reach the native module without its uint view: "cannot include dtype '5' in a buffer".
    x = np.arange(8, dtype=np.float32).astype(ml_dtypes.float8_e5m2)
    program = lower(lambda v: v + v, [x])
    executable, _ = compile_program(program)
    (out,) = executable.run([x])
    assert out.dtype == x.dtype and np.array_equal(out.astype(np.float32), 2 * np.arange(8))
    with Pool(1) as pool:
        (out,) = pool.run(program, [x])
    assert np.array_equal(out.astype(np.float32), 2 * np.arange(8))


def test_battery_names_are_stable_and_select_by_prefix():
    names = [case.name for case in battery()]
    assert len(names) == len(set(names)) and len(names) > 300
    assert all(name.count("/") == 3 for name in names)
    for family in ("elementwise", "compare", "integer", "convert", "reduction", "cumulative"):
        assert any(name.startswith(family + "/") for name in names)
    for family in ("dot", "conv", "indexing", "sort", "fft", "control", "random", "linalg"):
        assert any(name.startswith(family + "/") for name in names)
    arctan = [case.name for case in select(["elementwise/arctan"])]
    assert "elementwise/arctan/float32/n64" in arctan and all("/arctan/" in n for n in arctan)
    assert [c.name for c in select(["*/float16/*"])] and select(None) == list(battery())
    with pytest.raises(ValueError, match="no case matches"):
        select(["elementwise/no_such_op"])


def test_subset_passes_on_the_default_plugin_and_flags_arctan_without_workarounds(cache_dir):
    # As lower() writes the programs (with the workaround for this build): every case passes.
    report = run_cases(select(SUBSET), workers=2, platform="pjrt_cpu")
    assert report.ok, [(r.name, r.status, r.message) for r in report.failures]
    # Each element type the programs use was probed, once, and compiles on this plugin.
    used = set()
    for case in select(SUBSET):
        with jax.enable_x64(case.x64):
            used |= element_types(lower(case.function, case.make_inputs()).text)
    assert sorted(t.name for t in report.types) == sorted(np.dtype(d).name for d in used)
    assert all(t.supported for t in report.types) and not report.unsupported
    assert f"types: all {len(used)} element types the cases use compile here" in (
        format_report(report).splitlines()
    )
    assert report.workarounds == ("atan2-divisor-barrier",) and not report.workarounds_off
    assert report.plugin["api_version"] == "0.115"
    # Another build of XLA than jax.jit's: said, and its cases counted bit for bit.
    assert report.xla_note is not None and "the XLA of jaxlib 0.11.2" in report.xla_note
    text = format_report(report)
    assert f"XLA: {report.xla_note}" in text and "bit for bit: " in text
    memo = remember(report)
    assert memo is not None and memo.parent == cache_dir / "plugins"
    record = read_memo(cache_dir, report.plugin_sha256)
    assert failing_cases(record) == [] and record["workarounds"] == ["atan2-divisor-barrier"]
    assert record["cases"][ARCTAN[0]] == "pass"

    # As JAX writes them: the plugin's own miscompile.
    raw = run_cases(select(SUBSET), workers=2, workarounds=False, platform="pjrt_cpu")
    status = {r.name: r for r in raw.results}
    assert {n for n, r in status.items() if r.status != "pass"} == set(ARCTAN), [
        (r.name, r.status, r.message) for r in raw.results if r.status != "pass"
    ]
    wrong = status["elementwise/arctan/float32/n64"].outputs[0]
    assert not wrong.ok and wrong.max_error > 1e6 and wrong.bad > 10
    assert wrong.worst is not None and wrong.worst.inputs  # the input value is reported
    assert not raw.ok and raw.workarounds == () and raw.workarounds_off == report.workarounds
    # Not remembered: the record says how the build runs the programs lower() writes.
    assert remember(raw) is None
    assert failing_cases(read_memo(cache_dir, raw.plugin_sha256)) == []


@pytest.mark.slow
@pytest.mark.skipif(SECOND_PLUGIN is None, reason="xla-cpu-pjrt is not installed")
def test_subset_passes_on_the_second_plugin(tmp_path):
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pool.cli.main", "check-plugin", "--plugin", SECOND_PLUGIN),
            *("--cases", ",".join(SUBSET), "--workers", "2", "--json"),
        ],
        cwd=REPO,
        env={**os.environ, "PJRT_POOL_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    status = {case["name"]: case for case in report["cases"]}
    assert report["plugin"]["api_version"] == "0.81" and report["ok"]
    assert all(status[name]["status"] == "pass" for name in ARCTAN)
    skipped = status["linalg/cholesky/float32/16x16"]
    # jaxlib's LAPACK kernels (XLA FFI 0.3 and later) are refused by this plugin's XLA (0.2).
    assert skipped["status"] == "skipped" and "FfiVersionError" in skipped["message"]
    reason = "their kernels are built for a newer XLA FFI than the plugin's XLA takes"
    assert skipped["reason"] == reason
    assert report["summary"]["linalg"]["skipped"] == 1
    # The headline counts the skipped case and says why; it never says "all cases pass".
    passed = len(SUBSET) - 1
    assert report["headline"] == (
        f"{passed} of {len(SUBSET)} cases pass, none failed; 1 skipped (1: {reason})"
    )
    # The memo of this build records no failure.
    record = read_memo(tmp_path, report["plugin_sha256"])
    assert record["cases"]["linalg/cholesky/float32/16x16"] == "skipped"
    assert failing_cases(record) == []


def test_exit_codes_and_usage_errors(cache_dir, capsys, tmp_path):
    assert main(["check-plugin", "--cases", "elementwise/no_such_op"]) == 2
    assert "no case matches" in capsys.readouterr().err
    assert main(["check-plugin", "--workers", "0"]) == 2
    assert main(["check-plugin", "--plugin", "/no/such/plugin.so", "--cases", ARCTAN[0]]) == 2
    assert "no such file" in capsys.readouterr().err
    not_a_plugin = tmp_path / "not_a_plugin.so"
    not_a_plugin.write_bytes(b"not a shared library")
    # A file that is not a plugin is this machine's set-up: 2, as for every command.
    assert main(["check-plugin", "--plugin", str(not_a_plugin), "--cases", ARCTAN[0]]) == 2
    assert "did not start" in capsys.readouterr().err
    assert main(["check-plugin", "--list", "--cases", "elementwise/arctan/float32"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == [
        f"elementwise/arctan/float32/n{n}" for n in (7, 64, 4096)
    ]
    # Problems found: 1, with the failure's details in the report (the CPU plugin's bug).
    command = ["check-plugin", "--cases", ARCTAN[0], "--workers", "1", "--platform", "pjrt_cpu"]
    assert main([*command, "--no-workarounds"]) == 1
    text = capsys.readouterr().out
    assert "WRONG    elementwise/arctan/float32/n64" in text and "input" in text
    assert "1 case(s) FAILED" in text
    assert "workarounds: off; programs as JAX writes them, without atan2-divisor-barrier" in text
    assert "results not remembered" in text
    # Everything passes: 0 (the same case, with the workaround lower() applies).
    assert main([*command, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert report["workarounds"] == {"applied": ["atan2-divisor-barrier"], "off": []}


_WARN_CHECK = """
import warnings, numpy as np, jax.numpy as jnp
from pool import Pool, compile_program, lower
from worker.plugin.conformance_records import KnownPluginFailuresWarning
program = lower(jnp.sin, [np.zeros(4, np.float32)])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for call in [{calls}]:
        call()
        found = [w for w in caught if issubclass(w.category, KnownPluginFailuresWarning)]
        print(len(found))
for w in found:
    print(w.filename, "|", w.message)
"""
COMPILE = "lambda: compile_program(program)"
POOL = "lambda: Pool(1).close()"


@pytest.mark.slow
def test_known_failures_warn_once_per_process(cache_dir):
    from worker.plugin.conformance_records import write_memo
    from worker.plugin.locate import find_plugin

    # No record yet: no warning (the known failures of the default build are worked around),
    # and the parent of a Pool does not hash the plugin (lower() does, for its workarounds).
    assert run_python(_WARN_CHECK.format(calls=POOL)).stdout.splitlines()[0] == "0"
    done = run_python(
        "from pool import Pool\nPool(1).close()\nfrom worker.identity.build import _file_memo\n"
        "print(sorted(kind for kind, _ in _file_memo))\n"
    )
    assert done.stdout.strip() == "[]"

    path = find_plugin("cpu").path
    from worker.cache import open_cache
    from worker.identity.build import plugin_digest

    write_memo(
        None,
        plugin_sha256=plugin_digest(path, open_cache().memos),
        platform="cpu",
        path=path,
        jax_version="test",
        outcomes={ARCTAN[0]: "wrong", "integer/bits/int32/n256": "pass"},
    )
    # compile_program warns on its first call, then neither it nor a Pool again.
    lines = run_python(_WARN_CHECK.format(calls=f"{COMPILE}, {COMPILE}, {POOL}")).stdout
    counts, (warning,) = lines.splitlines()[:3], lines.splitlines()[3:]
    assert counts == ["1", "1", "1"]
    filename, message = warning.split(" | ", 1)
    assert filename == "<string>"  # the caller's line, not pjrt-pool's
    assert ARCTAN[0] in message and "integer/bits" not in message
    assert f"pjrt-pool check-plugin --platform cpu --plugin {path}" in message
    assert "PJRT_POOL_PLUGIN_CPU" in message
    # A Pool alone warns too (about the plugin its workers report), once.
    lines = run_python(_WARN_CHECK.format(calls=f"{POOL}, {POOL}")).stdout.splitlines()
    assert lines[:2] == ["1", "1"] and lines[2].startswith("<string> | ")


def test_memo_merges_runs_and_forgets_fixed_cases(cache_dir):
    from worker.plugin.conformance_records import write_memo

    digest = "ab" * 32
    names = frozenset({"a/b/c/d", "a/b/c/e"})
    common = {"plugin_sha256": digest, "platform": "cpu", "path": "/p.so", "jax_version": "x"}
    write_memo(None, **common, outcomes={"a/b/c/d": "wrong", "a/b/c/e": "crash"}, known_cases=names)
    write_memo(
        None, **common, outcomes={"a/b/c/d": "pass", "gone/x/y/z": "wrong"}, known_cases=names
    )
    record = read_memo(cache_dir, digest)
    assert record["cases"] == {"a/b/c/d": "pass", "a/b/c/e": "crash"}
    assert failing_cases(record) == ["a/b/c/e"]
    (cache_dir / "plugins" / f"conformance-{digest}.json").write_text("{not json")
    assert read_memo(cache_dir, digest) is None  # unreadable: nothing known, no error


def _slow_case(name: str, iterations: int) -> Case:
    """A loop of about a second per 3e8 iterations, the same on the plugin and in jax.jit."""
    return Case(
        name,
        lambda n, x: lax.fori_loop(0, n[0], lambda i, v: v * 0.999999 + 1e-3, x),
        lambda rng: [np.int32([iterations]), np.zeros(8, np.float32)],
        ELEMENTARY,
    )


def _quick_case() -> Case:
    return Case("test/quick/float32/n8", jnp.cos, lambda rng: [np.ones(8, np.float32)], ELEMENTARY)


def _kill_busy_worker(sig: int) -> threading.Thread:
    """Kills the pool worker this process starts next once it has run 1 s of CPU with its
    plugin loaded: it is running the loop.

    Counting from the plugin's load leaves out the start-up (imports, hashing the
    plugin), which on a loaded machine can take more than a second of CPU;
    compiling the loop takes a fraction of that. Workers that ran before the
    call are left alone.
    """

    def workers() -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                command = Path(f"/proc/{entry}/cmdline").read_bytes()
            except (OSError, IndexError):
                continue
            if int(stat[1]) == os.getpid() and command.split(b"\0")[2:4] == [b"-m", b"worker"]:
                pids.append(int(entry))
        return pids

    def cpu_seconds(pid: int) -> float:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")

    def plugin_loaded(pid: int) -> bool:
        return "pjrt_c_api_cpu_plugin" in Path(f"/proc/{pid}/maps").read_text()

    earlier = set(workers())
    loaded_at: dict[int, float] = {}  # worker: its CPU seconds when its plugin was first seen

    def kill() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for pid in set(workers()) - earlier:
                try:
                    if pid not in loaded_at:
                        if plugin_loaded(pid):
                            loaded_at[pid] = cpu_seconds(pid)
                    elif cpu_seconds(pid) - loaded_at[pid] > 1.0:
                        os.kill(pid, sig)
                        return
                except OSError:
                    continue
            time.sleep(0.02)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_crash_or_hang_fails_its_case_only(cache_dir):
    # On the CPU plugin, whose library _kill_busy_worker watches for (cpu is jaxlib's client).
    killer = _kill_busy_worker(signal.SIGSEGV)
    slow = _slow_case("test/crash/float32/n8", 1_500_000_000)
    report = run_cases([slow, _quick_case()], workers=1, platform="pjrt_cpu")
    killer.join(5)
    crashed, quick = report.results
    assert crashed.status == "crash" and "SIGSEGV" in crashed.message, crashed
    assert quick.status == "pass"

    slow = _slow_case("test/hang/float32/n8", 600_000_000)
    report = run_cases([slow, _quick_case()], workers=1, timeout=0.3, platform="pjrt_cpu")
    hung, quick = report.results
    assert hung.status == "timeout" and "did not finish within 0.3 s" in hung.message, hung
    assert quick.status == "pass"


@pytest.mark.slow
@pytest.mark.skipif(SECOND_PLUGIN is None, reason="xla-cpu-pjrt is not installed")
def test_a_process_holding_another_plugin_is_told_to_use_a_fresh_one():
    done = run_python(
        f"""
        import numpy as np, jax.numpy as jnp
        from pool import compile_program, lower
        from pool.conformance import CheckError, run_cases, select
        compile_program(lower(jnp.sin, [np.zeros(4, np.float32)]))  # the default plugin
        try:
            run_cases(select(["{ARCTAN[0]}"]), plugin={SECOND_PLUGIN!r}, workers=1)
        except CheckError as error:
            print("refused:", error)
        """
    )
    assert "refused:" in done.stdout and "from a fresh process" in done.stdout


def test_warning_reads_the_record_of_the_file_it_is_given(cache_dir, tmp_path):
    import hashlib

    from worker.plugin.conformance_records import (
        KnownPluginFailuresWarning,
        warn_known_failures,
        write_memo,
    )

    library = tmp_path / "plugin.so"
    library.write_bytes(b"a plugin build")
    digest = hashlib.sha256(b"a plugin build").hexdigest()
    common = {"plugin_sha256": digest, "platform": "cpu", "path": str(library), "jax_version": "x"}
    memo = write_memo(None, **common, outcomes={"a/b/c/d": "timeout"})
    with pytest.warns(KnownPluginFailuresWarning, match="a/b/c/d"):
        warn_known_failures(str(library), cache_dir)
    # A damaged record (valid JSON, wrong types) is ignored, never raised.
    record = json.loads(memo.read_text())
    record["checked"] = "yesterday"
    memo.write_text(json.dumps(record))
    copy = tmp_path / "copy.so"
    copy.write_bytes(b"a plugin build")  # the same build at another path: looked at afresh
    warn_known_failures(str(copy), cache_dir)


def test_jaxs_side_computed_in_a_process_of_its_own_is_what_it_computes_here():
    """check-plugin runs jax.jit's side in a process of its own (one for the battery): the
    same outputs as jax.jit here, per case, battery cases sent by name and others by value."""
    from pool.conformance.reference_side import ReferenceSide
    from pool.conformance.references import reference, reference_device

    cases = [*select(["elementwise/sin/float32", "dot/matmul/float64", "sort"])[:8], _quick_case()]
    with ReferenceSide("cpu", timeout=60) as references:
        references.start()
        found = [references.submit(case) for case in cases]
        outputs = [future.result() for future in found]
        assert references.processes_started == 1 and references.device == "cpu:0"
    device = reference_device("cpu")
    for case, got in zip(cases, outputs, strict=True):
        with jax.enable_x64(case.x64):
            expected = reference(case, case.make_inputs(), device)
        assert len(got) == len(expected)
        for one, want in zip(got, expected, strict=True):
            assert one.dtype == want.dtype
            np.testing.assert_array_equal(one, want)


def _reference_aborts(name: str) -> Case:
    """A case whose jax.jit side aborts its process (SIGABRT, as libtpu's failed checks do):
    its function aborts when traced in any process but this one, which lowers it for the
    plugin."""
    here = os.getpid()

    def function(x):
        if os.getpid() != here:
            os.abort()
        return jnp.cos(x)

    return Case(name, function, lambda rng: [np.ones(8, np.float32)], ELEMENTARY)


def _reference_hangs(name: str) -> Case:
    """A case whose jax.jit side never finishes (it sleeps while traced elsewhere)."""
    here = os.getpid()

    def function(x):
        if os.getpid() != here:
            time.sleep(3600)
        return jnp.sin(x)

    return Case(name, function, lambda rng: [np.ones(8, np.float32)], ELEMENTARY)


@pytest.mark.slow
def test_a_crash_or_hang_on_jaxs_side_costs_its_case_only(cache_dir):
    """jax.jit's side runs in a process of its own: a case that aborts it, or hangs it, gets a
    status of its own (not the plugin's failure), the process is started again, and the
    cases after it are checked as usual."""
    cases = [
        _quick_case(),
        _reference_aborts("test/reference_abort/float32/n8"),
        *select(["elementwise/sin/float32/n64", "integer/bits/int32/n256"]),
        _reference_hangs("test/reference_hang/float32/n8"),
        *select(["sort/top_k/float32/n1000"]),
    ]
    report = run_cases(cases, workers=2, timeout=12)
    status = {r.name: r for r in report.results}
    aborted = status["test/reference_abort/float32/n8"]
    assert aborted.status == "reference crash", aborted
    assert "was killed by SIGABRT (signal 6)" in aborted.message, aborted.message
    hung = status["test/reference_hang/float32/n8"]
    assert hung.status == "reference timeout", hung
    assert "did not finish within 12 s" in hung.message
    others = [r for r in report.results if not r.name.startswith("test/reference_")]
    assert [r.status for r in others] == ["pass"] * 4, others
    # One process at first, one more after the crash, one more after the hang.
    assert report.reference_processes == 3 and report.reference_device == "cpu:0"
    assert not report.ok and len(report.failures) == 2
    text = format_report(report)
    assert "REFERENCE CRASH test/reference_abort/float32/n8: the process that runs jax.jit" in text
    assert "(started again 2 time(s), after a crash or a hang)" in text
    assert "2 case(s) FAILED (2 unchecked: jax.jit's side failed), 4 of 6 pass" in text
    # Not the plugin's failure: the build's record names no failing case.
    memo = remember(report)
    assert memo is not None and failing_cases(read_memo(cache_dir, report.plugin_sha256)) == []


@pytest.mark.slow
def test_a_crash_among_several_cases_in_flight_is_charged_to_its_case():
    """With several cases compiling at once in jax.jit's process (an exclusive device's check
    runs them so, after the pool), a crash says nothing of which one did it: the cases in
    flight are sent again one at a time, and only the one that crashes alone is charged."""
    from pool.conformance.reference_side import JaxSideError, ReferenceSide

    cases = [
        _quick_case(),
        _reference_aborts("test/abort/float32/n8"),
        *select(["elementwise/sin/float32/n64", "elementwise/exp/float32/n64"]),
    ]
    with ReferenceSide("cpu", timeout=60, threads=4) as references:
        futures = [references.submit(case) for case in cases]
        references.start()
        concurrent.futures.wait(futures)
        started = references.processes_started
    crashed = futures[1].exception()
    assert isinstance(crashed, JaxSideError) and crashed.status == "reference crash"
    assert all(f.exception() is None and f.result() for i, f in enumerate(futures) if i != 1)
    assert 2 <= started <= 3  # a crash alone, or one among others and once more alone


def test_each_type_probe_names_its_type_and_compiles_on_the_cpu():
    """The probe of every type pjrt-pool passes: its program's StableHLO names the type (so
    the names read off a case's module map to every dtype), and it compiles on the CPU."""
    from worker.dtypes import supported_dtypes

    for dtype in supported_dtypes():
        assert dtype in element_types(probe_program(dtype, "cpu").text), dtype
    with Pool(2) as pool:
        probe = TypeProbe(pool, "cpu", 60, str)
        probe.ask(supported_dtypes())
        probe.ask(supported_dtypes())  # asked once only
        found = probe.outcomes()
    assert [t.name for t in found] == sorted(np.dtype(d).name for d in supported_dtypes())
    assert [t.name for t in found if not t.supported] == []


def test_the_report_says_once_per_type_what_the_plugin_does_not_compile():
    """The text report's lines for an unsupported type (one line each, with the probe's
    failure and how many cases need it), and the headline; unsupported cases fail nothing."""
    from pool.conformance import CaseResult, CheckReport
    from pool.conformance.report import report_json
    from pool.conformance.type_probe import TypeSupport

    why = "the worker was killed by SIGABRT (signal 6); its output ends with: Unsupported CVT"
    needing = ("convert/int32/to_float/n256", "elementwise/add/complex128/n64")
    results = [
        CaseResult(n, "unsupported", "...", "needs complex128", unsupported_types=("complex128",))
        for n in needing
    ] + [CaseResult("elementwise/add/float32/n64", "pass")]
    report = CheckReport(
        platform="tpu",
        plugin={"path": "/lib/libtpu.so", "api_version": "0.112"},
        plugin_sha256="ab" * 32,
        jax_version="jax 0.10.2, jaxlib 0.10.2",
        results=results,
        seconds=1.0,
        workers=2,
        types=[
            TypeSupport(np.dtype("complex128"), False, why),
            TypeSupport(np.dtype("float32"), True),
        ],
        reference_device="TPU_0",
        reference_processes=1,
    )
    lines = format_report(report).splitlines()
    assert "types: 1 of the 2 element types the cases use compile here" in lines
    assert (
        "unsupported here: complex128: 2 case(s) need it, not run (--cases runs them anyway); "
        f"its probe: {why}"
    ) in lines
    assert not any(name in line for line in lines for name in needing)  # said once, per type
    assert report.ok and lines[-1].startswith(
        "1 of 3 cases pass, none failed; 2 unsupported here (2: needs complex128)"
    )
    assert json.loads(report_json(report))["types"] == {"complex128": why, "float32": "supported"}


@pytest.mark.slow
def test_a_cpu_check_never_loads_libtpu(tmp_path: Path) -> None:
    """Issue 63: with the tpu extra installed, check-plugin --platform cpu loaded libtpu for
    JAX's side, whose start on a machine without a TPU logs "E0000 ... unexpected worker
    hostname"; JAX's side of a CPU check is the CPU's alone."""
    pytest.importorskip("libtpu", reason="needs libtpu (pip install -e '.[tpu]')")
    done = run_python(
        f"""
        import sys
        from pool.cli.main import main

        code = main(["check-plugin", "--platform", "cpu", "--workers", "1", "--cache-dir",
                     {str(tmp_path)!r}, "--case", "elementwise/atan2_const1/float32/n64"])
        loaded = any("libtpu" in line for line in open("/proc/self/maps"))
        print("exit", code, "libtpu loaded:", loaded)
        """,
        env={"JAX_PLATFORMS": ""},
        timeout=300,
    )
    assert "exit 0 libtpu loaded: False" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "unexpected worker hostname" not in done.stderr
