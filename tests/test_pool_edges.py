"""The Pool's edges (issue 18): Ctrl-C in submit, fork, freeing results, stops that say why.

Each test reproduces one case with real workers and real signals. Scenarios
that could hang run in a child process with a timeout (conftest.child).
"""

from __future__ import annotations

import pytest
from conftest import child

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
    assert "next: [2.0, 2.0, 2.0, 2.0] lent: 0" in done.stdout, done.stdout
    assert "interrupted: 10 left: []" in done.stdout, done.stdout


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
    assert "big held: 16 MiB 3.0" in done.stdout, done.stdout
    assert "big dropped: 0 MiB" in done.stdout, done.stdout
    kept = int(done.stdout.split("five dropped:")[1].split()[0])
    assert kept <= 8, done.stdout  # what the pool keeps for reuse, no more
