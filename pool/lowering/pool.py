"""The Pool users import (``pool.Pool``): the executor's Pool, and Pool.function.

The executor (pool/executor) runs programs and knows nothing of JAX, nor of
this side of the package; Pool.function, which lowers JAX functions, is
wired here, where lowering lives. JAX is imported when a function is made
(about a second), never by importing this module: a pool that only runs
warmed programs (pool.manifest) does not pay for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pool.executor import pool as executor

if TYPE_CHECKING:
    from pool.lowering.function import PoolFunction


class Pool(executor.Pool):
    __doc__ = executor.Pool.__doc__

    def function(
        self,
        function: Callable[..., Any],
        *,
        static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = (),
        platform: str | None = None,
        custom_calls: Sequence[str] = (),
        name: str | None = None,
        static_argnames: str | Sequence[str] | None = None,
    ) -> PoolFunction:
        """Returns function as a callable that runs in this pool's workers, like jax.jit(function).

        Calling it lowers the function in this process once per signature (the
        arguments' tree structure, shapes, dtypes and weak types, the static
        arguments' types and values, and JAX's trace context: the config that
        changes programs, such as jax_enable_x64, numpy_rank_promotion and
        threefry_partitionable, as jax.jit caches), then runs the program with
        Pool.run: a worker compiles it or loads it from the disk cache. It
        returns the result in the structure jax.jit(function)(*args) returns,
        with numpy arrays as leaves; typed PRNG keys come back as keys and
        float0 results as float0 arrays. Arguments are pytrees of numpy
        arrays, JAX arrays, Python scalars (weakly typed, as in jax.jit) and
        typed keys. static_argnums, static_argnames and custom_calls mean what
        they mean for jax.jit and lower (a static argument a call leaves out
        takes the function's default; other keyword arguments are dynamic);
        platform is the one to lower for (default: that of this pool's
        plugin); name names the tasks (default: the program's name). Its
        submit method returns a Future of the result and its lower method the
        LoweredProgram a call runs. Crash isolation, timeouts and quarantine
        are those of submit. It runs in another process, so it cannot be
        traced: jax.grad, jax.vmap or jax.jit of it raise TypeError (make the
        PoolFunction of the transformed function instead). Called with tracers
        while a PoolFunction (or lower) is lowering, it traces into its
        function as a nested jax.jit does, so that the outer program runs it.

        donate_argnums is accepted and ignored, with a warning: arguments are
        copied into shared memory for the worker, so donated arrays stay
        valid and no memory is saved.
        """
        # Here, not at the top: it imports JAX (about a second), which a pool that
        # runs warmed programs (pool.manifest) never needs.
        from pool.lowering.function import PoolFunction

        self._refuse_in_child()
        return PoolFunction(
            self,
            function,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            platform=platform,
            custom_calls=custom_calls,
            name=name,
        )
