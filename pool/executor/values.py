"""Values that stay in a worker: what the parent holds of an array kept on a worker's device.

A run can keep outputs in its worker (Pool.run/submit with keep=, Pool.function with
keep=), and Pool.put sends an array there to stay; each is a DeviceValue in the
parent, a handle that later calls of the same pool take as an argument in place of
an array. The array itself never leaves the worker unless asked for
(DeviceValue.fetch, np.asarray), so a training loop's parameters go from one step
into the next without crossing the process boundary::

    parent                                   worker
    ──────                                   ──────
    params = pool.put(params)  ──Put──▶      value 1 on the device
    step(params, batch)        ──run──▶      inputs: value 1, batch (shared memory)
      keep=0: new params  ◀── handle ──      outputs: value 2 kept, loss to shared memory
    del params (value 1)       ──next request drops it──▶ its device memory freed

A run that keeps every output is sent ahead of its reply (Pool's dispatch_ahead):
its handles come back at once, and should the run fail, its error is recorded on
its values and raised where they are next used (a call taking one, fetch,
np.asarray), as jax.jit's errors surface at the next use of an array.

A call that takes a value runs on the worker that holds it. The worker's values
die with it: a crash (or a kill: a timeout, an interrupted run) loses them, and
every call that needs one fails with WorkerCrashedError naming the values lost
(WorkerMemory.lose). Handles belong to their pool: another pool refuses them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from worker.records import ArrayType

if TYPE_CHECKING:
    from pool.executor.worker_memory import WorkerMemory


class Fetcher(Protocol):
    """What a DeviceValue fetches itself through: its pool."""

    def _fetch(self, value: DeviceValue) -> np.ndarray:
        """The value's array, copied out of its worker."""
        ...


class DeviceValue:
    """An array that stays on a pool worker's device between calls.

    Made by Pool.put and by runs that keep outputs (keep=); pass it to a later
    call of the same pool in place of an array, and the call runs on the
    worker that holds it, reading it where it is. fetch() (or np.asarray)
    copies it out; dropping the last reference frees its device memory (the
    worker lets go of it with its next request). Attributes: shape, dtype,
    ndim, size, nbytes, as numpy's, and name, what made it.
    """

    __slots__ = (
        "__weakref__",
        "_failure",
        "_made_by",
        "_memory",
        "_output",
        "_owner",
        "array_type",
        "id",
        "nbytes",
    )

    def __init__(
        self,
        owner: Fetcher,
        memory: WorkerMemory,
        value_id: int,
        array_type: ArrayType,
        made_by: str,
        nbytes: int,
        output: int = -1,
    ) -> None:
        self._owner = owner
        self._memory = memory  # its worker's: whether the worker (and so the value) lives
        self.id = value_id
        self.array_type = array_type
        # What made it: a put's name, or (output >= 0) the run's whose output it is; its
        # name is spelled only when asked for (a training loop makes values by the
        # thousand, and reads none of their names).
        self._made_by = made_by
        self._output = output
        # The array's size in bytes (what it holds of its worker's device memory), which
        # its maker knows: an attribute, not a property, as the worker's record reads it.
        self.nbytes = nbytes
        # The error of the run sent ahead of its reply that was to make it, and did not.
        self._failure: BaseException | None = None

    @property
    def name(self) -> str:
        """What made it: the name of the put, or which output of which run it is."""
        if self._output < 0:
            return self._made_by
        return f"output {self._output} of {self._made_by!r}"

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape."""
        return self.array_type.shape

    @property
    def dtype(self) -> np.dtype:
        """The array's element type."""
        return np.dtype(self.array_type.dtype)

    @property
    def ndim(self) -> int:
        """The number of axes."""
        return len(self.array_type.shape)

    @property
    def size(self) -> int:
        """The number of elements."""
        return self.array_type.size

    @property
    def pid(self) -> int:
        """The process id of the worker that holds it."""
        return self._memory.pid

    def lost_error(self) -> BaseException | None:
        """Why the value is gone (the run sent ahead that was to make it failed, or its worker
        died), or None while its worker holds it."""
        return self._failure or self._memory.lost

    def fail(self, error: BaseException) -> None:
        """The run sent ahead of its reply (Pool's dispatch_ahead) that was to make the value
        failed with `error`: every later use raises it (check_values). The error holds
        no handle (a cycle through it is garbage once the handles are)."""
        self._failure = error

    def fetch(self) -> np.ndarray:
        """Copies the value out of its worker into a numpy array (of shared memory, like a
        run's outputs); the value stays in the worker."""
        return self._owner._fetch(self)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy is False:  # numpy 2's protocol: the value is always copied out of its worker
            raise ValueError(
                f"a DeviceValue is always copied out of its worker ({self.name}): "
                "np.asarray(value, copy=False) cannot be honoured; use np.asarray(value)"
            )
        array = self.fetch()
        return array if dtype is None else array.astype(dtype, copy=False)

    def __reduce__(self) -> Any:
        raise TypeError(
            f"a DeviceValue cannot be pickled or copied ({self.name}): it stays in the worker "
            "that holds it; fetch it (np.asarray, fetch()) to send the array"
        )

    def __repr__(self) -> str:
        memory = self._memory
        where = f"in worker {memory.pid}"
        if self._failure is not None:
            where = "failed"
        elif memory.lost is not None:
            where = "lost"
        return f"<DeviceValue {self.array_type} {where}: {self.name}>"


def values_in(arguments: Any) -> dict[int, DeviceValue]:
    """The arguments that are a pool's kept values, by position."""
    if type(arguments) not in (list, tuple) or DeviceValue not in map(type, arguments):
        return {}  # (prepare_arguments says what is wrong with arguments of another type)
    return {i: a for i, a in enumerate(arguments) if type(a) is DeviceValue}


def check_values(
    owner: object, values: dict[int, DeviceValue], types: tuple[ArrayType, ...] | None
) -> WorkerMemory | None:
    """The worker memory that holds every value a call passes (by argument index), checked:
    the call's own pool's, alive, of the program's input types, all on one worker.
    Raises ValueError, TypeError or WorkerCrashedError saying what is wrong."""
    held: WorkerMemory | None = None
    for index, value in values.items():
        if value._owner is not owner:
            raise ValueError(
                f"argument {index} is a DeviceValue of another pool ({value.name}): a value "
                "stays in the worker that holds it, so only its own pool can use it; fetch it "
                "(np.asarray) and pass the array instead"
            )
        if value._failure is not None:  # the run sent ahead that was to make it failed
            raise value._failure
        lost = value._memory.lost
        if lost is not None:
            raise lost
        if types is not None and value.array_type != types[index]:
            raise TypeError(
                f"argument {index} is a DeviceValue of {value.array_type}, but the program "
                f"takes {types[index]} there: a value is used as it is, never converted"
            )
        if held is not None and value._memory is not held:
            raise ValueError(
                f"argument {index} is held by worker {value.pid}, another than the call's other "
                f"values (worker {held.pid}): one call runs on one worker; put the values on one "
                "worker (Pool.put(..., like=value))"
            )
        held = value._memory
    return held


def failure_of(values: Iterable[DeviceValue]) -> BaseException | None:
    """The error of a run sent ahead that failed to make one of these values (see
    DeviceValue.fail), or None."""
    for value in values:
        if value._failure is not None:
            return value._failure
    return None
