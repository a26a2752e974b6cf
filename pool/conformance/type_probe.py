"""Which element types the plugin compiles at all: one tiny program per type, in the pool.

A platform may refuse a whole type: libtpu aborts compiling conversions to
complex128 ("Unsupported CVT X{64|128} expansion from f32[256] to c128[256]")
and complex128 division. Run case by case, that is dozens of crashes, each a
worker restarted. So before a case is given to the plugin, each element type
its program uses (read off the module's tensor types) is probed once: a
program that converts float32 to the type, multiplies and adds in it,
compares, and converts back is compiled in a worker of the pool, where a
crash or a hang costs that probe only. A type whose probe fails is
unsupported here: the cases that need it are reported as such, with the
probe's failure, in one line per type. Compiling is what is probed: a type
the plugin compiles but computes wrongly is the cases' to find.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pool.lowering.lower import lower
from worker.dtypes import supported_dtypes

_TENSOR_TYPE = re.compile(r"tensor<(?:[0-9?]+x)*(complex<[A-Za-z0-9]+>|[A-Za-z][A-Za-z0-9]*)")
_WIDE = frozenset(np.dtype(name) for name in ("float64", "int64", "uint64", "complex128"))


def mlir_name(dtype: np.dtype) -> str:
    """A dtype's name as an element type in StableHLO text: f32, bf16, ui8, complex<f64>,
    f8E4M3FN."""
    name = np.dtype(dtype).name
    if name == "bool":
        return "i1"
    if name == "bfloat16":
        return "bf16"
    if name.startswith("complex"):
        return f"complex<f{int(name[7:]) // 2}>"
    if name.startswith(("int", "uint")):
        return name.replace("uint", "ui").replace("int", "i")
    if name.startswith("float8_"):
        return "f8" + name[7:].upper()
    return name.replace("float", "f")


@functools.cache
def _by_mlir_name() -> dict[str, np.dtype]:
    return {mlir_name(dtype): dtype for dtype in supported_dtypes()}


def element_types(text: str) -> frozenset[np.dtype]:
    """The element types of the tensors a StableHLO module's text names (types pjrt-pool
    cannot pass, such as index, are left out)."""
    known = _by_mlir_name()
    return frozenset(known[name] for name in set(_TENSOR_TYPE.findall(text)) if name in known)


def _probe_function(dtype: np.dtype) -> Any:
    def probe(x: Any) -> Any:
        y = x.astype(dtype)
        z = y * y + y
        back = jnp.real(z) if jnp.issubdtype(dtype, jnp.complexfloating) else z
        return back.astype(jnp.float32), z == y

    return probe


def probe_program(dtype: np.dtype, platform: str) -> Any:
    """The probe of a type: float32 in, converted to the type, z = y*y + y, compared and
    converted back; lowered for the platform (with 64-bit types on where it needs them)."""
    dtype = np.dtype(dtype)
    with jax.enable_x64(dtype in _WIDE):
        return lower(_probe_function(dtype), [np.zeros(8, np.float32)], platform=platform)


@dataclass(frozen=True)
class TypeSupport:
    """What the probe of one element type found."""

    dtype: np.dtype
    supported: bool
    why: str = ""
    """For an unsupported type: how its probe failed."""

    @property
    def name(self) -> str:
        """The type's numpy name ("complex128")."""
        return np.dtype(self.dtype).name


class TypeProbe:
    """Probes each element type once, as cases come to need it, in the pool's workers.

    ask() submits the probes of types not asked before; verdict() says, once
    every probe a case needs has finished, which of its types are unsupported.
    describe(error) turns a probe's failure into words (the runner's, shared
    with the cases' failures).
    """

    def __init__(self, pool: Any, platform: str, timeout: float, describe: Any) -> None:
        self._pool = pool
        self._platform = platform
        self._timeout = timeout
        self._describe = describe
        self._probes: dict[np.dtype, Future[Any] | TypeSupport] = {}

    def ask(self, dtypes: Iterable[np.dtype]) -> None:
        """Submits the probes of the types not asked before."""
        for dtype in dtypes:
            if dtype in self._probes:
                continue
            try:
                program = probe_program(dtype, self._platform)
                self._probes[dtype] = self._pool.submit_compile(
                    program, name=f"probe/{np.dtype(dtype).name}", timeout=self._timeout
                )
            except Exception as error:  # the plugin's StableHLO cannot express it, or the like
                self._probes[dtype] = TypeSupport(dtype, False, self._describe(error))

    def pending(self) -> list[Future[Any]]:
        """The probes still compiling."""
        return [p for p in self._probes.values() if isinstance(p, Future) and not p.done()]

    def verdict(self, dtypes: Iterable[np.dtype]) -> list[TypeSupport] | None:
        """The unsupported ones among the types (asked before), or None while a probe runs."""
        found = [self._settled(dtype) for dtype in dtypes]
        if any(support is None for support in found):
            return None
        return [s for s in found if s is not None and not s.supported]

    def _settled(self, dtype: np.dtype) -> TypeSupport | None:
        probe = self._probes[dtype]
        if isinstance(probe, TypeSupport):
            return probe
        if not probe.done():
            return None
        error = probe.exception()
        support = TypeSupport(dtype, error is None, "" if error is None else self._describe(error))
        self._probes[dtype] = support
        return support

    def outcomes(self) -> list[TypeSupport]:
        """Every type probed, settled (waiting for probes still compiling), by name."""
        for probe in self.pending():
            probe.exception()  # waits: the pool's timeout bounds it
        found = [self._settled(dtype) for dtype in self._probes]
        return sorted((s for s in found if s is not None), key=lambda s: s.name)
