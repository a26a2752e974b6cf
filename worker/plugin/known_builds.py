"""What pjrt-pool knows about particular plugin builds: what they miscompile, and the workarounds.

This is the one list. A build is identified by its library's SHA-256 (the
size only lets a process skip hashing a file that cannot be on the list).
Each known failure names the check-plugin battery cases that show it (as
``pjrt-pool check-plugin --no-workarounds`` reports them), a reproduction,
and the workaround that lower() applies to every program it lowers for that
build, if there is one; pool.lowering.workarounds implements each
workaround, by name, as a rewrite of the StableHLO module. A plugin not on
the list gets its programs unchanged.

The list ships with the package, so that compile_program and Pool warn about
a known failure that no workaround covers (worker.plugin.conformance_records) in a
fresh environment, before anyone has run check-plugin. Workarounds are on
unless PJRT_POOL_WORKAROUNDS=off, which makes lower() write the programs as
JAX does (to see or measure the plugin's own behaviour); the known failures
they cover are then warned about.

This module never imports JAX: pool workers and manifest runs read it too.
"""

from __future__ import annotations

import os
from typing import NamedTuple

WORKAROUNDS_ENV = "PJRT_POOL_WORKAROUNDS"
"""``on`` (the default) or ``off``: whether lower() applies the workarounds for known builds."""


class Workaround(NamedTuple):
    """A change lower() makes to programs so that a plugin build computes them right."""

    name: str
    """Its name, by which pool.lowering.workarounds finds the rewrite."""

    change: str
    """What it changes in a program, in a sentence."""


class KnownFailure(NamedTuple):
    """Something a plugin build computes differently from JAX."""

    what: str
    """The bug, as measured."""

    cases: tuple[str, ...]
    """The check-plugin battery cases that fail because of it (without workarounds)."""

    reproduction: str
    """Python code that fails (AssertionError) where the bug is present and not worked around."""

    workaround: Workaround | None
    """The workaround lower() applies for it, or None when there is none."""


class KnownBuild(NamedTuple):
    """A plugin build pjrt-pool knows, by the SHA-256 of its library."""

    sha256: str
    size: int
    """The library's size in bytes."""

    package: str
    """Where the build comes from (package, version, wheel)."""

    platform: str
    failures: tuple[KnownFailure, ...]

    flags: tuple[str, ...] = ()
    """XLA flags whose names the library contains (what xla_flags.plugin_knows_flag finds
    by reading it), so that a process that knows the build need not read 200 MB for them."""

    @property
    def workarounds(self) -> tuple[Workaround, ...]:
        """Every workaround for this build's failures, each once, in order."""
        found = [f.workaround for f in self.failures if f.workaround is not None]
        return tuple(dict.fromkeys(found))


ATAN2_DIVISOR_BARRIER = Workaround(
    "atan2-divisor-barrier",
    "the second operand (the divisor) of every stablehlo.atan2 that XLA might see as a "
    "constant goes through a stablehlo.optimization_barrier, so that XLA cannot see that it is "
    "the constant 1; a divisor computed from the program's inputs (arcsin's, cos(x)) is left "
    "as it is",
)

ATAN2_BY_ONE = KnownFailure(
    "atan2(x, 1.0), which is what jnp.arctan lowers to, is wrong for arrays of 50 elements or "
    "more (38 in float16), in every float type: outputs are other elements' results or the "
    "input itself, up to pi off, and NaN in gives a number out. It is the constant 1.0 that "
    "matters, however it reaches the divisor (a splat constant, a broadcast scalar, a value "
    "XLA folds to 1.0, a loop-invariant carried into a while body); other constants, and "
    "arrays, are right. jax.jit and xla-cpu-pjrt are right",
    tuple(
        f"elementwise/{op}/{dtype}"
        for op in ("arctan", "atan2_const1")
        for dtype in ("float32/n64", "float32/n4096", "float64/n64", "float16/n64", "bfloat16/n64")
    ),
    """\
import jax.numpy as jnp
import numpy as np
from pool import compile_program, lower

x = np.linspace(-5, 5, 64, dtype=np.float32)
program = lower(jnp.arctan, [x])  # %0 = stablehlo.atan2 %arg0, %cst (dense<1.0>)
(out,) = compile_program(program, disk_cache=False)[0].run([x])
assert np.allclose(out, np.arctan(x), atol=1e-6), np.abs(out - np.arctan(x)).max()
""",
    ATAN2_DIVISOR_BARRIER,
)

KNOWN_BUILDS = (
    KnownBuild(
        "ad1309ac822b1b24d51b7f9947c7c9fa9ef5d67f390584cbc3d1fa2428fed9c2",
        201_600_336,
        "lammps-jax-pjrt-cpu 0.11.2",  # its only wheel: py3-none-manylinux_2_27_x86_64
        "cpu",
        (ATAN2_BY_ONE,),
        ("xla_cpu_enable_fast_min_max", "xla_gpu_per_fusion_autotune_cache_dir"),
    ),
)
"""Every known build. The default CPU plugin's failures were found by check-plugin
(616 cases, jax 0.10.2 reference) and its workaround measured to make them pass."""

_BY_SHA256 = {build.sha256: build for build in KNOWN_BUILDS}


def known_build(sha256: str | None) -> KnownBuild | None:
    """Returns the known build with this library SHA-256, or None."""
    return _BY_SHA256.get(sha256) if sha256 else None


def may_have_uncovered_failures(path: str) -> bool:
    """Whether the library at path may be a known build with failures no workaround covers now.

    False without hashing it when no build of its size has any: the default
    plugin with the workarounds on, for example.
    """
    try:
        size = os.stat(path).st_size
    except OSError:
        return False
    return any(build.size == size and uncovered_failures(build) for build in KNOWN_BUILDS)


def workarounds_enabled() -> bool:
    """Whether lower() applies workarounds: PJRT_POOL_WORKAROUNDS is unset, empty or ``on``.

    Raises ValueError for a value other than ``on`` or ``off``.
    """
    value = os.environ.get(WORKAROUNDS_ENV, "").strip().lower() or "on"
    if value not in ("on", "off"):
        raise ValueError(
            f"{WORKAROUNDS_ENV} is {os.environ[WORKAROUNDS_ENV]!r}; set it to 'on' (the default: "
            "lower() works around known plugin bugs) or 'off'"
        )
    return value == "on"


def uncovered_failures(build: KnownBuild | None) -> list[str]:
    """The cases of a known build's failures that no workaround in effect covers, sorted.

    With PJRT_POOL_WORKAROUNDS=off, that is every failing case.
    """
    if build is None:
        return []
    enabled = workarounds_enabled()
    return sorted(
        case
        for failure in build.failures
        if failure.workaround is None or not enabled
        for case in failure.cases
    )
