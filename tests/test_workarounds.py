"""lower()'s workarounds for plugin builds known to miscompile: worker.plugin.known_builds, applied.

The default CPU plugin (lammps-jax-pjrt-cpu 0.11.2) computes atan2(x, 1.0),
which jnp.arctan lowers to, wrong from about 50 elements; lower() puts the
divisor of every atan2 through an optimization barrier for that build, and
leaves programs for every other plugin as JAX writes them. The tests lower for
that plugin's platform (pjrt_cpu: the cpu platform runs on jaxlib's own client,
no known build) and run in a pool of it.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_PLUGIN, SECOND_PLUGIN, run_python
from jax import lax

from pool import Pool, lower
from pool.conformance import battery
from pool.conformance.budgets import ELEMENTARY
from pool.conformance.compare import ulp_distance
from pool.examples import example_programs
from pool.lowering.workarounds import REWRITES
from worker.plugin.known_builds import KNOWN_BUILDS, WORKAROUNDS_ENV, may_have_uncovered_failures

# Tests here turn the workarounds off in this process on purpose: the warning that then
# names the default plugin's known failures is expected (its own tests run in children).
pytestmark = pytest.mark.filterwarnings(
    "ignore::worker.plugin.conformance_records.KnownPluginFailuresWarning"
)


PLATFORM = "pjrt_cpu"
"""The default CPU plugin's platform: the known build whose programs lower() works around."""


needs_plugin = pytest.mark.skipif(DEFAULT_PLUGIN is None, reason="needs lammps-jax-pjrt-cpu")


@pytest.fixture(scope="module")
def plugin_pool():
    """A worker on the default CPU plugin, which runs the programs lowered for it."""
    if DEFAULT_PLUGIN is None:
        pytest.skip("lammps-jax-pjrt-cpu is not installed")
    with Pool(1, platform=PLATFORM) as pool:
        yield pool


def _within_elementwise_budget(got: np.ndarray, expected: np.ndarray) -> bool:
    """NaN where JAX has NaN, infinities equal, the rest within ELEMENTARY's ULPs."""
    got, expected = np.asarray(got), np.asarray(expected)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return False
    nan = np.isnan(expected)
    if not np.array_equal(np.isnan(got), nan):
        return False
    finite = ~nan
    allowed = ELEMENTARY.allowed(got.dtype)
    return bool(np.all(ulp_distance(got[finite], expected[finite]) <= allowed))


def _divisors_hidden(text: str) -> list[bool]:
    """Per stablehlo.atan2 in the module: whether its divisor comes out of an optimization
    barrier, or is a broadcast of such a value."""
    from jax._src.interpreters import mlir as jax_mlir
    from jaxlib.mlir import ir

    def made_by(value: ir.Value) -> str:
        owner = value.owner
        return "" if isinstance(owner, ir.Block) else owner.operation.name

    found: list[bool] = []

    def visit(operation: ir.Operation) -> ir.WalkResult:
        if operation.name == "stablehlo.atan2":
            divisor = operation.operands[1]
            if made_by(divisor) == "stablehlo.broadcast_in_dim":
                divisor = divisor.owner.operands[0]
            found.append(made_by(divisor) == "stablehlo.optimization_barrier")
        return ir.WalkResult.ADVANCE

    with jax_mlir.make_ir_context():
        ir.Module.parse(text).operation.walk(visit)
    return found


def _arctan_inputs(size: int = 1000, dtype: type = np.float32) -> np.ndarray:
    rng = np.random.default_rng(17)
    x = rng.uniform(-1e4, 1e4, size).astype(dtype)
    x[:6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0]
    return x


def test_the_list_is_consistent():
    names = {case.name for case in battery()}
    for build in KNOWN_BUILDS:
        assert re.fullmatch(r"[0-9a-f]{64}", build.sha256) and build.size > 0
        for failure in build.failures:
            assert failure.cases and set(failure.cases) <= names, failure.cases
            assert "assert" in failure.reproduction
            if failure.workaround is not None:
                assert failure.workaround.name in REWRITES
    used = {w.name for build in KNOWN_BUILDS for w in build.workarounds}
    assert used == set(REWRITES)  # no rewrite that no build needs


@pytest.mark.skipif(DEFAULT_PLUGIN is None, reason="lammps-jax-pjrt-cpu is not installed")
def test_the_default_plugin_is_the_known_build(monkeypatch):
    # The shipped knowledge is about the very file pip installs.
    from worker.identity.build import plugin_digest

    assert plugin_digest(DEFAULT_PLUGIN, None) == KNOWN_BUILDS[0].sha256
    # Its failures are all covered: nothing to warn about, so no need to hash it to find out.
    assert not may_have_uncovered_failures(DEFAULT_PLUGIN)
    monkeypatch.setenv(WORKAROUNDS_ENV, "off")
    assert may_have_uncovered_failures(DEFAULT_PLUGIN)


def _counter(x):
    return lax.fori_loop(0, 3, lambda i, v: (jnp.arctan2(v[0], v[1]), v[1]), (x, jnp.ones_like(x)))[
        0
    ]


_NESTED = jax.jit(lambda x, c: jnp.arctan2(x, c))

FORMS = {
    "jnp.arctan": jnp.arctan,
    "arctan2 with a Python 1.0": lambda x: jnp.arctan2(x, 1.0),
    "arctan2 with ones_like": lambda x: jnp.arctan2(x, jnp.ones_like(x)),
    "a divisor XLA folds to 1.0": lambda x: jnp.arctan2(x, jnp.full_like(x, 0.5) + 0.5),
    "a select on a constant": lambda x: jnp.arctan2(x, jnp.where(True, jnp.ones_like(x), x)),
    "a nested jit given 1.0": lambda x: _NESTED(x, 1.0),
    "a scan body": lambda x: lax.scan(lambda c, r: (c, jnp.arctan(r)), 0.0, x.reshape(4, -1))[1],
    "a while body": lambda x: lax.while_loop(
        lambda v: v[1] < 2, lambda v: (jnp.arctan(v[0]), v[1] + 1), (x, 0)
    )[0],
    "ones carried through a loop": _counter,
    "a cond branch": lambda x: lax.cond(x[7] > -1e5, jnp.arctan, jnp.sin, x),
    "vmap": lambda x: jax.vmap(jnp.arctan)(x.reshape(10, -1)),
    "2-D": lambda x: jnp.arctan(x.reshape(20, -1)),
    "float16": lambda x: jnp.arctan(x.astype(jnp.float16)),
}
"""Ways a program comes to hold atan2 with the divisor 1.0: each is wrong without the workaround."""


@pytest.mark.parametrize("form", FORMS)
def test_every_form_of_atan2_by_one_is_right_and_was_wrong(form, monkeypatch, plugin_pool):
    function = FORMS[form]
    x = _arctan_inputs()
    expected = [np.asarray(e) for e in jax.tree.leaves(jax.jit(function)(x))]
    program = lower(function, [x], platform=PLATFORM)
    hidden = _divisors_hidden(program.text)
    assert hidden and all(hidden), program.text
    outputs = plugin_pool.run(program, [x])
    assert all(_within_elementwise_budget(o, e) for o, e in zip(outputs, expected, strict=True))

    monkeypatch.setenv(WORKAROUNDS_ENV, "off")
    raw = lower(function, [x], platform=PLATFORM)
    assert "optimization_barrier" not in raw.text and raw.text != program.text
    outputs = plugin_pool.run(raw, [x])
    assert not all(_within_elementwise_budget(o, e) for o, e in zip(outputs, expected, strict=True))


UNKNOWN_DIVISORS = {
    "two arrays": lambda x: jnp.arctan2(x, x[::-1]),
    "atan2(sin x, cos x)": lambda x: jnp.arctan2(jnp.sin(x), jnp.cos(x)),
    "arcsin": lambda x: jnp.arcsin(x / 1e4),
    "arccos": lambda x: jnp.arccos(x / 1e4),
    "complex log": lambda x: jnp.log(x + 1j * x[::-1]),
    "angle": lambda x: jnp.angle(x - 1j * x),
    "a nested jit given 2 * x": lambda x: _NESTED(x, 2 * x),
}
"""Divisors computed from the inputs, which XLA cannot see as constants: left as JAX wrote them."""


@needs_plugin
@pytest.mark.parametrize("form", UNKNOWN_DIVISORS)
def test_divisors_computed_from_the_inputs_are_left_alone(form, monkeypatch):
    function, x = UNKNOWN_DIVISORS[form], _arctan_inputs()
    texts = []
    for switch in ("on", "off"):
        monkeypatch.setenv(WORKAROUNDS_ENV, switch)
        texts.append(lower(function, [x], platform=PLATFORM).text)
    assert "stablehlo.atan2" in texts[0] and texts[0] == texts[1]


@needs_plugin
def test_a_barrier_already_there_is_kept_and_not_doubled():
    def written_around(x):  # the workaround the README used to give
        return jnp.arctan2(x, lax.optimization_barrier(jnp.ones_like(x)))

    x = _arctan_inputs(64)
    text = lower(written_around, [x], platform=PLATFORM).text
    assert text.count("optimization_barrier") == 1


@needs_plugin
def test_programs_without_atan2_are_unchanged(monkeypatch):
    for name, function, shapes in example_programs():
        both = []
        for switch in ("on", "off"):  # one call site: the bytecode's locations are the same
            monkeypatch.setenv(WORKAROUNDS_ENV, switch)
            both.append(lower(function, shapes, platform=PLATFORM))
        assert "stablehlo.atan2" not in both[0].text, name
        assert (both[0].code, both[0].text) == (both[1].code, both[1].text), name


@needs_plugin
def test_a_bad_switch_is_refused(monkeypatch):
    monkeypatch.setenv(WORKAROUNDS_ENV, "maybe")
    with pytest.raises(ValueError, match="PJRT_POOL_WORKAROUNDS is 'maybe'; set it to 'on'"):
        lower(jnp.arctan, [np.zeros(4, np.float32)], platform=PLATFORM)


_TEXT_AND_CODE = """
import hashlib, os, numpy as np, jax.numpy as jnp
from pool import lower
for switch in ("on", "off"):
    os.environ["PJRT_POOL_WORKAROUNDS"] = switch
    program = lower(jnp.arctan, [np.zeros(1000, np.float32)])
    print(switch, hashlib.sha256(program.code).hexdigest(), repr(program.text))
"""


@pytest.mark.slow
@pytest.mark.skipif(SECOND_PLUGIN is None, reason="xla-cpu-pjrt is not installed")
def test_programs_for_another_plugin_are_exactly_as_jax_writes_them(tmp_path):
    def both(plugin: str) -> dict[str, tuple[str, str]]:
        env = {"PJRT_POOL_PLUGIN_CPU": plugin, "PJRT_POOL_CACHE_DIR": str(tmp_path / "c")}
        lines = run_python(_TEXT_AND_CODE, env=env).stdout.splitlines()
        return {line.split()[0]: tuple(line.split(" ", 2)[1:]) for line in lines}

    second = both(SECOND_PLUGIN)
    assert second["on"] == second["off"]  # bytecode and text alike
    assert "optimization_barrier" not in second["on"][1]
    default = both(DEFAULT_PLUGIN)
    assert default["on"][1] != default["off"][1] and "optimization_barrier" in default["on"][1]
    assert default["off"][1] == second["on"][1]  # the text as JAX writes it


_FRESH = """
import warnings
import jax, jax.numpy as jnp, numpy as np
from pool import Pool, compile_program, lower
from pool.conformance.compare import ulp_distance

x = np.random.default_rng(17).uniform(-1e4, 1e4, 1000).astype(np.float32)
x[:6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0]
expected = np.asarray(jax.jit(jnp.arctan)(x))


def ulps(got):
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    finite = ~np.isnan(expected)
    return int(ulp_distance(got[finite], expected[finite]).max())


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    program = lower(jnp.arctan, [x])
    (out,) = compile_program(program)[0].run([x])
    print("compile_program", ulps(out))
    with Pool(2) as pool:
        (out,) = pool.run(program, [x])
        print("Pool.run", ulps(out))
        out = pool.function(jnp.arctan)(x)
        print("Pool.function", ulps(np.asarray(out)))
print("warnings", len(caught), [str(w.message)[:80] for w in caught])
"""


@pytest.mark.slow
@pytest.mark.skipif(DEFAULT_PLUGIN is None, reason="lammps-jax-pjrt-cpu is not installed")
def test_arctan_is_right_in_a_fresh_cache_and_environment(tmp_path):
    env = {"PJRT_POOL_CACHE_DIR": str(tmp_path / "cache"), "PJRT_POOL_PLUGIN_CPU": DEFAULT_PLUGIN}
    lines = run_python(_FRESH, env=env, timeout=180).stdout.splitlines()
    ulps = dict(line.split() for line in lines[:3])
    assert ulps.keys() == {"compile_program", "Pool.run", "Pool.function"}
    assert all(int(u) <= ELEMENTARY.ulps for u in ulps.values()), ulps
    assert lines[3] == "warnings 0 []"  # the known failure is covered: nothing to warn about


_REPRODUCE = """
import warnings
warnings.simplefilter("ignore")
{code}
print("right")
"""


@pytest.mark.slow
def test_each_reproduction_fails_without_its_workaround_and_passes_with_it(tmp_path):
    for build in KNOWN_BUILDS:
        env = {"PJRT_POOL_CACHE_DIR": str(tmp_path / "cache")}
        if DEFAULT_PLUGIN is not None and build.sha256 == KNOWN_BUILDS[0].sha256:
            env["PJRT_POOL_PLUGIN_CPU"] = DEFAULT_PLUGIN
        for failure in build.failures:
            code = _REPRODUCE.format(code=failure.reproduction)
            raw = run_python(code, env={**env, WORKAROUNDS_ENV: "off"}, check=False)
            assert raw.returncode != 0 and "AssertionError" in raw.stderr, raw.stderr[-2000:]
            if failure.workaround is not None:
                assert run_python(code, env=env).stdout.strip() == "right"


_WARNS = """
import warnings, numpy as np, jax.numpy as jnp
from pool import Pool, compile_program, lower
from worker.plugin.conformance_records import KnownPluginFailuresWarning
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    {call}
found = [w for w in caught if issubclass(w.category, KnownPluginFailuresWarning)]
print(len(found))
for w in found:
    print(w.filename, "|", w.message)
"""


@pytest.mark.slow
@pytest.mark.skipif(DEFAULT_PLUGIN is None, reason="lammps-jax-pjrt-cpu is not installed")
def test_shipped_knowledge_warns_with_no_memo_on_disk(tmp_path):
    cache = tmp_path / "cache"
    env = {"PJRT_POOL_CACHE_DIR": str(cache), "PJRT_POOL_PLUGIN_CPU": DEFAULT_PLUGIN}
    compile_twice = (
        "program = lower(jnp.sin, [np.zeros(4, np.float32)]); "
        "compile_program(program); compile_program(program)"
    )
    pool_twice = "Pool(1).close(); Pool(1).close()"
    for call in (compile_twice, pool_twice):
        # Workarounds on: every known failure of the build is covered, nothing to say.
        assert run_python(_WARNS.format(call=call), env=env).stdout.splitlines() == ["0"]
        # Off: the shipped list says what is wrong, once per process, at the caller's line.
        off = {**env, WORKAROUNDS_ENV: "off"}
        lines = run_python(_WARNS.format(call=call), env=off).stdout.splitlines()
        assert lines[0] == "1", lines
        filename, message = lines[1].split(" | ", 1)
        assert filename == "<string>"
        assert "elementwise/arctan/float32/n64" in message and "computes 10 conformance" in message
        assert "as pjrt-pool knows of lammps-jax-pjrt-cpu 0.11.2" in message
        assert "atan2-divisor-barrier" in message and "PJRT_POOL_WORKAROUNDS=off" in message
    assert not list(cache.glob("plugins/conformance-*"))  # no check-plugin record was involved


@pytest.mark.slow
@pytest.mark.skipif(DEFAULT_PLUGIN is None, reason="lammps-jax-pjrt-cpu is not installed")
def test_the_workaround_changes_no_result_but_the_wrong_ones(monkeypatch, plugin_pool):
    """Every battery program with an atan2, with and without the workaround.

    Measured: bit for bit the same, except the known failures, which the
    workaround makes right, and the same operations (atan2 by the constant
    1) below the size where they fail, where XLA's general atan2 that the
    barrier leads to is up to 1 ULP from its atan2(x, 1) (and the closer of
    the two to the true value, where they differ in the battery).
    """
    failing = {case for failure in KNOWN_BUILDS[0].failures for case in failure.cases}
    by_one = {name.split("/")[1] for name in failing}  # arctan, atan2_const1
    compared = 0
    for case in battery():
        if case.family != "elementwise":  # no other family's programs hold an atan2
            continue
        with jax.enable_x64(case.x64):
            inputs = case.make_inputs()
            monkeypatch.delenv(WORKAROUNDS_ENV, raising=False)
            program = lower(case.function, inputs, platform=PLATFORM)
            if "stablehlo.atan2" not in program.text:
                continue  # unchanged (test_programs_without_atan2_are_unchanged)
            monkeypatch.setenv(WORKAROUNDS_ENV, "off")
            unchanged = lower(case.function, inputs, platform=PLATFORM)
        fixed, raw = (plugin_pool.run(p, inputs) for p in (program, unchanged))
        for a, b in zip(fixed, raw, strict=True):
            if case.name in failing:
                assert not np.array_equal(a, b, equal_nan=True), case.name
            elif case.name.split("/")[1] in by_one:
                assert ulp_distance(a, b).max() <= 1, case.name
            else:
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), case.name
        compared += 1
    assert compared >= 50  # arcsin, arccos, arctan, the atan2 cases, complex log
