"""A long-lived process accumulates nothing: pools closed give back what they took (issue 63).

benchmarks/soak.py does it at length (hundreds of pools, Ctrl-C and killed workers mixed in);
here, the reproduction: every closed Pool left its cache directory's five descriptors open
(the directory, entries, locks, plugins and loads) for the life of the process.
"""

from __future__ import annotations

from pathlib import Path

from conftest import run_python


def test_pools_over_their_own_cache_directories_leave_no_descriptor_open(tmp_path: Path) -> None:
    done = run_python(
        f"""
        import gc, os, tempfile, threading
        import numpy as np
        from pool import Pool, lower

        program = lower(lambda x: x + 1, [np.zeros(4, np.float32)])

        def one_pool():
            with Pool(1, cache_dir=tempfile.mkdtemp(dir={str(tmp_path)!r})) as pool:
                (result,) = pool.run(program, [np.ones(4, np.float32)])
                value = pool.put(np.ones(4, np.float32))
                pool.run(program, [value])
            return result  # a result outlives its pool, then goes

        def now():
            gc.collect()
            return sorted(os.listdir("/proc/self/fd")), threading.active_count()

        kept = one_pool()  # imports and what a process makes once
        del kept
        (before, threads) = now()
        kept = [one_pool() for _ in range(2)]
        del kept
        (after, threads_after) = now()
        print("descriptors", len(before), len(after), "threads", threads, threads_after)
        opened = [os.readlink(f"/proc/self/fd/{{fd}}") for fd in after if fd not in before]
        assert len(after) <= len(before), opened
        assert threads_after == threads
        """,
        timeout=240,
    )
    assert "descriptors" in done.stdout
