"""Real optax and equinox code through Pool.function and `pjrt-pool warm --lower-workers`."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pjrt_pool, run_python

from pool import Pool, lower

optax = pytest.importorskip("optax")
eqx = pytest.importorskip("equinox")


def data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    return x, np.sin(x[:, :2]).astype(np.float32)


@pytest.mark.slow
def test_an_equinox_model_and_an_optax_adamw_schedule_train_as_under_jax_jit() -> None:
    model = eqx.nn.MLP(4, 2, 16, 2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    optimizer = optax.adamw(schedule)

    def train_step(params, static, opt_state, x, y):
        def loss(p):
            prediction = jax.vmap(eqx.combine(p, static))(x)
            return jnp.mean((prediction - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    reference = jax.jit(train_step, static_argnums=1)
    expected = (params, optimizer.init(params))
    with Pool(workers=1) as pool:
        step = pool.function(train_step, static_argnums=1)
        state = (params, optimizer.init(params))
        for seed in range(4):
            *state, loss = step(state[0], static, state[1], *data(seed))
            *expected, expected_loss = reference(expected[0], static, expected[1], *data(seed))
            np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    got_leaves = jax.tree_util.tree_leaves(state)
    expected_leaves = jax.tree_util.tree_leaves(expected)
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(expected)
    for got, want in zip(got_leaves, expected_leaves, strict=True):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


EQUINOX_SPEC = """
import jax, jax.numpy as jnp, equinox as eqx


class Net(eqx.Module):
    layers: list
    scale: float = eqx.field(static=True, default=2.0)

    def __init__(self, key):
        self.layers = [eqx.nn.Linear(4, 8, key=key), eqx.nn.Linear(8, 2, key=key)]

    def __call__(self, x):
        return self.layers[1](jax.nn.relu(self.layers[0](x))) * self.scale


model = Net(jax.random.key(0))
params, static = eqx.partition(model, eqx.is_array)


def forward(params, x):
    return eqx.combine(params, static)(x)


def programs():
    shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    return [("equinox", forward, [shapes, jax.ShapeDtypeStruct((4,), jnp.float32)])]
"""


@pytest.mark.slow
def test_warm_lowers_here_an_equinox_program_that_a_lowering_process_cannot(tmp_path: Path):
    spec = tmp_path / "equinox_spec.py"
    spec.write_text(EQUINOX_SPEC)
    done = pjrt_pool(
        "warm", str(spec), "--cache-dir", str(tmp_path / "cache"), "--workers", "1",
        "--lower-workers", "1", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (program,) = json.loads(done.stdout)["programs"]
    assert program["outcome"] == "compiled"
    assert program["note"].startswith("could not be sent to a lowering process")


def checked_double(x):
    """An equinox runtime check, as diffrax, lineax and optimistix make them."""
    return eqx.error_if(x, x < 0, "x must not be negative") * 2


def test_an_equinox_check_is_refused_with_what_makes_it_lower() -> None:
    with pytest.raises(ValueError, match="calls back into Python") as caught:
        lower(checked_double, [jax.ShapeDtypeStruct((3,), jnp.float32)])
    message = str(caught.value)
    assert "equinox" in message
    assert "EQX_ON_ERROR=nan before equinox is imported" in message


def test_with_eqx_on_error_nan_an_equinox_check_lowers_and_runs_as_under_jax_jit() -> None:
    done = run_python(
        """
        import jax, jax.numpy as jnp, numpy as np, equinox as eqx
        from pool import Pool
        def checked_double(x):
            return eqx.error_if(x, x < 0, "x must not be negative") * 2
        with Pool(workers=1) as pool:
            ours = pool.function(checked_double)
            for x in ([1.0, 2.0, 3.0], [1.0, -1.0, 3.0]):
                x = np.asarray(x, np.float32)
                print(ours(x).tolist(), np.asarray(jax.jit(checked_double)(x)).tolist())
        """,
        env={"EQX_ON_ERROR": "nan"},
    )
    good, bad = done.stdout.splitlines()
    assert good == "[2.0, 4.0, 6.0] [2.0, 4.0, 6.0]"
    assert bad == "[nan, nan, nan] [nan, nan, nan]"
