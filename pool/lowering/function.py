"""Pool.function: a JAX function that runs in a Pool's workers, called as jax.jit's result is.

    step(params, batch)
      │ flatten the arguments (static ones aside); signature = tree, shapes, dtypes,
      │ weak types, static values and their types, JAX's trace context (the config
      │ that changes programs: x64, rank and dtype promotion, threefry, ...)
      ├─ first call with this signature: lower_tree in this process, remembered
      │  (no lock is held while the function traces: it may call the PoolFunction)
      ▼
    Pool.run / Pool.submit(program, leaves)    compile or load in a worker (disk cache), run
      │
      ▼
    outputs rebuilt in the structure jax.jit returns; key data wrapped back into keys

Everything after lowering goes through the Pool's public API, so crash
isolation, timeouts and quarantine are the Pool's. A call of a signature
lowered already never touches the program's text: the program carries its
identity (worker.records.DigestedProgram), so that a program with large
constants costs a dictionary lookup per call, not a hash of its text.

A PoolFunction cannot be traced: jax.grad, jax.vmap or jax.jit of it (or a
call of it inside a function they trace) is refused with a TypeError that
says so, since its program runs in another process, where JAX's tracers
cannot follow. Inside a lowering (lower_tree, and so any PoolFunction's
first call of a signature) it is different: the whole traced program runs in
a worker, so a call with tracers traces into the function, as a nested
jax.jit does, and recursion through PoolFunctions lowers as it does through
jax.jit.
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from pool.errors import TracedPoolFunctionError
from pool.executor.futures import adapt
from pool.executor.values import DeviceValue
from pool.lowering.lower import (
    TreeProgram,
    allow_custom_calls,
    function_name,
    lower_tree,
    lowering_here,
)
from worker.records import LoweredProgram


class Runner(Protocol):
    """What a PoolFunction runs its programs through: a Pool (or a ClusterPool)."""

    @property
    def platform(self) -> str | None:
        """The platform whose plugin runs the programs (None: not known yet)."""
        ...

    def run(
        self, program: LoweredProgram, arguments: Sequence[Any], *, name: str | None = None
    ) -> list[np.ndarray]:
        """Runs a program and returns its outputs (a Pool's run also takes keep=)."""
        ...

    def submit(
        self, program: LoweredProgram, arguments: Sequence[Any], *, name: str | None = None
    ) -> Future[list[np.ndarray]]:
        """Runs a program; returns a Future of its outputs (a Pool's submit also takes keep=)."""
        ...


LeafType = tuple[tuple[int, ...], Any, bool, Any]
"""What the program depends on for one argument leaf: shape, dtype, weak type, and the mesh
sharding of an array placed on one (else None), which jax.jit keys its traces by too."""


Statics = tuple[tuple[int | str, type, Any], ...]
"""The static arguments of a call: (position or keyword name, type, value), in order."""


class _Compiled(NamedTuple):
    """One signature's lowered program and where keys enter and leave it."""

    tree: TreeProgram
    key_inputs: tuple[int, ...]
    """Flat inputs that are typed keys (passed as their key data)."""
    key_outputs: tuple[int, ...]
    """Flat outputs that are key data, wrapped back into keys for the caller."""
    name: str
    """What the tasks are called (computed once: the program's text is not read per call)."""
    kept: tuple[int, ...] = ()
    """Flat outputs that stay in the worker as DeviceValues (the function's keep=)."""


_canonical: dict[tuple[np.dtype, bool], Any] = {}


def _leaf_type(leaf: Any, x64: bool) -> LeafType:
    """The shape, dtype and weak type JAX traces a leaf with (as jax.jit would)."""
    if type(leaf) is np.ndarray:  # the common case, without jax.typeof's cost
        dtype = _canonical.get((leaf.dtype, x64))
        if dtype is None:
            dtype = _canonical[(leaf.dtype, x64)] = jax.dtypes.canonicalize_dtype(leaf.dtype)
        return leaf.shape, dtype, False, None
    if type(leaf) is DeviceValue:  # a value the pool keeps: its program takes its type
        array_type = leaf.array_type
        return array_type.shape, np.dtype(array_type.dtype), False, None
    if isinstance(leaf, jax.core.Tracer):
        raise TracedPoolFunctionError(
            f"a PoolFunction was called with a JAX tracer ({type(leaf).__name__}): it runs its "
            "program in a worker process, which jax.grad, jax.vmap, jax.jit and other "
            "transformations cannot trace into. Call it on concrete arrays, outside "
            "transformations; to transform the computation, make the PoolFunction of the "
            "transformed function instead, for example pool.function(jax.grad(f))"
        )
    aval = jax.typeof(leaf)
    sharding = getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None
    placed = sharding if isinstance(sharding, jax.sharding.NamedSharding) else None
    return aval.shape, aval.dtype, aval.weak_type, placed


def _argnums(name: str, value: int | Sequence[int]) -> tuple[int, ...]:
    numbers = (value,) if isinstance(value, int) else value
    if not isinstance(numbers, Sequence) or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in numbers
    ):
        raise TypeError(f"{name} must be an int or a sequence of ints, not {value!r}")
    return tuple(numbers)


def _argnames(value: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"static_argnames must be a str or a sequence of strs, not {value!r}")
    return tuple(names)


def _signature(function: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):  # some builtins have none: nothing to infer or check
        return None


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def static_arguments(
    function: Callable[..., Any],
    static_argnums: tuple[int, ...],
    static_argnames: tuple[str, ...] | None,
) -> tuple[tuple[int, ...], frozenset[str]]:
    """The static positions and keyword names of a function, completed as jax.jit completes them.

    Positions name their parameters' keywords too, and names their
    parameters' positions (for parameters that are positional-or-keyword),
    unless both are given. Positions past the positional parameters (when
    there is no *args) and names the function does not take (when there is
    no **kwargs) raise ValueError, as jax.jit does.
    """
    signature = _signature(function)
    if signature is None:
        return static_argnums, frozenset(static_argnames or ())
    parameters = list(signature.parameters.values())
    either = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    if static_argnames is None:
        names = tuple(name for i, name in enumerate(either) if i in static_argnums)
    else:
        names = static_argnames
        if not static_argnums:
            static_argnums = tuple(i for i, name in enumerate(either) if name in names)
    positional = sum(p.kind in _POSITIONAL for p in parameters)
    if not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters) and any(
        i >= positional or i < -positional for i in static_argnums
    ):
        raise ValueError(
            f"static_argnums={static_argnums} names positions that {function_name(function)} "
            f"does not have: it takes {positional} positional arguments"
        )
    keywords = {p.name for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    unknown = set(names) - keywords
    only_positional = {p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_ONLY}
    if unknown & only_positional or (
        unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    ):
        raise ValueError(
            f"static_argnames names {sorted(unknown)}, which {function_name(function)} does not "
            "take as keyword arguments"
        )
    return static_argnums, frozenset(names)


def _trace_context_function() -> Callable[[], Hashable]:
    """What jax.jit keys its traces by besides the arguments: JAX's trace context.

    It holds every config value that changes what tracing produces
    (jax_enable_x64, numpy_rank_promotion, numpy_dtype_promotion,
    threefry_partitionable, default_matmul_precision, the current mesh and
    more), and is private to JAX: where it is missing, the values of the
    public options known to change programs stand in.
    """
    try:  # private: imported here, so that a JAX that moved it falls back (below)
        from jax._src import config as jax_config

        context = jax_config.trace_context
        context()
        return context
    except Exception:  # moved or renamed in another JAX version

        def public_options() -> Hashable:
            return tuple(getattr(jax.config, name, None) for name in _PROGRAM_OPTIONS)

        return public_options


_PROGRAM_OPTIONS = (
    "jax_enable_x64",
    "jax_numpy_rank_promotion",
    "jax_numpy_dtype_promotion",
    "jax_threefry_partitionable",
    "jax_default_matmul_precision",
    "jax_default_prng_impl",
    "jax_softmax_custom_jvp",
    "jax_enable_checks",
)

trace_context = _trace_context_function()


class PoolFunction:
    """A function lowered once per signature and run in a Pool's workers, like jax.jit's.

    Made by Pool.function; see there for what it takes and returns.
    """

    def __init__(
        self,
        pool: Runner,
        function: Callable[..., Any],
        *,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] | None = None,
        donate_argnums: int | Sequence[int] = (),
        platform: str | None = None,
        custom_calls: Sequence[str] = (),
        name: str | None = None,
        in_shardings: Any = None,
        out_shardings: Any = None,
        keep: int | Sequence[int] | bool = (),
    ) -> None:
        if not callable(function):
            raise TypeError(f"function must be callable, not {type(function).__name__}")
        if isinstance(custom_calls, str):
            raise TypeError("custom_calls must be a sequence of target names, not one str")
        self._pool = pool
        self._function = function
        numbers, names = static_arguments(
            function,
            tuple(sorted(set(_argnums("static_argnums", static_argnums)))),
            _argnames(static_argnames),
        )
        self._static = numbers
        self._static_names = names
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
        self._in_shardings = in_shardings
        self._out_shardings = out_shardings
        self._keep = _keep_positions(keep)
        self._compiled: dict[Any, _Compiled] = {}
        # Signatures being lowered: another thread's call of one waits for it, unless
        # that thread is lowering something itself (see _lower_once).
        self._lowering: dict[Any, threading.Event] = {}
        self._lock = threading.Lock()
        functools.update_wrapper(self, function, updated=())

    # -- calls ------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the function in a worker and returns its result as jax.jit would (numpy leaves).

        Called with tracers while this thread lowers a program, it traces into
        the function as a nested jax.jit does (the outer program runs it).
        """
        try:
            compiled, inputs = self._prepare(args, kwargs)
        except TracedPoolFunctionError:
            if not lowering_here():
                raise
            allow_custom_calls(self._custom_calls)
            return self._nested(*args, **kwargs)
        options = {"keep": compiled.kept} if compiled.kept else {}
        outputs = self._pool.run(compiled.tree.program, inputs, name=compiled.name, **options)
        return _rebuild(compiled, outputs)

    @functools.cached_property
    def _nested(self) -> Callable[..., Any]:
        """The function as jax.jit, with this PoolFunction's statics: what a nested call traces."""
        return jax.jit(
            self._function,
            static_argnums=self._static,
            static_argnames=tuple(sorted(self._static_names)),
        )

    def submit(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Starts the function in a worker; returns a Future of the result __call__ returns.

        Lowering (on the first call with a signature) and checking the
        arguments happen here, so their errors raise here, as Pool.submit's do.
        """
        compiled, inputs = self._prepare(args, kwargs)
        options = {"keep": compiled.kept} if compiled.kept else {}
        future = self._pool.submit(compiled.tree.program, inputs, name=compiled.name, **options)
        return adapt(future, functools.partial(_rebuild, compiled))

    def lower(self, *args: Any, **kwargs: Any) -> LoweredProgram:
        """Returns the LoweredProgram that a call with these arguments runs.

        The arguments may also be jax.ShapeDtypeStructs (of the dynamic
        arguments); the program's inputs are their leaves in JAX's order,
        typed keys as their key data.
        """
        return self._lookup(args, kwargs)[0].tree.program

    # -- signatures -------------------------------------------------------------

    def _split(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], Statics]:
        """(dynamic arguments, dynamic keywords, statics), as jax.jit splits them.

        A static position the call does not pass is left to the function's
        default, as jax.jit leaves it. Statics are keyed by type and value, as
        jax.jit keys them: 1, 1.0 and True are three signatures.
        """
        if not self._static and not self._static_names:
            return args, kwargs, ()
        count = len(args)
        indexes = sorted({i + count if i < 0 else i for i in self._static} & set(range(count)))
        statics: list[tuple[int | str, type, Any]] = [(i, type(args[i]), args[i]) for i in indexes]
        if self._static_names and kwargs:
            names = self._static_names
            statics += [(k, type(v), v) for k, v in sorted(kwargs.items()) if k in names]
            kwargs = {k: v for k, v in kwargs.items() if k not in names}
        for where, _, value in statics:
            try:
                hash(value)
            except TypeError as error:
                which = f"argument {where}" if isinstance(where, int) else f"argument {where!r}"
                raise ValueError(
                    f"static {which} ({type(value).__name__}) is not hashable ({error}); "
                    "static arguments are part of the signature, as in jax.jit: pass a "
                    "hashable value (a tuple instead of a list, for example)"
                ) from None
        static = set(indexes)
        dynamic = tuple(a for i, a in enumerate(args) if i not in static)
        return dynamic, kwargs, tuple(statics)

    def _lookup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Compiled, list[Any]]:
        """The compiled signature of a call (lowering it the first time) and its flat leaves."""
        dynamic, kwargs, statics = self._split(args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten((dynamic, kwargs))
        x64 = bool(jax.config.jax_enable_x64)
        try:
            types = tuple(_leaf_type(leaf, x64) for leaf in leaves)
        except TracedPoolFunctionError:
            raise
        except TypeError:
            raise self._not_an_array(dynamic, kwargs, statics) from None
        signature = (tree, types, statics, trace_context())
        compiled = self._compiled.get(signature)
        if compiled is None:
            compiled = self._lower_once(signature, tree, types, statics)
        return compiled, leaves

    def _lower_once(
        self, signature: Any, tree: Any, types: tuple[LeafType, ...], statics: Statics
    ) -> _Compiled:
        """Lowers a signature, once across threads, without holding a lock while it traces.

        A thread that finds another lowering the signature waits for it, but
        only if it is not lowering anything itself: a function that calls a
        PoolFunction while it traces (its own, or one another thread is
        lowering and whose function calls back) lowers that call on its own,
        as jax.jit traces a nested call, so that no two lowerings wait for
        each other.
        """
        while True:
            with self._lock:
                compiled = self._compiled.get(signature)
                if compiled is not None:
                    return compiled
                busy = self._lowering.get(signature)
                if busy is None or lowering_here():
                    done = self._lowering.setdefault(signature, threading.Event())
                    break
            busy.wait()  # the other thread's lowering failed if nothing is there now
        try:
            compiled = self._lower(tree, types, statics)
            with self._lock:
                compiled = self._compiled.setdefault(signature, compiled)
            return compiled
        finally:
            if busy is None:  # this thread's entry: take it away and wake the waiters
                with self._lock:
                    self._lowering.pop(signature, None)
                done.set()

    def _prepare(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[_Compiled, list[Any]]:
        """The compiled signature of a call and its program inputs (keys as key data)."""
        compiled, leaves = self._lookup(args, kwargs)
        if jax.ShapeDtypeStruct in map(type, leaves):  # no generator: this runs every call
            raise TypeError("a call takes arrays, not ShapeDtypeStructs: use .lower() for shapes")
        for index in compiled.key_inputs:
            leaves[index] = np.asarray(jax.random.key_data(leaves[index]))
        return compiled, leaves

    def _lower(self, tree: Any, types: tuple[LeafType, ...], statics: Statics) -> _Compiled:
        shapes = [jax.ShapeDtypeStruct(s, d, weak_type=w, sharding=p) for s, d, w, p in types]
        dynamic, kwargs = jax.tree_util.tree_unflatten(tree, shapes)
        function = self._function
        positional = tuple((i, v) for i, _, v in statics if isinstance(i, int))
        positions = _dynamic_positions(len(dynamic) + len(positional), positional)
        if statics:
            named = {k: v for k, _, v in statics if isinstance(k, str)}
            function = _with_statics(function, positional, named)
        lowered = lower_tree(
            function,
            dynamic,
            kwargs,
            platform=self._platform or self._pool_platform(),
            custom_calls=self._custom_calls,
            label=lambda i, path: (
                f"argument {positions[i]}{path}" if i >= 0 else f"keyword argument {path}"
            ),
            in_shardings=self._in_shardings,
            out_shardings=self._out_shardings,
        )
        key_outputs = tuple(i for i, key in enumerate(lowered.output_keys) if key is not None)
        return _Compiled(
            lowered,
            tuple(i for i, key in enumerate(lowered.input_keys) if key is not None),
            key_outputs,
            self._name or lowered.program.name,
            _kept_outputs(self._keep, lowered, key_outputs),
        )

    def _pool_platform(self) -> str | None:
        """The platform of the pool's plugin: the only one its workers can run programs for
        (None, not known yet: lower's default, JAX's default device)."""
        return self._pool.platform

    def _not_an_array(
        self, dynamic: tuple[Any, ...], kwargs: dict[str, Any], statics: Statics
    ) -> TypeError:
        """The error for a leaf that JAX cannot trace, naming it and suggesting static_argnums."""
        positional = tuple((i, v) for i, _, v in statics if isinstance(i, int))
        positions = _dynamic_positions(len(dynamic) + len(positional), positional)
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
                    hint = "static_argnames in Pool.function"
                return TypeError(
                    f"{where} is {type(leaf).__name__}, which JAX cannot trace ({error}); "
                    f"make it static ({hint}) or bind it with functools.partial"
                )
        return TypeError("an argument is not an array")

    def __repr__(self) -> str:
        return f"<PoolFunction {function_name(self._function)} ({len(self._compiled)} signatures)>"


def _keep_positions(keep: int | Sequence[int] | bool) -> tuple[int, ...] | bool:
    """keep= checked: True (the whole result) or the positions in the result's tuple."""
    if keep is True or keep is False:
        return bool(keep)
    positions = (keep,) if isinstance(keep, int) else keep
    if not isinstance(positions, Sequence) or not all(
        isinstance(p, int) and not isinstance(p, bool) for p in positions
    ):
        raise TypeError(
            f"keep must be True, a position in the function's result tuple or a sequence of "
            f"them, not {keep!r}"
        )
    return tuple(sorted(set(positions)))


def _kept_outputs(
    keep: tuple[int, ...] | bool, lowered: TreeProgram, key_outputs: tuple[int, ...]
) -> tuple[int, ...]:
    """The flat outputs a function's keep= keeps: every leaf of the result (True), or of the
    elements of its result tuple at those positions. Refuses (ValueError) positions the
    result does not have and kept leaves that are keys or float0 (data JAX rebuilds)."""
    tree = lowered.out_tree
    if keep is False or keep == ():
        return ()
    if keep is True:
        flat = tuple(range(tree.num_leaves))
    else:
        children = tree.children() if _is_tuple(tree) else []
        if any(not -len(children) <= p < len(children) for p in keep):
            raise ValueError(
                f"keep={keep!r}, but the function returns "
                + (f"a tuple of {len(children)}" if children else "no tuple")
                + ": keep names positions in the result's tuple (keep=True keeps it all)"
            )
        starts = [0]
        for child in children:
            starts.append(starts[-1] + child.num_leaves)
        flat = tuple(
            leaf
            for p in sorted({p % len(children) for p in keep})
            for leaf in range(starts[p], starts[p + 1])
        )
    special = set(flat) & (set(key_outputs) | set(lowered.float0_outputs))
    if special:
        raise ValueError(
            f"keep would keep outputs {sorted(special)}, which are PRNG keys or float0 "
            "gradients: those are rebuilt in this process and cannot stay in the worker; "
            "keep the other elements of the result"
        )
    return flat


def _is_tuple(tree: Any) -> bool:
    """Whether a tree definition is a tuple's (the result of a function returning several)."""
    return bool(tree == jax.tree_util.treedef_tuple(tree.children()))


def _dynamic_positions(count: int, statics: tuple[tuple[int, Any], ...]) -> list[int]:
    """The positional index of each dynamic argument among all the call's arguments."""
    static = {i for i, _ in statics}
    return [i for i in range(count) if i not in static]


def _with_statics(
    function: Callable[..., Any],
    positional: tuple[tuple[int, Any], ...],
    named: dict[str, Any],
) -> Callable[..., Any]:
    """The function with its static arguments bound, taking the dynamic ones."""

    def bound(*dynamic: Any, **kwargs: Any) -> Any:
        args = list(dynamic)
        for index, value in positional:  # in increasing order of index
            args.insert(index, value)
        return function(*args, **kwargs, **named)

    bound.__name__ = bound.__qualname__ = function_name(function)
    return bound


def _rebuild(compiled: _Compiled, outputs: list[np.ndarray]) -> Any:
    """The program's flat outputs in the function's result structure.

    Key data becomes keys again, and float0 outputs (the gradients of integer
    inputs), which a program returns as booleans, float0 arrays, as jax.jit
    returns them.
    """
    tree = compiled.tree
    if compiled.key_outputs or tree.float0_outputs:
        outputs = list(outputs)
        for index in compiled.key_outputs:
            outputs[index] = jax.random.wrap_key_data(outputs[index], dtype=tree.output_keys[index])
        for index in tree.float0_outputs:
            outputs[index] = np.zeros(outputs[index].shape, jax.dtypes.float0)
    return jax.tree_util.tree_unflatten(tree.out_tree, outputs)
