"""JaxlibExecutable: a program loaded into jaxlib's CPU client, as a native executable is.

worker.compile.executable.Executable wraps either a native executable
(``_pjrt.Executable``, on a PJRT plugin) or this, which has the same methods:
its output types, serialize and fingerprint, and runs on arrays in host
memory (execute: outputs copied into caller memory; execute_values: outputs
as numpy views of the runtime's own buffers; execute_sharded: global arrays
cut into and put together from their devices' blocks, as set_shards says).
A pool worker runs it from Python (worker.serve.python_runs), since the
native hot loop runs native executables only; for that it also runs on
values kept on the device (run_arrays).

Inputs are given to XLA without a copy where they allow it (zero_copy, dense,
aligned to 64 bytes: XLA decides, and copies the others); the arrays XLA
makes of them keep the memory they view alive until they are gone, and every
method here returns only once the run has read them, or (run_arrays) says
which of its inputs it still reads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from worker.dtypes import code_of_dtype, dtype_of_code
from worker.plugin.jaxlib_cpu import calls

Block = tuple[tuple[int, ...], tuple[int, ...]]
"""One device's block of a global array, as set_shards takes it: (starts, sizes)."""


def as_typed(buffer: Any, code: int, index: int) -> np.ndarray:
    """Input `index`, a buffer (a numpy array, maybe a same-size uint view of a narrow float),
    as an array of the element type `code` names; ValueError, as the native module says it,
    for a code of no byte-sized type pjrt-pool supports or a buffer of another size than its
    dimensions of that type need (the Python side converts arguments first: this is the
    last line, for every caller)."""
    which = f"input {index}"
    try:
        dtype = dtype_of_code(code)
    except TypeError:
        raise ValueError(
            f"{which} has element type {code}, which is not a PJRT_Buffer_Type with a "
            "byte-sized host layout that pjrt-pool supports (codes 1-20 and 26-28)"
        ) from None
    array = np.asarray(buffer)
    if array.dtype == dtype:
        return array
    expected = int(np.prod(array.shape, dtype=np.int64)) * dtype.itemsize
    if expected != array.nbytes:
        dims = "[" + ", ".join(str(n) for n in array.shape) + "]"
        raise ValueError(
            f"{which} has dimensions {dims} of element type {code} ({dtype.itemsize} bytes "
            f"each), which need {expected} bytes, but its buffer has {array.nbytes} bytes"
        )
    return array.view(dtype)


def writable_address(destination: Any, size: int) -> int:
    """The address of caller memory for an output of `size` bytes: a writable, C-contiguous
    buffer of exactly that size (ValueError else)."""
    target = np.asarray(destination)
    if target.nbytes != size or not target.flags.c_contiguous or not target.flags.writeable:
        raise ValueError(
            f"an output of {size} bytes was given a place of {target.nbytes} bytes "
            "(or one that is not writable and contiguous)"
        )
    if size == 0:
        return 0
    # Through the buffer protocol: a third of the time of __array_interface__ (measured).
    if target.dtype.isbuiltin != 1:  # ml_dtypes' types have no buffer format
        target = target.view(np.uint8)
    return ctypes.addressof(ctypes.c_char.from_buffer(target))


def _slices(starts: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(start, start + size) for start, size in zip(starts, sizes, strict=True))


class JaxlibExecutable:
    """A loaded jaxlib executable (see the module)."""

    def __init__(self, client: Any, loaded: Any) -> None:
        self.client = client
        """The JaxlibClient it is loaded into, which keeps values it takes and gives."""
        self._loaded = loaded
        self._types = calls.output_types(loaded)
        self._sizes = [int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                       for dtype, shape in self._types]  # fmt: skip
        self.output_types = [(code_of_dtype(dtype), list(shape)) for dtype, shape in self._types]
        """Each output's (element type code, dims) on one device, as the native module's."""
        self._devices = list(loaded.local_devices())
        self.device_ids = [device.id for device in self._devices]
        """The devices it runs on, in device-assignment order."""
        self._handlers = [calls.result_handler(shape, dtype, self._devices[0])
                          for dtype, shape in self._types]  # fmt: skip
        self._shards: tuple[list[Any], list[Any], list[Block], list[Block]] | None = None

    @property
    def num_outputs(self) -> int:
        """The number of outputs."""
        return len(self.output_types)

    @property
    def sharded(self) -> bool:
        """Whether set_shards gave it its blocks."""
        return self._shards is not None

    def serialize(self) -> bytes:
        """The executable in jaxlib's own serialized form (what JAX's persistent cache
        stores for a jax.jit); JaxlibClient.deserialize loads it."""
        return calls.serialize(self._loaded)

    def fingerprint(self) -> bytes | None:
        """XLA's fingerprint of the executable (equal for equal compiles), or None."""
        return calls.fingerprint(self._loaded)

    def set_shards(
        self,
        device_ids: Sequence[int],
        inputs: Sequence[tuple[int, Sequence[int], Sequence[Block]]],
        outputs: Sequence[tuple[int, Sequence[int], Sequence[Block]]],
    ) -> None:
        """Takes how a program over several devices cuts each global input into its devices'
        blocks and puts each output together, as the native executable's set_shards does:
        device ids in device-assignment order, and per array (element type, global shape,
        each device's (starts, sizes)). Raises ValueError when they do not fit it."""
        if list(device_ids) != self.device_ids:
            raise ValueError(
                f"the partitioning's devices {list(device_ids)} are not those the executable "
                f"was loaded on ({self.device_ids})"
            )
        shardings = calls.parameter_shardings(self._loaded)
        if len(shardings) != len(inputs):
            raise ValueError(f"{len(inputs)} inputs given for a program of {len(shardings)}")
        if len(outputs) != self.num_outputs:
            raise ValueError(f"{len(outputs)} outputs given for a program of {self.num_outputs}")
        in_blocks = [list(blocks) for _, _, blocks in inputs]
        out_blocks = [list(blocks) for _, _, blocks in outputs]
        shapes = [tuple(shape) for _, shape, _ in inputs]
        if any(len(blocks) != len(self._devices) for blocks in (*in_blocks, *out_blocks)):
            raise ValueError("every array needs one block per device")
        placements = [calls.sharding_over(self._devices, s) for s in shardings]
        self._shards = (placements, shapes, in_blocks, out_blocks)  # type: ignore[assignment]

    def _put(self, array: np.ndarray, zero_copy: bool) -> Any:
        device = self._devices[0]
        aval = calls.abstract(array.shape, array.dtype)
        block = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        return calls.put([block], [device], calls.one_device(device), zero_copy, aval)

    def run_arrays(self, arguments: Sequence[Any], zero_copy: bool = True) -> list[Any]:
        """Runs a program of one device on arguments that are numpy arrays of its input types
        (given to XLA without a copy where zero_copy and they allow) or values on its
        device (run_arrays' outputs, JaxlibClient.put's); returns its outputs as values on
        the device, dispatched, not awaited: reading them awaits them. Until then the run
        may still read its numpy arguments."""
        given = [a if not isinstance(a, np.ndarray) else self._put(a, zero_copy) for a in arguments]
        return calls.execute(self._loaded, given, self._handlers)

    def host(self, values: Sequence[Any]) -> list[np.ndarray]:
        """run_arrays' outputs as numpy views of their buffers, once computed."""
        return [
            calls.host_view(value, dtype, shape)
            for value, (dtype, shape) in zip(values, self._types, strict=True)
        ]

    def execute_values(
        self, inputs: Sequence[Any], element_types: Sequence[int], zero_copy: bool = True
    ) -> list[np.ndarray]:
        """Runs on host arrays; returns each output as a numpy view of the buffer
        XLA wrote it into (no copy, as jax.jit's np.asarray of a CPU array)."""
        arrays = [as_typed(b, code, i) for i, (b, code) in enumerate(zip(inputs, element_types,
                                                                         strict=True))]  # fmt: skip
        return self.host(self.run_arrays(arrays, zero_copy))

    def execute(
        self,
        inputs: Sequence[Any],
        element_types: Sequence[int],
        outputs: Sequence[Any],
        zero_copy: bool = True,
    ) -> None:
        """Runs on host arrays and copies each output into caller memory of its size."""
        if len(outputs) != self.num_outputs:
            raise ValueError(f"{len(outputs)} places given for {self.num_outputs} outputs")
        places = [writable_address(o, size) for o, size in zip(outputs, self._sizes, strict=True)]
        arrays = [as_typed(b, code, i) for i, (b, code) in enumerate(zip(inputs, element_types,
                                                                         strict=True))]  # fmt: skip
        values = self.run_arrays(arrays, zero_copy)
        calls.ready(values)
        for value, address, size in zip(values, places, self._sizes, strict=True):
            calls.copy_out(value, address, size)

    def execute_sharded(self, inputs: Sequence[Any], element_types: Sequence[int],
                        outputs: Sequence[Any], zero_copy: bool = True) -> None:  # fmt: skip
        """Runs a program over several devices on global host arrays: each input cut into its
        devices' blocks, each output put together from them into caller memory."""
        if self._shards is None:
            raise ValueError("the executable has no blocks: set_shards first")
        placements, shapes, in_blocks, out_blocks = self._shards
        arguments = []
        for index, (buffer, code, placement, shape, blocks) in enumerate(
            zip(inputs, element_types, placements, shapes, in_blocks, strict=True)
        ):
            array = as_typed(buffer, code, index)
            if array.shape != shape:
                raise ValueError(f"an input of shape {array.shape} where {shape} is expected")
            parts = [np.ascontiguousarray(array[_slices(*block)]) for block in blocks]
            aval = calls.abstract(shape, array.dtype)
            arguments.append(calls.put(parts, self._devices, placement, zero_copy, aval))
        results = calls.execute_per_device(self._loaded, arguments)
        # Every device's part ended before any output is written: a place may lie over the
        # inputs (a pool's "spare" copy), which a device still running would read.
        calls.ready([value for per_device in results for value in per_device])
        for place, per_device, (dtype, shape), blocks in zip(
            outputs, results, self._types, out_blocks, strict=True
        ):
            target = np.asarray(place)
            target = target if target.dtype == dtype else target.view(dtype)
            done: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
            for value, (starts, sizes) in zip(per_device, blocks, strict=True):
                key = (tuple(starts), tuple(sizes))
                if key not in done:  # a replicated block is copied from its first device
                    done.add(key)
                    target[_slices(starts, sizes)] = calls.host_view(value, dtype, shape)
