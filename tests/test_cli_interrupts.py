"""Ctrl-C during `pjrt-pool warm`: exit 130, never an abort, a report of what was warmed (issue 42);
and SIGINT or SIGTERM at any moment of a command, start-up included (issue 63).

Each test runs the real command in its own process group, as a terminal runs
a job, and interrupts it as a terminal's Ctrl-C does: SIGINT to the group (or
SIGTERM, what a CI job's timeout sends). Then: the exit status is 130 (143),
nothing aborted, no traceback, no worker outlives the command, the cache
verifies, and the output says what was warmed.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CLI_COMMAND, pjrt_pool, printed, repo_environment, run_python

EXAMPLE_SPEC = "pool.examples:programs"

# Lowering "busy" keeps the lowering thread in jaxlib's native code for about 3 s
# (a spec that computes constants as it traces, eagerly); it touches MARK first.
BUSY_SPEC = """
import os, time
import jax, jax.numpy as jnp

def busy(x):
    open(os.environ["MARK"], "w").close()
    with jax.ensure_compile_time_eval():
        a = jnp.ones((1000, 1000), jnp.float32)
        end = time.monotonic() + 3
        while time.monotonic() < end:
            (a @ a).block_until_ready()
    return x + 1

def programs():
    shape = [jax.ShapeDtypeStruct((4,), jnp.float32)]
    named = {{"first": lambda x: x * 2, "busy": busy, "last": lambda x: x - 1}}
    return [(name, named[name], shape) for name in {order!r}]
"""

PIPES = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
ABORTED = re.compile(r"terminate called|FATAL|Fatal Python error|Traceback")
SUMMARY = re.compile(r"^interrupted after [\d.]+ s: (?:(\d+) compiled, )?(\d+) not compiled$")


def start(*arguments: str, env: dict[str, str], **streams) -> subprocess.Popen:
    """`pjrt-pool ARGUMENTS` in a process group of its own, as a terminal's job."""
    environment = repo_environment(env, empty_unsets=False)
    return subprocess.Popen(
        [*CLI_COMMAND, *arguments], env=environment, start_new_session=True, text=True, **streams
    )


def ctrl_c(process: subprocess.Popen) -> None:
    """What a terminal's Ctrl-C does: SIGINT to the foreground job's process group."""
    os.killpg(process.pid, signal.SIGINT)


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, "the command ended before it got there"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def workers_of(cache: Path) -> list[str]:
    """The command lines of live worker processes of this cache directory (python -m worker)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            words = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(cache).encode() in words and b"worker" in words and state != "Z":
            found.append(b" ".join(words).decode(errors="replace"))
    return found


def assert_stopped_cleanly(code: int, stderr: str, cache: Path) -> None:
    """Exit 130, no abort or traceback, no worker left, and a cache that verifies."""
    assert code == 130 and not ABORTED.search(stderr), f"exit {code}\n{stderr[-3000:]}"
    deadline = time.monotonic() + 2  # the workers were reaped before the exit: no grace needed
    while workers_of(cache) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workers_of(cache) == []
    verified = pjrt_pool("cache", "verify", "--cache-dir", str(cache))
    assert verified.returncode == 0, verified.stdout  # 1 for any bad or unreadable entry


@pytest.mark.parametrize(
    ("order", "warmed"), [(["first", "busy", "last"], ["first"]), (["busy", "first", "last"], [])]
)
def test_ctrl_c_while_a_program_is_lowered_exits_130_without_an_abort(
    tmp_path: Path, order: list[str], warmed: list[str]
) -> None:
    """The reproduction of issue 42's abort, every time: the lowering thread is in jaxlib's
    native code when the Ctrl-C comes (it exited 134: "terminate called after throwing an
    instance of ''", "FATAL: exception not rethrown")."""
    spec, mark, cache, manifest = (tmp_path / n for n in ("spec.py", "mark", "cache", "m.json"))
    spec.write_text(BUSY_SPEC.format(order=order))
    command = ("warm", str(spec), "--cache-dir", str(cache), "--manifest", str(manifest))
    process = start(*command, env={"MARK": str(mark)}, **PIPES)
    wait_for(mark, process)
    time.sleep(0.3)  # well inside the 3 s of native code
    ctrl_c(process)
    stdout, stderr = process.communicate(timeout=120)
    assert_stopped_cleanly(process.returncode, stderr, cache)
    summary = SUMMARY.match(stdout.splitlines()[0])
    assert summary is not None, stdout
    assert int(summary.group(1) or 0) == len(warmed) and int(summary.group(2)) == 3 - len(warmed)
    if warmed:
        assert f"manifest: {manifest}, partial: the 1 of 3 programs warmed" in stdout
        written = json.loads(manifest.read_text())
        assert written["partial"] is True
        assert [program["name"] for program in written["programs"]] == warmed
    else:
        assert "manifest: none written (no program was warmed)" in stdout
        assert not manifest.exists()


def test_warm_interrupted_leaves_no_lowering_behind_and_the_process_exits(tmp_path: Path) -> None:
    """The cause, in the library: warm() used to raise on Ctrl-C with its lowering thread still
    in native code, and the interpreter's end then aborted the process."""
    spec, mark = tmp_path / "spec.py", tmp_path / "mark"
    spec.write_text(BUSY_SPEC.format(order=["first", "busy", "last"]))
    done = run_python(
        f"""
        import os, signal, threading, time
        from pool.warm.spec_file import load_spec
        from pool.warm.warming import warm

        def interrupt():
            while not os.path.exists({str(mark)!r}):
                time.sleep(0.02)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        try:
            warm(load_spec({str(spec)!r}), workers=1, cache_dir={str(tmp_path / "cache")!r})
        except KeyboardInterrupt as interrupted:
            report = getattr(interrupted, "report", None)
            outcomes = None if report is None else [p.outcome.value for p in report.programs]
            print("outcomes:", outcomes)
        alive = [t.name for t in threading.enumerate() if t.name.startswith("pjrt-pool")]
        print("threads left:", alive, flush=True)
        """,
        env={"MARK": str(mark)},
        check=False,
    )
    assert done.returncode == 0 and not ABORTED.search(done.stderr), done.stderr[-3000:]
    printed(done, "outcomes: ['compiled', 'interrupted', 'interrupted']", "threads left: []")


@pytest.mark.parametrize(("after", "lower_workers"), [(1, "0"), (12, "0"), (20, "1")])
def test_an_interrupted_warm_reports_what_it_warmed_and_writes_a_partial_manifest(
    tmp_path: Path, after: int, lower_workers: str
) -> None:
    """Cancelled programs are not compile errors: a summary line, a partial manifest. (A
    lowering process, which the terminal's Ctrl-C reaches too, says nothing.)"""
    cache, manifest = tmp_path / "cache", tmp_path / "m.json"
    command = ("warm", EXAMPLE_SPEC, "--workers", "2", "--lower-workers", lower_workers)
    command += ("--cache-dir", str(cache))
    process = start(*command, "--manifest", str(manifest), env={}, **PIPES)
    assert process.stderr is not None
    lines = [process.stderr.readline() for _ in range(after)]  # a line per program done
    ctrl_c(process)
    stdout, rest = process.communicate(timeout=120)
    stderr = "".join(lines) + rest
    assert_stopped_cleanly(process.returncode, stderr, cache)
    for line in stderr.splitlines():
        assert re.fullmatch(r"\[\d+/33\] compiled +\S+ \([\d.]+ s\)", line), stderr
    summary = SUMMARY.match(stdout.splitlines()[0])
    assert summary is not None, stdout
    compiled = int(summary.group(1) or 0)
    assert compiled == len(stderr.splitlines()) >= after
    assert compiled + int(summary.group(2)) == 33
    assert f"partial: the {compiled} of 33 programs warmed before the interrupt" in stdout
    written = json.loads(manifest.read_text())
    assert written["partial"] is True and len(written["programs"]) == compiled
    # A worker stopped mid-publish may have stored the program it was compiling before its
    # reply reached the parent (seen once under load: 27 entries, 26 reported): a valid
    # entry the next warm loads, never a bad one (the cache verified above). At most one
    # such per worker.
    entries = len(list((cache / "entries").glob("*.pjx")))
    assert compiled <= entries <= compiled + 2, (entries, compiled)


def test_an_interrupted_warm_on_a_terminal_ends_its_progress_line(tmp_path: Path) -> None:
    """On a terminal the progress is one redrawn line: after a Ctrl-C it ends before the
    summary (it was left without a newline)."""
    cache = tmp_path / "cache"
    controller, terminal = pty.openpty()
    try:
        process = start(
            "warm", EXAMPLE_SPEC, "--workers", "2", "--cache-dir", str(cache),
            env={}, stdin=terminal, stdout=terminal, stderr=terminal,
        )  # fmt: skip
    finally:
        os.close(terminal)
    seen = b""
    try:
        while b" 1/33 " not in seen:  # the first redraw
            ready, _, _ = select.select([controller], [], [], 120)
            assert ready, seen
            seen += os.read(controller, 65536)
        ctrl_c(process)
        while True:
            ready, _, _ = select.select([controller], [], [], 120)
            assert ready, seen
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the terminal's other end closed: the command ended
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(controller)
    process.wait(timeout=60)
    text = seen.decode(errors="replace")
    assert_stopped_cleanly(process.returncode, text, cache)
    before, found, _ = text.partition("interrupted after ")
    assert found, text
    last_draw = before[before.rindex("\r[") :]
    assert re.fullmatch(r"\r\[[#.]{24}\] \d+/33 .*\x1b\[K\r?\n", last_draw), repr(last_draw)


# -- any signal, at any moment (issue 63) ---------------------------------------------------

COMMAND_LINE = (sys.executable, "-m", "pool.cli.main")
"""The command line run as a program (python -m, as its console script runs it): it takes its
signals from its first module on (pool.cli.interrupts)."""

BAD = re.compile(r"Traceback|Fatal Python error|terminate called|FATAL|Exception ignored")
SIGNALS = {signal.SIGINT: 130, signal.SIGTERM: 143}


def takes_signals(pid: int) -> bool:
    """Whether a process handles SIGTERM itself (the command line's handlers are in)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except OSError:
        pass
    return False


def signalled(arguments: list[str], signum: int, delay: float) -> tuple[int, str, str]:
    """Runs the command line in a process group of its own, sends the group `signum` `delay`
    seconds after its handlers are in (start-up included: imports, JAX, the spec, the pool),
    and returns its exit status, stdout and stderr."""
    process = subprocess.Popen(
        [*COMMAND_LINE, *arguments],
        env=repo_environment({}, empty_unsets=False),
        start_new_session=True,
        text=True,
        **PIPES,
    )
    deadline = time.monotonic() + 60
    while not takes_signals(process.pid):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.001)
    time.sleep(delay)
    os.killpg(process.pid, signum)
    stdout, stderr = process.communicate(timeout=180)
    return process.returncode, stdout, stderr


MOMENTS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.8, 1.2, 2.0, 3.0)
"""Seconds after the handlers are in: argparse, numpy and JAX imported, the spec loaded, the
workers started, the first programs lowered and compiled."""


@pytest.mark.slow
@pytest.mark.parametrize("signum", list(SIGNALS), ids=["SIGINT", "SIGTERM"])
def test_warm_ends_on_a_signal_at_any_moment_with_its_status_and_what_it_wrote(
    tmp_path: Path, signum: int
) -> None:
    """Issue 63's sweep: SIGINT to `pjrt-pool warm` in its first second gave tracebacks from
    importlib, SIGSEGV, SIGABRT or a lost signal (the warm ran to its end, exit 0); SIGTERM
    exited -15 with no report and no manifest. Now: 130 (143), one line or the report, never
    a traceback; the report and the partial manifest once warming had begun."""
    seen = []
    for moment in MOMENTS:
        cache, manifest = tmp_path / f"cache{moment}", tmp_path / f"m{moment}.json"
        command = ["warm", EXAMPLE_SPEC, "--workers", "2", "--cache-dir", str(cache)]
        code, stdout, stderr = signalled([*command, "--manifest", str(manifest)], signum, moment)
        assert code == SIGNALS[signum] and not BAD.search(stderr), (moment, code, stderr[-3000:])
        summary = SUMMARY.match(stdout.splitlines()[0]) if stdout else None
        if summary is None:  # before warming began: one line, nothing written
            said = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
            assert stderr.splitlines()[-1].endswith(said), (moment, stderr[-2000:])
            assert not manifest.exists()
        elif summary.group(1):  # programs warmed: their manifest, partial
            assert json.loads(manifest.read_text())["partial"] is True
        else:
            assert "manifest: none written" in stdout and not manifest.exists()
        assert workers_of(cache) == []
        seen.append("report" if summary else "line")
    assert "line" in seen and "report" in seen, seen  # start-up and warming were both hit


@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A manifest and a bundle of two small programs."""
    folder = tmp_path_factory.mktemp("small")
    spec, manifest, bundle = folder / "spec.py", folder / "m.json", folder / "b.bundle"
    spec.write_text(
        "import jax, jax.numpy as jnp\n"
        "def programs():\n"
        "    x = [jax.ShapeDtypeStruct((64, 64), jnp.float32)]\n"
        "    return [('square', lambda a: a @ a, x), ('sine', jnp.sin, x)]\n"
    )
    cache = str(folder / "cache")
    warmed = pjrt_pool("warm", str(spec), "--cache-dir", cache, "--manifest", str(manifest))
    assert warmed.returncode == 0, warmed.stderr
    assert pjrt_pool("bundle", "create", str(manifest), "-o", str(bundle)).returncode == 0
    return {"manifest": manifest, "bundle": bundle, "cache": Path(cache)}


@pytest.mark.slow
@pytest.mark.parametrize("signum", list(SIGNALS), ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("command", ["run here", "run in a pool", "bundle check", "bundle import"])
def test_other_commands_end_on_a_signal_at_any_moment(
    small_bundle: dict[str, Path], tmp_path: Path, signum: int, command: str
) -> None:
    """Each ends with its signal's status and one line (or, where the signal came after it
    was done, as it was done), and leaves no worker behind."""
    arguments = {
        "run here": ["run", str(small_bundle["bundle"]), "square"],
        "run in a pool": ["run", str(small_bundle["manifest"]), "square", "--workers", "1"],
        "bundle check": ["bundle", "check", str(small_bundle["bundle"])],
        "bundle import": ["bundle", "import", str(small_bundle["bundle"]), "--cache-dir", "C"],
    }[command]
    for index, moment in enumerate((0.0, 0.03, 0.1, 0.25, 0.5, 1.0)):
        given = [str(tmp_path / f"c{index}") if word == "C" else word for word in arguments]
        code, stdout, stderr = signalled(given, signum, moment)
        assert not BAD.search(stderr), (moment, stderr[-3000:])
        if code == 0:  # done before the signal came: all it prints
            assert stdout and "interrupted" not in stderr and "terminated" not in stderr
            continue
        assert code == SIGNALS[signum], (moment, code, stdout, stderr[-2000:])
        said = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
        assert stderr.splitlines()[-1].endswith(said), (moment, stderr[-2000:])
    assert workers_of(small_bundle["cache"]) == []


def test_a_signal_lands_where_it_can_be_raised_and_is_never_lost_in_a_callback() -> None:
    """Raised in a garbage collector's callback (JAX registers one) or a __del__, a
    KeyboardInterrupt is printed by Python and dropped ("Exception ignored in"), the signal
    lost: seen in `cache explain`. The command line sends it again, to land after."""
    done = run_python(
        """
        import gc, os, signal, time
        from pool.cli import interrupts

        interrupts.install()
        fired = []

        def callback(phase, info):
            if phase == "start" and not fired:
                fired.append(True)
                os.kill(os.getpid(), signal.SIGINT)  # handled here, inside the callback
                sum(range(1000))

        gc.callbacks.append(callback)
        with interrupts.unwinding():
            try:
                gc.collect()
                time.sleep(5)  # the command going on: the signal lands here
                print("lost")
            except KeyboardInterrupt:
                print("raised after the callback")
        """,
        check=False,
    )
    assert "raised after the callback" in done.stdout and "Exception ignored" not in done.stderr
    assert done.returncode == 0, done.stderr


def test_the_three_ways_a_signal_ends_a_command() -> None:
    """At once where nothing is held (one line, the status, no teardown); as a
    KeyboardInterrupt where something is to be undone; after the block, where something is
    being written (a second signal then leaves at once)."""
    code = """
        import os, signal, sys, time
        from pool.cli import interrupts

        interrupts.install()
        try:
            with interrupts.held():
                os.kill(os.getpid(), signal.SIG{name})
                time.sleep(0.05)
                print("written first", flush=True)
            print("not reached")
        except KeyboardInterrupt:
            print("raised at its end", interrupts.exit_code())
        """
    for name, status in (("INT", 130), ("TERM", 143)):
        held = run_python(code.format(name=name))
        assert held.stdout.split("\n")[:2] == ["written first", f"raised at its end {status}"]
        at_once = run_python(
            f"""
            import os, signal, time
            from pool.cli import interrupts

            interrupts.install()
            interrupts.name_command("pjrt-pool test")
            os.kill(os.getpid(), signal.SIG{name})
            time.sleep(5)
            print("not reached")
            """,
            check=False,
        )
        said = "interrupted (Ctrl-C)" if name == "INT" else "terminated (SIGTERM)"
        assert at_once.returncode == status and at_once.stdout == "", at_once
        assert at_once.stderr.strip() == f"pjrt-pool test: {said}"
        twice = run_python(
            f"""
            import os, signal, time
            from pool.cli import interrupts

            interrupts.install()
            with interrupts.held():
                os.kill(os.getpid(), signal.SIG{name})
                time.sleep(0.05)
                os.kill(os.getpid(), signal.SIG{name})
                time.sleep(5)
                print("not reached")
            """,
            check=False,
        )
        assert twice.returncode == status and "not reached" not in twice.stdout
