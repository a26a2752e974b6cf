"""The compile options of a lowered program: the ones jax.jit compiles it with.

XLA's CompileOptionsProto carries the compiler's debug options. JAX makes its
options with jaxlib's CompileOptions, which fills them with XLA's defaults
and this process's XLA_FLAGS; a proto without them (the six bytes of
worker.identity.options.compile_options) makes XLA compile otherwise: on
jaxlib's own CPU compiler a transformer's train step gave jax.jit's outputs
in 6 of its 86 arrays with those, and in all 86 with JAX's
(docs/facts.md, JAX and jaxlib). So lower() records, for each program, the serialized
options that JAX's get_compile_options gives for it, with the fields
jax.jit sets on top: sharding propagation allowed at an unsharded
program's boundary and forbidden at a sharded one's (whose boundaries are
all annotated), and for a program over several devices its replicas,
partitions, device assignment and partitioner. A program of one device gets
no device assignment: a worker runs it on its own device, as a PJRT plugin
does when none is given.

get_compile_options is private to JAX; this module is the only place that
calls it, with a clear error when a JAX moved it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from worker.errors import PjrtPoolError
from worker.partitioning import Partitioning


class CompileOptionsError(PjrtPoolError, RuntimeError):
    """This JAX has no get_compile_options where pjrt-pool expects it."""


def _jax_compiler() -> Any:
    try:
        from jax._src import compiler
    except ImportError as error:  # pragma: no cover - a JAX outside the supported range
        raise CompileOptionsError(
            f"this JAX version moved jax._src.compiler ({error}); "
            "install a jax within pjrt-pool's supported range"
        ) from None
    if not hasattr(compiler, "get_compile_options") or not hasattr(
        compiler, "use_detailed_logging"
    ):
        raise CompileOptionsError(
            "this JAX version has no jax._src.compiler.get_compile_options; "
            "install a jax within pjrt-pool's supported range"
        )
    return compiler


def detailed_logging(module: Any) -> bool:
    """Whether JAX compiles `module` (an MLIR module of JAX's context) with detailed
    logging: one of its debug options, on for all but the smallest programs."""
    return bool(_jax_compiler().use_detailed_logging(module))


def jit_compile_options(
    detailed: bool, inputs: int, outputs: int, partitioning: Partitioning | None
) -> bytes:
    """The serialized options jax.jit compiles a program with: `inputs` and `outputs` count
    its arguments and results; detailed is what detailed_logging said of its module."""
    compiler = _jax_compiler()
    if partitioning is None:
        options = compiler.get_compile_options(
            num_replicas=1,
            num_partitions=1,
            detailed_logging=detailed,
        )
        propagate = True
    else:
        assignment = np.array(partitioning.device_ids, dtype=np.int64).reshape(
            partitioning.num_replicas, partitioning.num_partitions
        )
        options = compiler.get_compile_options(
            num_replicas=partitioning.num_replicas,
            num_partitions=partitioning.num_partitions,
            device_assignment=assignment,
            detailed_logging=detailed,
        )
        # The partitioner the module was written for, whatever JAX's setting is now.
        options.executable_build_options.use_shardy_partitioner = partitioning.shardy
        propagate = False
    build = options.executable_build_options
    build.allow_spmd_sharding_propagation_to_parameters = [propagate] * inputs
    build.allow_spmd_sharding_propagation_to_output = [propagate] * outputs
    return bytes(options.SerializeAsString())
