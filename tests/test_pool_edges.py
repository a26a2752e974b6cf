"""The Pool's edge cases: Ctrl-C in submit, fork, freeing results, stops that say why, settings.

Each test reproduces one case with real workers and real signals. Scenarios
that could hang run in a child process with a timeout (conftest.child).
"""

from __future__ import annotations

import copy
import os
import pickle
import re
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import child, printed

# -- 1. a Ctrl-C while a large input is copied into shared memory -----------------


@pytest.mark.slow
def test_a_ctrl_c_during_a_large_submit_leaves_no_shared_memory_behind() -> None:
    # Mapping a fresh segment (MAP_POPULATE) and filling it is most of a large
    # submit, and a SIGINT arriving then was handled right after the mapping
    # call returned, before anything owned the mapping: the whole input stayed
    # mapped until the process exited. Nothing is kept for reuse here, so every
    # submit maps a fresh segment; the signals come at 10 different moments.
    done = child(
        """
        import gc
        size = 64 << 20  # 256 MiB of float32
        program = lower(lambda x: x[:4] + 1.0, [sds(size)])
        x = np.ones(size, np.float32)
        pool = Pool(workers=1, segment_cache_bytes=0)
        pool.run(program, [x])
        interrupted = 0
        for attempt in range(10):
            timer = threading.Timer(0.015 * attempt, os.kill, (os.getpid(), signal.SIGINT))
            try:
                timer.start()
                pool.submit(program, [x])
                time.sleep(2.0)  # where the signal lands if the submit was quicker
            except KeyboardInterrupt:
                interrupted += 1
            timer.join()
        gc.collect()
        print("next:", pool.run(program, [x])[0].tolist(), "lent:", pool._segments.lent)
        pool.close()
        gc.collect()
        print("interrupted:", interrupted, "left:", memfds_of(), flush=True)
        """,
        timeout=180,
    )
    printed(done, "next: [2.0, 2.0, 2.0, 2.0] lent: 0", "interrupted: 10 left: []")


# -- 3. a dropped large result frees its memory with its arrays ------------------


def test_a_dropped_result_past_what_is_kept_for_reuse_is_freed_with_its_arrays() -> None:
    # A result's segment went back to a queue that only the next large task
    # (or close()) emptied: dropped results stayed allocated while the pool
    # ran small tasks, however much the pool was meant to keep.
    done = child(
        """
        import gc
        import jax.numpy as jnp
        kept = 8 << 20  # what the pool may keep for reuse
        def output_of(megabytes):
            n = megabytes << 18  # float32 elements
            scalar = jax.ShapeDtypeStruct((), jnp.float32)
            return lower(lambda s: jnp.full((n,), s, jnp.float32), [scalar])
        small = scale_program(2.0)

        def output_bytes():  # what this process holds of the workers' output segments
            return memfd_bytes("pjrt-pool-outputs")

        with Pool(workers=1, segment_cache_bytes=kept) as pool:
            big, medium = output_of(16), output_of(3)
            out = pool.run(big, [np.float32(3)])
            print("big held:", output_bytes() >> 20, "MiB", float(out[0][-1]), flush=True)
            del out
            gc.collect()
            for _ in range(5):
                pool.run(small, [np.ones(8, np.float32)])
            print("big dropped:", output_bytes() >> 20, "MiB", flush=True)
            outs = [pool.run(medium, [np.float32(i)]) for i in range(5)]
            assert [float(o[0][0]) for o in outs] == [0.0, 1.0, 2.0, 3.0, 4.0]
            del outs
            gc.collect()
            print("five dropped:", output_bytes() >> 20, "MiB", flush=True)
        """,
        timeout=120,
    )
    printed(done, "big held: 16 MiB 3.0", "big dropped: 0 MiB")
    kept = int(done.stdout.split("five dropped:")[1].split()[0])
    assert kept <= 8, done.stdout  # what the pool keeps for reuse, no more


# -- 2. a forked child sees its parent's pool as not its own ----------------------


FORKED_CHILD = """
        import logging
        logging.basicConfig(level=logging.WARNING)  # the pool's warnings, on stderr
        sleeper, program = sleep_program(), scale_program(2.0)
        x = np.ones(8, np.float32)
        import atexit

        parent = os.getpid()
        try:
            with Pool(workers=2, initializer=handler_initializer(handlers)) as pool:
                pool.run(program, [x])
                workers = sorted(w["pid"] for w in pool.worker_info)
                busy = [pool.submit(sleeper, [milliseconds(600)]) for _ in range(3)]
                # Another thread holds the pool's lock at the fork, as a busy pool's often do.
                held, release = threading.Event(), threading.Event()

                def hold():
                    with pool._lock:
                        held.set()
                        release.wait()

                holder = threading.Thread(target=hold)
                holder.start()
                held.wait()
                read, write = os.pipe()
                pid = os.fork()
                if pid == 0:  # the child: every call is refused at once, saying whose pool it is
                    os.close(read)
                    calls = {
                        "run": lambda: pool.run(program, [x]),
                        "submit": lambda: pool.submit(program, [x]),
                        "compile": lambda: pool.compile(program),
                        "compile_many": lambda: pool.compile_many([program]),
                        "function": lambda: pool.function(lambda v: v + 1.0),
                        "worker_info": lambda: pool.worker_info,
                        "statistics": lambda: pool.statistics,
                        "close": pool.close,
                        "terminate": pool.terminate,
                    }
                    lines = []
                    for name, call in calls.items():
                        outcome = []

                        def attempt():
                            try:
                                call()
                                outcome.append("returned")
                            except PoolForkedError as error:
                                whose = f"process {os.getppid()}" in str(error)
                                outcome.append("refused" if whose else f"unclear: {error}")
                            except BaseException as error:
                                outcome.append(repr(error))

                        thread = threading.Thread(target=attempt, daemon=True)
                        thread.start()
                        thread.join(10)
                        lines.append(f"child {name}: {outcome[0] if outcome else 'hung'}")
                    os.write(write, "\\n".join(lines).encode())
                    os.close(write)
                    # Leaves the parent's with block, then runs the atexit hooks (below):
                    # neither may wait for the held lock or touch the parent's workers.
                    sys.exit(0)
                os.close(write)
                with os.fdopen(read) as answers:
                    print(answers.read(), flush=True)
                deadline = time.monotonic() + 30
                while not os.waitpid(pid, os.WNOHANG)[0]:
                    if time.monotonic() > deadline:
                        print("child hung at exit", flush=True)
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        break
                    time.sleep(0.05)
                else:
                    print("child exited", flush=True)
                release.set()
                holder.join()
                print("busy:", [float(f.result(timeout=30)[0][0]) for f in busy], flush=True)
                print("run:", pool.run(program, [x])[0][0], flush=True)
                print("same workers:", sorted(w["pid"] for w in pool.worker_info) == workers)
        except SystemExit:
            if os.getpid() == parent:
                raise
            # The child, out of the with block: the atexit hooks (the pool's among them),
            # then out at once. What finalization would do next is JAX's teardown, whose
            # CPU client waits for thread-pool threads that a forked child does not have
            # (JAX warns at the fork that it may deadlock): that hangs now and then, on
            # every Python version, whatever the pool does.
            atexit._run_exitfuncs()
            os._exit(0)
        """
"""A pool used from a forked child, by every call, while another thread holds its lock."""


def test_a_forked_child_cannot_use_its_parents_pool_and_leaves_it_untouched(handlers: str) -> None:
    # The child of os.fork() inherits the pool but none of its threads: run()
    # waited forever, an idle pool's worker got the child's requests (and was
    # retired by the parent as having sent "an unexpected message"), and the
    # atexit hook's terminate() took the pool's lock, held forever in the child
    # when another thread held it at the fork, or killed the parent's workers.
    done = child(FORKED_CHILD, handlers, timeout=120)
    for call in ("run", "submit", "compile", "compile_many", "function", "worker_info"):
        assert f"child {call}: refused" in done.stdout, done.stdout
    for call in ("statistics", "close", "terminate"):
        assert f"child {call}: refused" in done.stdout, done.stdout
    printed(done, "child exited", "busy: [600.0, 600.0, 600.0]")
    assert "run: 3.0" in done.stdout and "same workers: True" in done.stdout, done.stdout
    assert "unexpected message" not in done.stderr, done.stderr[-3000:]


# -- 4. a task a stop fails says which stop; compile_many keeps what compiled -----


def test_queued_tasks_a_stop_fails_say_which_stop(handlers: str) -> None:
    # A queued run() or compile() raised a bare CancelledError('') when the
    # pool stopped, though its caller cancelled nothing.
    done = child(
        """
        sleeper, quick, other = sleep_program(), scale_program(2.0), scale_program(5.0)

        def leave_with(pool, error):
            try:
                with pool:
                    raise error
            except type(error):
                pass

        stops = {
            "terminate": lambda pool: pool.terminate(),
            "close(cancel_pending=True)": lambda pool: pool.close(cancel_pending=True),
            "with block raising": lambda pool: leave_with(pool, ValueError("boom")),
            "with block Ctrl-C": lambda pool: leave_with(pool, KeyboardInterrupt()),
        }
        for stop_name, stop in stops.items():
            pool = Pool(workers=1, initializer=handler_initializer(handlers))
            pool.run(sleeper, [milliseconds(1)])
            running = pool.submit(sleeper, [milliseconds(1500)])
            outcomes = {}

            def call(name, action):
                try:
                    action()
                    outcomes[name] = "returned"
                except BaseException as error:
                    outcomes[name] = f"{type(error).__name__}: {error}"

            callers = [
                threading.Thread(target=call, args=("run", lambda: pool.run(quick, [np.ones(8)]))),
                threading.Thread(target=call, args=("compile", lambda: pool.compile(other))),
            ]
            for caller in callers:
                caller.start()
            time.sleep(0.5)  # both are queued behind the running task
            stop(pool)
            for caller in callers:
                caller.join(30)
            print(stop_name, "| run |", outcomes.get("run"), flush=True)
            print(stop_name, "| compile |", outcomes.get("compile"), flush=True)
        """,
        handlers,
        timeout=120,
    )
    expected = {
        "terminate": "the pool was terminated before the task ran",
        "close(cancel_pending=True)": "the pool was closed with cancel_pending=True before",
        "with block raising": "its with block raised ValueError: boom) before the task ran",
        "with block Ctrl-C": "its with block was interrupted by KeyboardInterrupt()) before",
    }
    for stop, words in expected.items():
        for call in ("run", "compile"):
            assert f"{stop} | {call} | PoolClosedError: " in done.stdout, done.stdout
            line = next(line for line in done.stdout.splitlines() if f"{stop} | {call} |" in line)
            assert words in line, line


def test_compile_many_stopped_by_terminate_returns_what_compiled() -> None:
    # compile_many(return_exceptions=True) raised CancelledError when terminate()
    # cancelled its queued compiles, losing the specs that had compiled.
    done = child(
        """
        programs = [scale_program(float(i)) for i in range(8)]
        pool = Pool(workers=1)

        def progress(done, total, result):
            if done == 2:  # a callback may not wait: stop the pool from another thread
                threading.Thread(target=pool.terminate).start()

        results = pool.compile_many(programs, return_exceptions=True, progress=progress)
        print("results:", [type(r).__name__ for r in results], flush=True)
        print("errors:", sorted({str(r) for r in results if isinstance(r, Exception)}), flush=True)
        """,
        timeout=120,
    )
    line = next(line for line in done.stdout.splitlines() if line.startswith("results:"))
    kinds = eval(line.split(":", 1)[1])
    assert kinds[:2] == ["ProgramSpec", "ProgramSpec"], line
    assert set(kinds) == {"ProgramSpec", "PoolClosedError"}, line
    assert "the pool was terminated" in done.stdout, done.stdout


# -- 5. a raising done-callback, and replacements that keep dying ----------------


def test_a_done_callback_that_raises_is_logged_and_the_pool_goes_on(handlers: str) -> None:
    # concurrent.futures lets a BaseException out of a done-callback into the
    # manager thread: the pool broke and unrelated tasks failed with PoolClosedError.
    # The run sleeps 500 ms so that the callbacks are added before it ends: one
    # added to a done future runs at once in the caller's thread, where a
    # BaseException is the caller's (CI's jax012 leg, busy, once exited 3 so).
    done = child(
        """
        import logging
        logging.basicConfig(level=logging.WARNING)
        program, sleeper = scale_program(2.0), sleep_program()
        x = np.ones(8, np.float32)
        ran = []

        def interrupt(future):
            raise KeyboardInterrupt

        def leave(future):
            raise SystemExit(3)

        with Pool(workers=2, initializer=handler_initializer(handlers)) as pool:
            pool.run(sleeper, [milliseconds(1)])  # compiled before the timed runs
            for callback in (interrupt, leave):
                future = pool.submit(sleeper, [milliseconds(500)])
                assert not future.done(), "the run ended before its callbacks were added"
                future.add_done_callback(callback)
                future.add_done_callback(lambda f, name=callback.__name__: ran.append(name))
                future.result(timeout=30)
            results = [float(pool.submit(program, [x]).result(timeout=30)[0][0]) for _ in range(6)]
            time.sleep(0.2)  # the last callbacks run after the result is set
            print("results:", results, "ran after:", sorted(ran), flush=True)
        """,
        handlers=handlers,
        timeout=120,
    )
    six = "results: [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]"
    assert f"{six} ran after: ['interrupt', 'leave']" in done.stdout, done.stdout
    assert "raised KeyboardInterrupt()" in done.stderr and "raised SystemExit(3)" in done.stderr


def test_a_done_callback_that_raises_an_exception_is_logged_and_the_pool_goes_on() -> None:
    # The waiting caller read the reply itself and relayed the callbacks to the
    # manager, which ran them outside Future's own guard: a ZeroDivisionError
    # broke the pool ("PoolClosedError: the pool is broken: division by zero").
    done = child(
        """
        import logging
        logging.basicConfig(level=logging.WARNING)
        program = scale_program(2.0)
        ran = []
        with Pool(2) as pool:
            future = pool.submit(program, [np.ones(8, np.float32)])
            future.add_done_callback(lambda f: 1 / 0)
            future.add_done_callback(lambda f: ran.append("after"))
            future.result(timeout=10)
            time.sleep(0.2)  # the relayed callbacks run on the manager thread
            print("next:", pool.run(program, [np.zeros(8, np.float32)])[0].tolist(), flush=True)
            queued = pool.submit(program, [np.ones(8, np.float32)])
            queued.add_done_callback(lambda f: 1 / 0)
            print("again:", float(queued.result(timeout=10)[0][0]), ran, flush=True)
        """,
        timeout=120,
    )
    assert "next: [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]" in done.stdout, done.stderr
    assert "again: 3.0 ['after']" in done.stdout, done.stdout
    assert "raised ZeroDivisionError" in done.stderr, done.stderr


def test_replacements_killed_while_starting_are_tried_again_with_backoff() -> None:
    # After three replacements failed to start the pool broke for good: every
    # later task failed with PoolClosedError. Now each try waits twice as long
    # as the last, is logged, and only a task queued while no worker could
    # start fails.
    done = child(
        """
        import logging
        logging.basicConfig(level=logging.WARNING)
        program = scale_program(2.0)
        x = np.ones(8, np.float32)
        with Pool(workers=1) as pool:
            pool.run(program, [x])
            last = pool.worker_info[0]["pid"]
            os.kill(last, signal.SIGKILL)
            queued = pool.submit(program, [x])
            killed, deadline = 0, time.monotonic() + 60
            while killed < 3 and time.monotonic() < deadline:
                info = pool.worker_info[0]
                if info["state"] == "starting" and info["pid"] != last:
                    os.kill(info["pid"], signal.SIGKILL)
                    killed, last = killed + 1, info["pid"]
                time.sleep(0.002)
            try:
                print("queued:", queued.result(timeout=60)[0][0], flush=True)
            except Exception as error:
                print("queued:", type(error).__name__, error, flush=True)
            print("killed:", killed, "later:", pool.run(program, [x])[0][0], flush=True)
        """,
        timeout=120,
    )
    assert "killed: 3 later: 3.0" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "queued: WorkerStartupError no worker is running" in done.stdout, done.stdout
    for failures in (1, 2, 3):
        assert f"failed to start ({failures} in a row)" in done.stderr, done.stderr[-3000:]


# -- 6. callbacks of futures a stop fails run on the manager thread ---------------


def test_callbacks_of_tasks_terminate_fails_run_on_the_manager_thread(handlers: str) -> None:
    # terminate() cancelled queued futures itself, so their callbacks ran in the
    # thread that called it, not on the manager thread as documented.
    done = child(
        """
        sleeper, quick = sleep_program(), scale_program(2.0)
        pool = Pool(workers=1, initializer=handler_initializer(handlers))
        pool.run(sleeper, [milliseconds(1)])
        seen = {}
        running = pool.submit(sleeper, [milliseconds(2000)])
        queued = pool.submit(quick, [np.ones(8)])
        for name, future in (("running", running), ("queued", queued)):
            future.add_done_callback(
                lambda f, name=name: seen.update({name: threading.current_thread().name})
            )
        pool.terminate()
        print("threads:", sorted(seen.items()), flush=True)
        """,
        handlers,
        timeout=60,
    )
    assert (
        "threads: [('queued', 'pjrt-pool-manager'), ('running', 'pjrt-pool-manager')]"
        in done.stdout
    ), done.stdout


# -- 7. constructor arguments are checked up front; a Pool is not copied ----------


@pytest.mark.parametrize(
    ("settings", "kind", "words"),
    [
        ({"max_loaded": -1}, ValueError, "max_loaded must be at least 1"),
        ({"max_loaded": 0}, ValueError, "max_loaded must be at least 1"),
        ({"max_loaded": 2.5}, TypeError, "max_loaded must be an int"),
        ({"max_crashes": 0}, ValueError, "max_crashes must be at least 1"),
        ({"max_crashes": True}, TypeError, "max_crashes must be an int"),
        ({"stop_grace": -1}, ValueError, "stop_grace must be a finite number of seconds"),
        ({"stop_grace": float("nan")}, ValueError, "stop_grace"),
        ({"stop_grace": "2"}, TypeError, "stop_grace must be a number of seconds"),
        ({"segment_cache_bytes": -1}, ValueError, "segment_cache_bytes must be at least 0"),
        ({"segment_cache_bytes": "1G"}, TypeError, "segment_cache_bytes must be an int"),
        ({"segment_fds": -1}, ValueError, "segment_fds must be at least 0"),
        ({"zero_copy": "no"}, TypeError, "zero_copy must be True or False"),
        ({"initargs": 5}, TypeError, "initargs must be a tuple or list"),
        ({"initargs": "ab"}, TypeError, "initargs must be a tuple or list"),
        ({"initializer": 5}, TypeError, "initializer must be callable"),
        ({"initializer": print, "initargs": [threading.Lock()]}, TypeError, "cannot pickle"),
        ({"platform": 3}, TypeError, "platform must be a platform's name"),
        ({"platform": ""}, TypeError, "platform must be a platform's name"),
        ({"cache_dir": 3}, TypeError, "cache_dir must be a directory's path"),
        ({"cache_dir": b"/tmp"}, TypeError, "cache_dir must be a directory's path"),
        ({"workers": 0}, ValueError, "workers must be at least 1"),
        ({"workers": "2"}, TypeError, "workers must be an int"),
        ({"task_timeout": 0}, ValueError, "task_timeout"),
    ],
)
def test_bad_settings_are_refused_before_any_worker_starts(settings, kind, words) -> None:
    # Pool(1, max_loaded=-1) was accepted, and then every run failed with
    # KeyError('dictionary is empty') from the worker's executable cache.
    from pool_helpers import children_of

    from pool import Pool

    workers = 1 if "workers" not in settings else settings.pop("workers")
    with pytest.raises(kind, match=re.escape(words)):
        Pool(workers, **settings)
    assert children_of(os.getpid()) == []


def test_a_pool_cannot_be_pickled_or_copied() -> None:
    # pickle.dumps(pool) failed on a lock, and copy.copy(pool) made a second
    # Pool object sharing the first one's workers, sockets and lock.
    import cloudpickle
    from pool_helpers import scale_program

    from pool import Pool

    program = scale_program(2.0)
    with Pool(workers=1) as pool:
        for attempt in (pickle.dumps, copy.copy, copy.deepcopy, cloudpickle.dumps):
            with pytest.raises(TypeError, match="a Pool cannot be pickled or copied"):
                attempt(pool)
        assert pool.run(program, [np.ones(8, np.float32)])[0][0] == 3.0


# -- 8. what a large output costs the worker: the figure docs/performance.md states --------


def _peak_resident_bytes(pid: int) -> int:
    """A process's peak resident set size (VmHWM, which counts the shared memory it touched as
    well as its private memory)."""
    for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii").splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def test_a_large_output_peaks_at_twice_its_size_in_the_worker() -> None:
    # The README said outputs were "written by the worker straight into shared
    # memory"; the plugin computes an output into a buffer of its own and the worker
    # copies it into the segment the parent maps (docs/facts.md), so the peak is twice
    # the output.
    import jax
    import jax.numpy as jnp

    from pool import Pool, lower

    def filled(mib: int):
        count = mib << 18  # float32 elements
        scalar = [jax.ShapeDtypeStruct((), jnp.float32)]
        return lower(lambda s: jnp.full((count,), s, jnp.float32), scalar)

    mib = 64
    small, large = filled(1), filled(mib)
    with Pool(workers=1) as pool:
        pid = pool.worker_info[0]["pid"]
        pool.run(small, [np.float32(1)])
        pool.compile(large)  # the compiler's own peak goes into the baseline
        pool.run(small, [np.float32(1)])
        before = _peak_resident_bytes(pid)
        (out,) = pool.run(large, [np.float32(3)])
        growth = _peak_resident_bytes(pid) - before
        assert float(out[-1]) == 3.0 and out.nbytes == mib << 20
    assert 1.8 <= growth / (mib << 20) <= 2.2, f"the worker's peak grew {growth >> 20} MiB"
