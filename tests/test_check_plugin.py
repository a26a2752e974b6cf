"""pjrt-pool check-plugin: the conformance battery, its memo per plugin build, the warning."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pool import Pool, compile_program, lower


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
