"""WorkerPool's methods for arrays that outlive a call: values on a device, shared arrays.

Runs in the parent, in the callers' threads. PoolArrays is a part of
WorkerPool (pool.executor.pool), written apart: put and DeviceValue.fetch
(through ValueOwner, which each of a pool's DeviceValues names as its
owner) move a value into or out of a worker's device (pool.executor.values),
as VALUE tasks on the worker that holds it; empty and asarray make numpy
arrays in the pool's shared memory (pool.executor.segments), which calls
pass without a copy. The task machinery it uses (_new_task, _call, the
checks) is WorkerPool's.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from pool.errors import PoolClosedError
from pool.executor.segments import Segment, SegmentCache
from pool.executor.tasks import Kind, Task, ValueOp, ValueOpKind
from pool.executor.values import DeviceValue, check_values
from worker.compile.arguments import prepare_arguments
from worker.dtypes import code_of_dtype
from worker.records import ArrayType

if TYPE_CHECKING:
    from pool.executor.worker_memory import WorkerMemory


class ValueOwner:
    """What a pool's DeviceValues fetch themselves through: the pool, held weakly (a
    handle does not keep a pool alive), and the token other pools refuse them by."""

    __slots__ = ("_pool",)

    def __init__(self, pool: PoolArrays) -> None:
        self._pool = weakref.ref(pool)

    def _fetch(self, value: DeviceValue) -> np.ndarray:
        pool = self._pool()
        if pool is None:
            raise PoolClosedError(f"the pool of {value.name} is gone, and the value with it")
        return pool._fetch(value)


_NARROWED = {
    np.dtype(wide): np.dtype(narrow)
    for wide, narrow in (
        ("float64", "float32"),
        ("int64", "int32"),
        ("uint64", "uint32"),
        ("complex128", "complex64"),
    )
}
"""The dtypes JAX narrows unless its x64 mode is on, and the dtype it narrows each to."""

_TRUE = ("1", "on", "t", "true", "y", "yes")
"""The values of JAX_ENABLE_X64 that JAX reads as true."""


def _x64_mode() -> bool:
    """JAX's x64 mode (jax_enable_x64): its config where this process imported JAX, else what
    JAX would start with (JAX_ENABLE_X64). Never imports JAX, which the executor needs for
    nothing else."""
    jax = sys.modules.get("jax")
    if jax is not None:  # as jax.device_put reads it
        return jax.dtypes.canonicalize_dtype(np.float64) == np.float64
    return os.environ.get("JAX_ENABLE_X64", "").strip().lower() in _TRUE


def _as_jax_puts(array: np.ndarray) -> np.ndarray:
    """An array of a 64-bit dtype as jax.device_put would convert it (narrowed unless JAX's
    x64 mode is on)."""
    narrow = _NARROWED.get(array.dtype)
    return array if narrow is None or _x64_mode() else array.astype(narrow)


class PoolArrays:
    """put, empty, asarray and DeviceValue.fetch, for WorkerPool (which inherits them)."""

    _segments: SegmentCache
    _value_owner: ValueOwner

    # WorkerPool's (pool.executor.pool), which these methods call.
    _refuse_on_manager: Callable[[str], None]
    _check_open: Callable[[], None]
    _new_task: Callable[..., Task]
    _call: Callable[..., Any]

    def put(
        self, array: ArrayLike, *, like: DeviceValue | None = None, name: str | None = None
    ) -> DeviceValue:
        """Copies an array into a worker's device memory, where it stays; returns its handle.

        Pass the DeviceValue to later calls of this pool in place of the array:
        each runs on the worker that holds it, reading it there, without
        copying it again. The worker is one that runs programs (the one that
        holds `like`, another DeviceValue of this pool, when given: a call
        takes values of one worker only). np.asarray(value) or value.fetch()
        copies it back; dropping the handle frees its device memory.

        The array is converted as jax.device_put converts it: float64, int64,
        uint64 and complex128 become float32, int32, uint32 and complex64
        unless JAX's x64 mode (jax_enable_x64) is on, so that a value made
        from numpy's default float64 fits a program lowered from float32
        arrays (values are never converted when passed).
        """
        self._refuse_on_manager("Pool.put")
        (prepared,) = prepare_arguments([array], None)
        prepared = _as_jax_puts(prepared)
        array_type = ArrayType(prepared.dtype, prepared.shape)
        pinned = None if like is None else self._pinned({0: like}, None)
        operation = ValueOp(ValueOpKind.PUT, array_type)
        label = name or f"a {array_type} put in the pool"
        task = self._new_task(
            Kind.VALUE, None, label, None, None, handed_out=False, pinned=pinned, value=operation
        )
        return self._call(task, [prepared])

    def _fetch(self, value: DeviceValue) -> np.ndarray:
        """DeviceValue.fetch: the value copied out of its worker (into shared memory)."""
        self._refuse_on_manager("DeviceValue.fetch")
        pinned = self._pinned({0: value}, None)
        operation = ValueOp(ValueOpKind.FETCH, value.array_type, value)
        task = self._new_task(
            Kind.VALUE,
            None,
            f"fetch {value.name}",
            None,
            None,
            handed_out=False,
            pinned=pinned,
            value=operation,
        )
        return self._call(task, [])

    def empty(self, shape: int | Sequence[int], dtype: Any) -> np.ndarray:
        """A numpy array in the pool's shared memory, of undefined contents, to fill.

        Passed to this pool's calls (larger than the arena's share, 256 KiB),
        it is not copied: the worker reads it where it is. So a data loader
        that fills arrays from Pool.empty sends batches with no copy in this
        process. It is passed by reference: a task submitted with it sees
        changes made to it before the task runs. Its memory goes back to the
        pool when the array (and every view of it) is garbage, as a result's.
        """
        self._check_open()
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        array_type = ArrayType(np.dtype(dtype), tuple(int(d) for d in dims))
        code_of_dtype(array_type.dtype)  # TypeError for a type the runtime has not
        if any(d < 0 for d in array_type.shape):
            raise ValueError(f"a shape has no negative lengths: {shape!r}")
        size = max(array_type.nbytes, 1)
        segment = Segment()
        try:
            if not self._segments.make(segment, size):  # past the bounds: its own, not kept
                self._segments.fill(segment, size, lambda _: None)
            lease = self._segments.adopt(segment)
        except BaseException:
            self._segments.give(segment)
            raise
        return lease.views([array_type], [0])[0]

    def asarray(self, array: ArrayLike, *, dtype: Any = None) -> np.ndarray:
        """A copy of an array in the pool's shared memory (see empty): calls pass it as it is.

        Its dtype is the one a program lowered from JAX reads: `dtype` when given, else
        the array's converted as jnp.asarray (and Pool.put) converts it: float64, int64,
        uint64 and complex128 become their 32-bit kinds unless JAX's x64 mode is on. An
        array a run must still convert (made with another dtype than its program reads)
        is copied for each run, and the run says so once (ConvertedInputWarning).
        """
        source = np.asarray(array)
        source = source.astype(dtype, copy=False) if dtype is not None else _as_jax_puts(source)
        copy = self.empty(source.shape, source.dtype)
        if source.flags.c_contiguous:
            self._segments.copier.copy(
                copy.reshape(-1).view(np.uint8), source.reshape(-1).view(np.uint8)
            )
        else:
            copy[...] = source
        return copy

    def _pinned(
        self, values: dict[int, DeviceValue], types: tuple[ArrayType, ...] | None
    ) -> WorkerMemory | None:
        """The memory of the worker a call must run on, the one that holds its values (the
        arguments that are DeviceValues, by position; each checked: this pool's, alive, of
        its input's type); None when it passes none."""
        if not values:
            return None
        return check_values(self._value_owner, values, types)
