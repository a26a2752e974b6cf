"""Lowering a program over several devices: its shardings at the boundary and its Partitioning.

A function is sharded when a mesh shows anywhere in it: an argument with a
NamedSharding (a jax.Array placed on a mesh, a ShapeDtypeStruct with a
sharding), in_shardings= or out_shardings= given to lower or Pool.function,
a jax.jit with shardings or a shard_map inside it, a sharding constraint.
Such a program is lowered as jax.jit would compile it, with one difference:
every input and output of the program gets a sharding of its own, so that
the worker knows how to cut each global argument into its devices' blocks
and put each output together, without asking the compiler (the PJRT C API
has no call for it). Each boundary sharding is, first to last:

    given       in_shardings / out_shardings (a pytree prefix, as jax.jit takes them)
    placed      an argument's own sharding (jax.Array, ShapeDtypeStruct(sharding=...))
    inside      what the traced function says at its boundary: a jax.jit inside with
                shardings for that argument or result, a shard_map's in_specs or
                out_specs (followed into a jax.jit without shardings)
    replicated  NamedSharding(mesh, P()): where nothing says otherwise, JAX lets the
                compiler choose; here the output is replicated, which costs the
                devices a gather, never a wrong number

With all of them given, the program is exactly the one ``jax.jit(f,
in_shardings=..., out_shardings=...)`` compiles (the deviceless TPU tests
compare the executables' fingerprints). The Partitioning record (worker.
partitioning) then says, for each device of the mesh in device-assignment
order, each array's block, from JAX's own Sharding.devices_indices_map, or
for an AbstractMesh (which has no devices) from the PartitionSpec. On
platforms other than TPU the devices are renumbered 0..k-1 in the mesh's
order: any k devices of a CPU or a GPU are alike, and a worker's are 0..k-1;
a TPU's ids name chips, whose places in the topology matter.

The jaxpr is read through its equations' parameters (in_shardings,
out_shardings and jaxpr of a jax.jit; mesh, in_specs and out_specs of a
shard_map), which are JAX's and may change between versions: where they are
missing, the boundary falls back to the next rule, and a mesh is then still
found among any parameter's values.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from worker.identity.keys import PlatformPart
from worker.partitioning import ArraySharding, Partitioning
from worker.plugin.platforms.registry import platform_named

Mesh = Any
"""A jax.sharding.Mesh or AbstractMesh."""


def flat_shardings(prefix: Any, tree: Any, what: str) -> list[Any]:
    """Shardings given as a pytree prefix of `tree` (as jax.jit takes them), one per leaf
    (None where the prefix gives none); raises ValueError when it is not a prefix."""
    if prefix is None:
        return [None] * len(jax.tree_util.tree_leaves(tree))
    try:
        return jax.tree_util.tree_leaves(
            jax.tree.broadcast(prefix, tree, is_leaf=lambda x: x is None), is_leaf=_is_none
        )
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{what} must be a sharding or a pytree prefix of the arguments' (as jax.jit takes "
            f"it): {error}"
        ) from None


def _is_none(value: Any) -> bool:
    return value is None


def _mesh_of(value: Any) -> Mesh | None:
    """The mesh a parameter value names (a NamedSharding's, a Mesh itself), if a real one."""
    mesh = value.mesh if isinstance(value, NamedSharding) else value
    if isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)) and mesh.axis_names:
        return mesh
    return None


def _params_values(equation: Any) -> Iterator[Any]:
    for value in equation.params.values():
        yield from value if isinstance(value, (tuple, list)) else (value,)


def _sub_jaxprs(equation: Any) -> Iterator[Any]:
    for value in _params_values(equation):
        inner = getattr(value, "jaxpr", value)  # a ClosedJaxpr holds its Jaxpr
        if hasattr(inner, "eqns"):
            yield inner


def find_mesh(jaxpr: Any) -> Mesh | None:
    """The first mesh any equation of a jaxpr (or of the jaxprs inside it) names."""
    for equation in jaxpr.eqns:
        for value in _params_values(equation):
            mesh = _mesh_of(value)
            if mesh is not None:
                return mesh
        for inner in _sub_jaxprs(equation):
            mesh = find_mesh(inner)
            if mesh is not None:
                return mesh
    return None


def _concrete(sharding: Any) -> Any | None:
    """A sharding that says where an array goes (a NamedSharding on a real mesh), or None for
    JAX's unspecified ones."""
    return sharding if isinstance(sharding, NamedSharding) and _mesh_of(sharding) else None


def _inside_input(jaxpr: Any, index: int) -> Any | None:
    """What the traced function says of its input `index`: the first equation using it."""
    var = jaxpr.invars[index]
    for equation in jaxpr.eqns:
        for position, used in enumerate(equation.invars):
            if used is not var:
                continue
            found = _sharding_at(equation, position, "in")
            if found is not None:
                return found
    return None


def _inside_output(jaxpr: Any, index: int) -> Any | None:
    """What the traced function says of its output `index`: the equation making it."""
    var = jaxpr.outvars[index]
    for equation in jaxpr.eqns:
        for position, made in enumerate(equation.outvars):
            if made is var:
                return _sharding_at(equation, position, "out")
    return None


def _sharding_at(equation: Any, position: int, side: str) -> Any | None:
    """The sharding a jax.jit or shard_map equation gives its argument or result `position`."""
    params = equation.params
    shardings = params.get(f"{side}_shardings")
    if isinstance(shardings, tuple) and position < len(shardings):
        found = _concrete(shardings[position])
        if found is not None:
            return found
        inner = getattr(params.get("jaxpr"), "jaxpr", None)
        if inner is not None:  # a jax.jit without its own sharding here: look inside
            follow = _inside_input if side == "in" else _inside_output
            return follow(inner, position)
    specs = params.get(f"{side}_specs")
    mesh = _mesh_of(params.get("mesh"))
    if mesh is not None and isinstance(specs, tuple) and position < len(specs):
        spec = specs[position]
        if isinstance(spec, PartitionSpec):
            return NamedSharding(mesh, spec)
    return None


def declared_devices(*trees: Any) -> int:
    """How many devices the shardings given with a program say it runs on, before it is
    traced: the size of the largest mesh a NamedSharding names among the leaves of `trees`
    (in_shardings, out_shardings, and the arguments, whose jax.Arrays and ShapeDtypeStructs
    may carry one); 1 when none does. A mesh seen only inside the function (a shard_map)
    shows once it is lowered."""
    largest = 1
    for tree in trees:
        for leaf in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, NamedSharding)):
            sharding = leaf if isinstance(leaf, NamedSharding) else getattr(leaf, "sharding", None)
            mesh = _mesh_of(sharding) if isinstance(sharding, NamedSharding) else None
            if mesh is not None:
                largest = max(largest, int(mesh.size))
    return largest


def boundary_shardings(
    jaxpr: Any, given_in: Sequence[Any], given_out: Sequence[Any], placed: Sequence[Any]
) -> tuple[Mesh, list[Any], list[Any]] | None:
    """The mesh and every input's and output's sharding (see the module), or None for a
    program of one device (no mesh anywhere). jaxpr is the traced function's."""
    known = [_concrete(s) for s in [*given_in, *given_out, *placed]]
    mesh = next((s.mesh for s in known if s is not None), None) or find_mesh(jaxpr)
    if mesh is None:
        return None
    replicated = NamedSharding(mesh, PartitionSpec())
    inputs = [
        _concrete(given) or _concrete(own) or _inside_input(jaxpr, i) or replicated
        for i, (given, own) in enumerate(zip(given_in, placed, strict=True))
    ]
    outputs = [
        _concrete(given) or _inside_output(jaxpr, i) or replicated
        for i, given in enumerate(given_out)
    ]
    return mesh, inputs, outputs


def _mesh_devices(mesh: Mesh, platform: str) -> tuple[int, ...]:
    """The device ids of the device assignment (the mesh's devices in order); see the module
    for the renumbering off TPU."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return tuple(range(mesh.size))
    ids = [int(d.id) for d in mesh.devices.flat]
    if PlatformPart.TOPOLOGY in platform_named(platform).platform_parts:
        return tuple(ids)  # a TPU's: its ids name chips, whose places in the topology matter
    rank = {device: position for position, device in enumerate(sorted(ids))}
    return tuple(rank[i] for i in ids)


def _spec_blocks(mesh: Mesh, spec: PartitionSpec, shape: tuple[int, ...]) -> list[Any]:
    """Each mesh position's block of an array under a PartitionSpec, worked out from the spec
    (for an AbstractMesh, which has no devices to ask): each axis is split over the mesh axes
    its entry names, major to minor, as JAX splits it."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    entries = list(spec) + [None] * (len(shape) - len(spec))
    blocks = []
    for coords in np.ndindex(*mesh.axis_sizes):
        at = dict(zip(mesh.axis_names, coords, strict=True))
        block = []
        for length, entry in zip(shape, entries, strict=True):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            parts, index = 1, 0
            for axis in axes:
                parts, index = parts * sizes[axis], index * sizes[axis] + at[axis]
            step = length // parts
            block.append((index * step, index * step + step))
        blocks.append(tuple(block))
    return blocks


def _array_sharding(sharding: NamedSharding, shape: tuple[int, ...]) -> ArraySharding:
    """One array's blocks, device by device in the mesh's order."""
    mesh = sharding.mesh
    if isinstance(mesh, jax.sharding.AbstractMesh):
        blocks = _spec_blocks(mesh, sharding.spec, shape)
    else:
        indices = sharding.devices_indices_map(shape)
        blocks = [
            tuple(
                (part.start or 0, length if part.stop is None else part.stop)
                for part, length in zip(indices[device], shape, strict=True)
            )
            for device in mesh.devices.flat
        ]
    return ArraySharding(tuple(shape), tuple(blocks), str(sharding.spec))


def partitioning_of(
    mesh: Mesh,
    inputs: Sequence[tuple[NamedSharding, tuple[int, ...]]],
    outputs: Sequence[tuple[NamedSharding, tuple[int, ...]]],
    platform: str,
    text: str,
) -> Partitioning:
    """The Partitioning record of a program lowered with these boundary shardings (each with
    its array's shape) over `mesh`; text is the program's module (Shardy's form shows in it).
    Raises ValueError for shardings over another mesh's devices."""
    for sharding, _ in [*inputs, *outputs]:
        if sharding.mesh.shape_tuple != mesh.shape_tuple or _mesh_devices(
            sharding.mesh, platform
        ) != _mesh_devices(mesh, platform):
            raise ValueError(
                f"the program's shardings are over two meshes ({mesh} and {sharding.mesh}): "
                "use one mesh, as jax.jit requires"
            )
    return Partitioning(
        num_replicas=1,
        num_partitions=mesh.size,
        device_ids=_mesh_devices(mesh, platform),
        mesh=tuple((str(name), int(size)) for name, size in mesh.shape.items()),
        shardy="sdy.mesh" in text,
        inputs=tuple(_array_sharding(s, shape) for s, shape in inputs),
        outputs=tuple(_array_sharding(s, shape) for s, shape in outputs),
    )
