"""Measures how far jax.jit and a plugin are from the true values of the battery's functions.

For every elementwise function of the conformance battery that numpy or
scipy also computes, in float32 and float64, on 20,000 inputs from the
function's domain: the largest ULP distance of jax.jit's result from the
reference (float64 for float32, long double where numpy has it for
float64), of the plugin's result from the reference, and of the plugin's
from jax.jit's. The budgets in pool/conformance/budgets.py come from these
figures on the two CPU plugins; run it again when either side changes:

    python tools/calibrate_budgets.py                            # the default plugin
    PJRT_POOL_PLUGIN_CPU=/path/to/plugin.so python tools/calibrate_budgets.py

Results differ from the true value by millions of ULP where the true value
is subnormal (XLA flushes those to zero, on both sides) or where the
function crosses zero (lgamma, digamma); the plugin-vs-JAX column is the one
the budgets bound.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import scipy.special as special

from pool import compile_program, lower
from pool.conformance.compare import ulp_distance
from pool.conformance.elementwise import ATAN2_CONSTANTS, BINARY, UNARY, dtype
from pool.conformance.inputs import floats
from worker import loaded_runtime

POINTS = 20_000

REFERENCES = {
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "cbrt": np.cbrt,
    "exp": np.exp,
    "exp2": np.exp2,
    "expm1": np.expm1,
    "log": np.log,
    "log1p": np.log1p,
    "log2": np.log2,
    "log10": np.log10,
    "logistic": lambda x: 1 / (1 + np.exp(-x)),
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "arcsin": np.arcsin,
    "arccos": np.arccos,
    "arctan": np.arctan,
    "sinh": np.sinh,
    "cosh": np.cosh,
    "tanh": np.tanh,
    "arcsinh": np.arcsinh,
    "arccosh": np.arccosh,
    "arctanh": np.arctanh,
    "erf": special.erf,
    "erfc": special.erfc,
    "erf_inv": special.erfinv,
    "lgamma": special.gammaln,
    "digamma": special.psi,
    "bessel_i0e": special.i0e,
    "bessel_i1e": special.i1e,
    "integer_pow3": lambda x: x**3,
    "atan2": np.arctan2,
    "hypot": np.hypot,
    "logaddexp": np.logaddexp,
    "power": np.power,
    "atan2_const1": lambda x: np.arctan2(x, 1.0),
    "atan2_const2": lambda x: np.arctan2(x, 2.0),
    "atan2_const_minus1": lambda x: np.arctan2(x, -1.0),
    "atan2_const_half": lambda x: np.arctan2(x, 0.5),
    "atan2_y_const1": lambda x: np.arctan2(1.0, x),
}
"""numpy or scipy functions of the battery's operations."""

# numpy computes these in long double, more precise than float64 on x86.
LONG_DOUBLE = {
    *("exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sin", "cos", "tan"),
    *("arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "arcsinh", "arccosh", "arctanh"),
    *("cbrt", "atan2", "hypot", "power"),
}


def _largest(a: np.ndarray, b: np.ndarray, finite: np.ndarray) -> float:
    return float(ulp_distance(a[finite], b[finite]).max()) if finite.any() else 0.0


def main() -> None:
    """Prints one row per function and type: ULPs of JAX and the plugin from the truth."""
    rows = []
    for op in (*UNARY, *ATAN2_CONSTANTS, *BINARY):
        if op.name not in REFERENCES:
            continue
        for type_name in ("float32", "float64"):
            wide = type_name == "float64"
            with jax.enable_x64(wide):
                rng = np.random.default_rng(1)
                arguments = [
                    floats(rng, dtype(type_name), POINTS, low, high, specials=())
                    for low, high in op.domains
                ]
                executable, _ = compile_program(lower(op.function, arguments), disk_cache=False)
                plugin = executable.run(arguments)[0]
                reference = np.asarray(jax.jit(op.function)(*arguments))
            precise = np.longdouble if wide and op.name in LONG_DOUBLE else np.float64
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                truth = REFERENCES[op.name](*[a.astype(precise) for a in arguments])
            truth = np.asarray(truth).astype(dtype(type_name))
            finite = np.isfinite(truth) & np.isfinite(plugin) & np.isfinite(reference)
            rows.append(
                (
                    f"{op.name}/{type_name}",
                    _largest(reference, truth, finite),
                    _largest(plugin, truth, finite),
                    _largest(plugin, reference, finite),
                )
            )
    runtime = loaded_runtime()
    print(f"plugin: {runtime.location.path if runtime else '?'}; jax {jax.__version__}")
    print(f"{'function':28} {'jax-true':>10} {'plugin-true':>12} {'plugin-jax':>11}")
    for name, jax_error, plugin_error, difference in rows:
        print(f"{name:28} {jax_error:10.3g} {plugin_error:12.3g} {difference:11.3g}")


if __name__ == "__main__":
    main()
