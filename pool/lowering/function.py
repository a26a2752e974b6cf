"""Pool.function: a JAX function that runs in a Pool's workers, called as jax.jit's result is.

    step(params, batch)
      │ flatten the arguments (static ones aside); signature = tree, shapes, dtypes,
      │ weak types, static values, jax_enable_x64
      ├─ first call with this signature: lower_tree in this process, remembered
      ▼
    Pool.run / Pool.submit(program, leaves)    compile or load in a worker (disk cache), run
      │
      ▼
    outputs rebuilt in the structure jax.jit returns; key data wrapped back into keys

Everything after lowering goes through the Pool's public API, so crash
isolation, timeouts and quarantine are the Pool's.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from pool.executor.tasks import PoolFuture
from pool.lowering.lower import TreeProgram, function_name, lower_tree
from worker.records import LoweredProgram

if TYPE_CHECKING:
    from pool.executor.pool import Pool

LeafType = tuple[tuple[int, ...], Any, bool]
"""What the program depends on for one argument leaf: shape, dtype, weak type."""


class _Compiled(NamedTuple):
    """One signature's lowered program and where keys enter and leave it."""

    tree: TreeProgram
    key_inputs: tuple[int, ...]
    """Flat inputs that are typed keys (passed as their key data)."""
    key_outputs: tuple[int, ...]
    """Flat outputs that are key data, wrapped back into keys for the caller."""


_canonical: dict[tuple[np.dtype, bool], Any] = {}


def _leaf_type(leaf: Any, x64: bool) -> LeafType:
    """The shape, dtype and weak type JAX traces a leaf with (as jax.jit would)."""
    if type(leaf) is np.ndarray:  # the common case, without jax.typeof's cost
        dtype = _canonical.get((leaf.dtype, x64))
        if dtype is None:
            dtype = _canonical[(leaf.dtype, x64)] = jax.dtypes.canonicalize_dtype(leaf.dtype)
        return leaf.shape, dtype, False
    aval = jax.typeof(leaf)
    return aval.shape, aval.dtype, aval.weak_type


def _argnums(name: str, value: int | Sequence[int]) -> tuple[int, ...]:
    numbers = (value,) if isinstance(value, int) else value
    if not isinstance(numbers, Sequence) or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in numbers
    ):
        raise TypeError(f"{name} must be an int or a sequence of ints, not {value!r}")
    return tuple(numbers)


class PoolFunction:
    """A function lowered once per signature and run in a Pool's workers, like jax.jit's.

    Made by Pool.function; see there for what it takes and returns.
    """

    def __init__(
        self,
        pool: Pool,
        function: Callable[..., Any],
        *,
        static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = (),
        platform: str | None = None,
        custom_calls: Sequence[str] = (),
        name: str | None = None,
    ) -> None:
        if not callable(function):
            raise TypeError(f"function must be callable, not {type(function).__name__}")
        if isinstance(custom_calls, str):
            raise TypeError("custom_calls must be a sequence of target names, not one str")
        self._pool = pool
        self._function = function
        self._static = tuple(sorted(set(_argnums("static_argnums", static_argnums))))
        if _argnums("donate_argnums", donate_argnums):
            warnings.warn(
                "Pool.function ignores donate_argnums: arguments are copied into shared memory "
                "for the worker, so donated arrays stay valid and no memory is saved",
                UserWarning,
                stacklevel=3,
            )
        self._platform = platform
        self._custom_calls = tuple(custom_calls)
        self._name = name
        self._compiled: dict[Any, _Compiled] = {}
        self._lock = threading.Lock()
        functools.update_wrapper(self, function, updated=())

    # -- calls ------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the function in a worker and returns its result as jax.jit would (numpy leaves)."""
        compiled, inputs = self._prepare(args, kwargs)
        outputs = self._pool.run(compiled.tree.program, inputs, name=self._name)
        return _rebuild(compiled, outputs)

    def submit(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Starts the function in a worker; returns a Future of the result __call__ returns.

        Lowering (on the first call with a signature) and checking the
        arguments happen here, so their errors raise here, as Pool.submit's do.
        """
        compiled, inputs = self._prepare(args, kwargs)
        future = self._pool.submit(compiled.tree.program, inputs, name=self._name)
        return _Converted(future, functools.partial(_rebuild, compiled))

    def lower(self, *args: Any, **kwargs: Any) -> LoweredProgram:
        """Returns the LoweredProgram that a call with these arguments runs.

        The arguments may also be jax.ShapeDtypeStructs (of the dynamic
        arguments); the program's inputs are their leaves in JAX's order,
        typed keys as their key data.
        """
        return self._lookup(args, kwargs)[0].tree.program

    # -- signatures -------------------------------------------------------------

    def _split(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[tuple[int, Any], ...]]:
        """(dynamic arguments, ((index, static value), ...)), as jax.jit splits them."""
        if not self._static:
            return args, ()
        count = len(args)
        indexes = sorted({i + count if i < 0 else i for i in self._static})
        if indexes[0] < 0 or indexes[-1] >= count:
            raise TypeError(
                f"static_argnums {self._static} name arguments that this call does not pass "
                f"({count} positional arguments given)"
            )
        statics = tuple((i, args[i]) for i in indexes)
        for index, value in statics:
            try:
                hash(value)
            except TypeError as error:
                raise ValueError(
                    f"static argument {index} ({type(value).__name__}) is not hashable ({error}); "
                    "static arguments are part of the signature, as in jax.jit: pass a "
                    "hashable value (a tuple instead of a list, for example)"
                ) from None
        static = set(indexes)
        return tuple(a for i, a in enumerate(args) if i not in static), statics

    def _lookup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Compiled, list[Any]]:
        """The compiled signature of a call (lowering it the first time) and its flat leaves."""
        dynamic, statics = self._split(args)
        leaves, tree = jax.tree_util.tree_flatten((dynamic, kwargs))
        x64 = bool(jax.config.jax_enable_x64)
        try:
            types = tuple(_leaf_type(leaf, x64) for leaf in leaves)
        except TypeError:
            raise self._not_an_array(dynamic, kwargs, statics) from None
        signature = (tree, types, statics, x64)
        compiled = self._compiled.get(signature)
        if compiled is None:
            with self._lock:
                compiled = self._compiled.get(signature)
                if compiled is None:
                    compiled = self._lower(tree, types, statics)
                    self._compiled[signature] = compiled
        return compiled, leaves

    def _prepare(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[_Compiled, list[Any]]:
        """The compiled signature of a call and its program inputs (keys as key data)."""
        compiled, leaves = self._lookup(args, kwargs)
        if any(type(leaf) is jax.ShapeDtypeStruct for leaf in leaves):
            raise TypeError("a call takes arrays, not ShapeDtypeStructs: use .lower() for shapes")
        for index in compiled.key_inputs:
            leaves[index] = np.asarray(jax.random.key_data(leaves[index]))
        return compiled, leaves

    def _lower(
        self, tree: Any, types: tuple[LeafType, ...], statics: tuple[tuple[int, Any], ...]
    ) -> _Compiled:
        shapes = [jax.ShapeDtypeStruct(s, d, weak_type=w) for s, d, w in types]
        dynamic, kwargs = jax.tree_util.tree_unflatten(tree, shapes)
        function = self._function
        positions = _dynamic_positions(len(dynamic) + len(statics), statics)
        if statics:
            function = _with_statics(function, statics)
        lowered = lower_tree(
            function,
            dynamic,
            kwargs,
            platform=self._platform or self._pool_platform(),
            custom_calls=self._custom_calls,
            label=lambda i, path: (
                f"argument {positions[i]}{path}" if i >= 0 else f"keyword argument {path}"
            ),
        )
        return _Compiled(
            lowered,
            tuple(i for i, key in enumerate(lowered.input_keys) if key is not None),
            tuple(i for i, key in enumerate(lowered.output_keys) if key is not None),
        )

    def _pool_platform(self) -> str | None:
        """The platform of the pool's plugin: the only one its workers can run programs for."""
        for info in self._pool.worker_info:
            platform = info.get("plugin", {}).get("platform")
            if platform:
                return str(platform)
        return None  # not known yet: lower's default (JAX's default device)

    def _not_an_array(
        self, dynamic: tuple[Any, ...], kwargs: dict[str, Any], statics: tuple[tuple[int, Any], ...]
    ) -> TypeError:
        """The error for a leaf that JAX cannot trace, naming it and suggesting static_argnums."""
        positions = _dynamic_positions(len(dynamic) + len(statics), statics)
        x64 = bool(jax.config.jax_enable_x64)
        for path, leaf in jax.tree_util.tree_flatten_with_path((dynamic, kwargs))[0]:
            try:
                _leaf_type(leaf, x64)
            except TypeError as error:
                if path[0].idx == 0:
                    index = positions[path[1].idx]
                    where = f"argument {index}{jax.tree_util.keystr(path[2:])}"
                    hint = f"static_argnums=({index},) in Pool.function"
                else:
                    where = f"keyword argument {jax.tree_util.keystr(path[1:])}"
                    hint = "a positional static argument (static_argnums in Pool.function)"
                return TypeError(
                    f"{where} is {type(leaf).__name__}, which JAX cannot trace ({error}); "
                    f"make it static ({hint}) or bind it with functools.partial"
                )
        return TypeError("an argument is not an array")

    def __repr__(self) -> str:
        return f"<PoolFunction {function_name(self._function)} ({len(self._compiled)} signatures)>"


def _dynamic_positions(count: int, statics: tuple[tuple[int, Any], ...]) -> list[int]:
    """The positional index of each dynamic argument among all the call's arguments."""
    static = {i for i, _ in statics}
    return [i for i in range(count) if i not in static]


def _with_statics(
    function: Callable[..., Any], statics: tuple[tuple[int, Any], ...]
) -> Callable[..., Any]:
    """The function with its static arguments bound, taking the dynamic ones."""

    def bound(*dynamic: Any, **kwargs: Any) -> Any:
        args = list(dynamic)
        for index, value in statics:  # in increasing order of index
            args.insert(index, value)
        return function(*args, **kwargs)

    bound.__name__ = bound.__qualname__ = function_name(function)
    return bound


def _rebuild(compiled: _Compiled, outputs: list[np.ndarray]) -> Any:
    """The program's flat outputs in the function's result structure, key data as keys."""
    if compiled.key_outputs:
        outputs = list(outputs)
        keys = compiled.tree.output_keys
        for index in compiled.key_outputs:
            outputs[index] = jax.random.wrap_key_data(outputs[index], dtype=keys[index])
    return jax.tree_util.tree_unflatten(compiled.tree.out_tree, outputs)


class _Converted(PoolFuture):
    """A Future of another Future's result, converted; cancelling it cancels the other."""

    def __init__(self, inner: Future[Any], convert: Callable[[Any], Any]) -> None:
        super().__init__()
        self._inner = inner
        self._convert = convert
        inner.add_done_callback(self._settle)

    def _settle(self, inner: Future[Any]) -> None:
        if inner.cancelled():
            super().cancel()
            return
        error = inner.exception()
        if error is not None:
            self.set_exception(error)
            return
        try:
            self.set_result(self._convert(inner.result()))
        except Exception as failure:  # rebuilding failed: the caller sees why
            self.set_exception(failure)

    def cancel(self) -> bool:
        """Cancels the task if it has not started (as Future.cancel does)."""
        return self._inner.cancel() and super().cancel()
