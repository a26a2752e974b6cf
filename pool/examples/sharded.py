"""Programs over several devices: jax.jit with shardings over a Mesh, and shard_map collectives.

The tests (tests/test_sharding.py, the deviceless TPU tests), the TPU chip
check (tools/tpu_sharding_check.py) and the docs use these. Each case is
built for a mesh whose first axis is "data" and whose second, if any, is
"model" (make_mesh); a case names its function, its argument shapes and the
shardings to give jax.jit (or, as None, none: a shard_map says its own).

    for case in sharded_cases(mesh):
        expected = jax.jit(case.function, **case.jit_shardings())(*case.arguments())
        program = pool.lower(case.function, case.shapes, **case.jit_shardings())
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ROWS, COLUMNS = 16, 8
"""The arguments' shape: divisible by every mesh axis of up to 8 devices."""


def make_mesh(devices: Sequence[Any], shape: tuple[int, ...]) -> Mesh:
    """A mesh of the first prod(shape) devices: axes ("data",) or ("data", "model")."""
    count = int(np.prod(shape))
    names = ("data", "model")[: len(shape)]
    return Mesh(np.array(list(devices)[:count]).reshape(shape), names)


class ShardedCase(NamedTuple):
    """One program over a mesh (see the module)."""

    name: str
    function: Callable[..., Any]
    shapes: list[jax.ShapeDtypeStruct]
    in_specs: Any = None
    """PartitionSpecs of the arguments for jax.jit (a tuple), or None: the function says."""
    out_specs: Any = None
    """PartitionSpec(s) of the result for jax.jit, or None: the function says."""
    mesh: Mesh | None = None

    def jit_shardings(self) -> dict[str, Any]:
        """The in_shardings and out_shardings to give jax.jit (and lower, Pool.function)."""
        given = {}
        if self.in_specs is not None:
            given["in_shardings"] = _named(self.mesh, self.in_specs)
        if self.out_specs is not None:
            given["out_shardings"] = _named(self.mesh, self.out_specs)
        return given

    def arguments(self, seed: int = 0) -> list[np.ndarray]:
        """Seeded arguments of the case's shapes."""
        generator = np.random.default_rng(seed)
        return [generator.standard_normal(s.shape).astype(s.dtype) for s in self.shapes]


def _named(mesh: Mesh | None, specs: Any) -> Any:
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
    )


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def sharded_cases(mesh: Mesh) -> list[ShardedCase]:
    """The cases for a mesh with axis "data" and, for two axes, "model" (see the module)."""
    x, w = _f32(ROWS, COLUMNS), _f32(COLUMNS, COLUMNS)
    two_axes = "model" in mesh.axis_names
    model = "model" if two_axes else None
    cases = [
        # jit: inputs split by rows (and columns), a matmul, outputs of each kind.
        ShardedCase(
            "jit_rows",
            lambda x, w: jnp.tanh(x @ w),
            [x, w],
            (P("data", None), P(None, model)),
            P("data", model),
            mesh,
        ),
        ShardedCase(
            "jit_replicated_output",
            lambda x: jnp.sum(x * 2.0, axis=0),
            [x],
            (P("data", model),),
            P(),
            mesh,
        ),
        ShardedCase(
            "jit_partly_replicated_output",  # split over data, replicated over model
            lambda x, w: (x @ w, jnp.max(x, axis=1)),
            [x, w],
            (P("data", None), P(None, model)),
            (P("data", None), P("data")),
            mesh,
        ),
        # shard_map: one collective each, the axis index, shifts between devices.
        ShardedCase(
            "psum",
            jax.shard_map(
                lambda x: jax.lax.psum(jnp.sum(x, 0, keepdims=True), "data"),
                mesh=mesh,
                in_specs=P("data", model),
                out_specs=P(None, model),
            ),
            [x],
            mesh=mesh,
        ),
        ShardedCase(
            "all_gather",
            jax.shard_map(
                lambda x: jax.lax.all_gather(x, "data", tiled=True),
                mesh=mesh,
                in_specs=P("data", model),
                out_specs=P(None, model),
                check_vma=False,
            ),
            [x],
            mesh=mesh,
        ),
        ShardedCase(
            "ppermute",
            jax.shard_map(
                lambda x: jax.lax.ppermute(x, "data", _ring(mesh.shape["data"])),
                mesh=mesh,
                in_specs=P("data", model),
                out_specs=P("data", model),
            ),
            [x],
            mesh=mesh,
        ),
        ShardedCase("axis_index", axis_index_program(mesh), [x], mesh=mesh),
    ]
    return cases


def _ring(size: int) -> list[tuple[int, int]]:
    """Each device sends to the next along an axis, the last to the first."""
    return [(i, (i + 1) % size) for i in range(size)]


def axis_index_program(mesh: Mesh) -> Callable[..., Any]:
    """x + the flat index of the device's place in the mesh, on each device's block: each
    block of the result says which partition made it."""
    axes = tuple(mesh.axis_names)
    spec = P(*axes) if len(axes) == 2 else P(axes[0], None)

    def body(x: jax.Array) -> jax.Array:
        index = jnp.zeros((), jnp.int32)
        for axis in axes:
            index = index * mesh.shape[axis] + jax.lax.axis_index(axis)
        return x * 0 + index.astype(x.dtype)

    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)


# -- a sharded MLP training step over a pytree ---------------------------------------------

HIDDEN = 16
"""The MLP's hidden width (split over "model")."""


def mlp_parameters(seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded parameters of the MLP: w1 (COLUMNS, HIDDEN), b1, w2 (HIDDEN, COLUMNS), b2."""
    generator = np.random.default_rng(seed)
    return {
        "w1": (generator.standard_normal((COLUMNS, HIDDEN)) * 0.3).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (generator.standard_normal((HIDDEN, COLUMNS)) * 0.3).astype(np.float32),
        "b2": np.zeros(COLUMNS, np.float32),
    }


def mlp_batch(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A seeded batch (x, y) of ROWS rows."""
    generator = np.random.default_rng(seed)
    x = generator.standard_normal((ROWS, COLUMNS)).astype(np.float32)
    return x, np.sin(x).astype(np.float32)


def mlp_step(params: dict[str, jax.Array], batch: tuple[jax.Array, jax.Array]) -> Any:
    """One SGD step of a tanh MLP on mean squared error: (new parameters, loss)."""

    def loss(p: dict[str, jax.Array]) -> jax.Array:
        x, y = batch
        hidden = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((hidden @ p["w2"] + p["b2"] - y) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def mlp_shardings(mesh: Mesh) -> tuple[Any, Any]:
    """(in_shardings, out_shardings) of mlp_step: the batch split over "data", the hidden
    layer over "model" (replicated on a mesh of one axis), the loss replicated."""
    model = "model" if "model" in mesh.axis_names else None
    params = {
        "w1": NamedSharding(mesh, P(None, model)),
        "b1": NamedSharding(mesh, P(model)),
        "w2": NamedSharding(mesh, P(model, None)),
        "b2": NamedSharding(mesh, P()),
    }
    batch = (NamedSharding(mesh, P("data", None)),) * 2
    return (params, batch), (params, NamedSharding(mesh, P()))


def every_program(mesh: Mesh) -> list[tuple[str, Callable[..., Any], list[Any], dict[str, Any]]]:
    """(name, function, shapes, jax.jit's shardings) of every case and of the MLP step, over a
    mesh whose axes are ("data", "model") (an AbstractMesh will do: nothing runs)."""
    found = [(c.name, c.function, c.shapes, c.jit_shardings()) for c in sharded_cases(mesh)]
    ins, outs = mlp_shardings(mesh)
    shapes = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), [mlp_parameters(), mlp_batch()]
    )
    return [*found, ("mlp_step", mlp_step, shapes, {"in_shardings": ins, "out_shardings": outs})]
