"""Executable: a program loaded into the process's PJRT client."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from worker import _pjrt
from worker.compile.arguments import prepare_arguments
from worker.compile.stamp import check_stamp
from worker.dtypes import buffer_view, code_of_dtype, dtype_of_code
from worker.errors import NotLoadedError, PjrtError
from worker.partitioning import ArraySharding, Partitioning
from worker.plugin.kernels import ensure_kernels_for, explain_missing_handler
from worker.plugin.runtime import Runtime, get_runtime
from worker.records import ArrayType

if TYPE_CHECKING:
    from numpy.typing import ArrayLike  # annotations only: importing it costs start-up time


# HLO opcodes whose execution leaves a trace outside its outputs: the
# executable's RNG counter that stablehlo.rng advances on every run (docs/facts.md,
# "State in an executable"), and transfers to or from the host, which a
# priming run would consume or send. rng-get-and-update-state is matched
# anywhere in the bytes, the others as the opcode field of an instruction
# (tag 2, then the length), since "send" and "recv" occur in other names.
_STATEFUL_MARKERS = (
    b"rng-get-and-update-state",
    b"\x12\x06infeed",
    b"\x12\x07outfeed",
    b"\x12\x04send",
    b"\x12\x04recv",
)


PRIME_RUNS = 2
"""Executions of a priming (Executable.prime): after two, a first request runs at the warm
speed (docs/facts.md, "First runs"; benchmarks/bench_start.py's primed kind)."""


def keeps_state(serialized: bytes | bytearray | memoryview) -> bool:
    """Whether a serialized executable may keep state between runs or talk to the host.

    A substring test of the bytes (the plugin's form embeds the HLO module);
    False positives only cost a program its priming (Executable.prime).
    """
    data = bytes(serialized) if isinstance(serialized, memoryview) else serialized
    return any(marker in data for marker in _STATEFUL_MARKERS)


def output_types_of(
    native: _pjrt.Executable | _pjrt.UnloadedExecutable, partitioning: Partitioning | None = None
) -> tuple[ArrayType, ...]:
    """The ArrayType of each output of a native executable: as the plugin reports it, or for
    a program over several devices (whose outputs the plugin reports per device) the global
    arrays its partitioning puts together. Raises ValueError when the partitioning does not
    fit the executable's outputs."""
    types = tuple(ArrayType(dtype_of_code(code), tuple(dims)) for code, dims in native.output_types)
    if partitioning is None:
        return types
    outputs = partitioning.outputs
    if len(outputs) != len(types) or any(
        o.blocks and o.block_shape(0) != t.shape for o, t in zip(outputs, types, strict=False)
    ):
        raise ValueError(
            f"the program's partitioning ({partitioning.describe()}) does not fit its "
            f"executable's outputs per device ({', '.join(map(str, types))})"
        )
    return tuple(ArrayType(t.dtype, o.shape) for t, o in zip(types, outputs, strict=True))


def _array_shards(code: int, sharding: ArraySharding) -> tuple[int, list[int], list[Any]]:
    """One array's shards as the native set_shards takes them."""
    blocks = [
        ([start for start, _ in block], [stop - start for start, stop in block])
        for block in sharding.blocks
    ]
    return code, list(sharding.shape), blocks


def _set_shards(
    native: _pjrt.Executable,
    partitioning: Partitioning,
    input_types: tuple[ArrayType, ...] | None,
    output_types: tuple[ArrayType, ...],
) -> None:
    """Hands a loaded executable its partitioning's blocks (it splits and assembles with them);
    raises ValueError when they do not fit it or its input types are unknown."""
    if input_types is None:
        raise ValueError("a program over several devices needs its input types to be known")
    partitioning.check_types(input_types, output_types)
    native.set_shards(
        list(partitioning.device_ids),
        [
            _array_shards(code_of_dtype(t.dtype), s)
            for t, s in zip(input_types, partitioning.inputs, strict=True)
        ],
        [
            _array_shards(code_of_dtype(t.dtype), s)
            for t, s in zip(output_types, partitioning.outputs, strict=True)
        ],
    )


def host_array(value: _pjrt.DeviceValue | np.ndarray, array_type: ArrayType) -> np.ndarray:
    """A native value as a numpy array: a view of it where it lies in host memory (a CPU
    plugin's output: no copy, as jax.jit's np.asarray of a CPU array), else a copy. jaxlib's
    client gives its outputs as such views already."""
    if isinstance(value, np.ndarray):
        return value
    dtype, shape = array_type
    if value.in_host_memory and value.nbytes:
        return np.frombuffer(value, np.uint8).view(dtype).reshape(shape)
    out = np.empty(shape, dtype)
    value.to_host(buffer_view(out))
    return out


def _as_bytes_like(value: Any, what: str) -> bytes | bytearray | memoryview:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be bytes, not {type(value).__name__}")
    return value


class Executable:
    """A program loaded into the PJRT client.

    Attributes:
        num_outputs: The number of outputs of the program.
        output_types: The ArrayType of each output, as the plugin reports it.
        input_types: The ArrayType of each argument, or None when it is not
            known. compile_program makes the executable with the lowered
            program's, and run then converts its arguments to these types.
        key: The disk cache key of the executable when compile_program made
            it, else None.
        partitioning: For a program over several devices, its devices and how
            its global inputs and outputs are split over them
            (worker.partitioning); None for a program of one device. run then
            takes and returns global arrays, as jax.jit does.

    What an executable is known by (key, input_types) is given as it is
    made (compile_executable, deserialize_executable), never stored into it
    from outside this module (tests/test_executable_writers.py).
    """

    num_outputs: int
    output_types: tuple[ArrayType, ...]
    key: str | None

    def __init__(
        self,
        native: _pjrt.Executable,
        runtime: Runtime,
        input_types: tuple[ArrayType, ...] | None = None,
        key: str | None = None,
        partitioning: Partitioning | None = None,
    ) -> None:
        self._native = native
        outputs = output_types_of(native, partitioning)
        if partitioning is not None:
            _set_shards(native, partitioning, input_types, outputs)
        self._set_types(runtime, outputs, input_types, key, partitioning)
        # Whether it keeps state between runs (keeps_state), read from its bytes the first
        # time it is primed: a scan of a 34 MB executable takes 120 ms, which a load of
        # one that is never primed need not pay.
        self._keeps_state: bool | None = None

    def _set_types(
        self,
        runtime: Runtime,
        output_types: tuple[ArrayType, ...],
        input_types: tuple[ArrayType, ...] | None,
        key: str | None,
        partitioning: Partitioning | None = None,
    ) -> None:
        self._runtime = runtime
        self.output_types = output_types
        self.num_outputs = len(output_types)
        self.key = key
        self.input_types = input_types
        self.partitioning = partitioning

    @property
    def input_types(self) -> tuple[ArrayType, ...] | None:
        """The ArrayType of each argument, or None when it is not known."""
        return self._input_types

    @input_types.setter
    def input_types(self, types: tuple[ArrayType, ...] | None) -> None:
        self._input_types = None if types is None else tuple(types)
        self._input_codes = None if types is None else [code_of_dtype(t.dtype) for t in types]

    @property
    def native(self) -> _pjrt.Executable:
        """The native executable (what the worker's hot loop runs), or on jaxlib's own client
        a JaxlibExecutable (worker.plugin.jaxlib_cpu), which has its methods."""
        return self._native

    @property
    def runs_natively(self) -> bool:
        """Whether the native module runs it (a PJRT plugin's executable: the worker's hot
        loop takes it), rather than Python (jaxlib's own client's)."""
        return isinstance(self._native, _pjrt.Executable)

    @property
    def output_bytes(self) -> tuple[int, ...]:
        """The size in bytes of each output, which fills ProgramSpec.output_bytes."""
        return tuple(t.nbytes for t in self.output_types)

    @property
    def platform(self) -> str:
        """The platform of the plugin that holds the executable."""
        return self._runtime.platform

    @staticmethod
    def compile(code: bytes, compile_options: bytes) -> Executable:
        """Compiles StableHLO bytecode with a serialized CompileOptionsProto.

        The plugin of this process compiles it (the default platform's loads
        first if none is loaded). The plugin checks the options: a malformed
        proto can make it abort the process, which is why a Pool compiles in
        worker processes.
        """
        return compile_executable(code, compile_options)

    @staticmethod
    def deserialize(serialized: bytes) -> Executable:
        """Loads an executable that serialize wrote with the same plugin.

        Bytes an executable compiled for a topology serialized load on a
        client whose devices form that topology. Raises PjrtError for bytes
        the plugin cannot read, and ForeignExecutableError for bytes that an
        older pjrt-pool stamped with another plugin build or host (see
        worker.compile.stamp).
        """
        return deserialize_executable(serialized)

    def serialize(self) -> bytes:
        """Returns the executable in the plugin's serialized form.

        The bytes are exactly what the plugin gives (PJRT_Executable_Serialize)
        and say nothing of the plugin build or host that made them: load them
        only with that build on such a host. The disk cache and bundles keep
        that identity beside the bytes and check it before loading; some
        plugins load another build's executable and compute wrongly.
        """
        return self._native.serialize()

    def fingerprint(self) -> str | None:
        """The plugin's fingerprint of the executable in hex (equal for equal compiles), or
        None where the plugin keeps none."""
        found = self._native.fingerprint()
        return None if found is None else found.hex()

    def prepare_arguments(self, arguments: Sequence[ArrayLike]) -> list[np.ndarray]:
        """Returns the arguments as C-contiguous arrays of the program's input types.

        Raises TypeError for a wrong number of arguments or a value that does
        not convert to its input type, and ValueError for a wrong shape.
        """
        return prepare_arguments(arguments, self.input_types)

    def run_into(
        self, arguments: list[np.ndarray], outputs: list[Any], zero_copy: bool = True
    ) -> None:
        """Executes with prepared arguments and writes the outputs into caller memory.

        arguments come from prepare_arguments; outputs are writable buffers of
        exactly output_bytes each, in output order (a worker passes shared
        memory here, so PJRT writes results where the parent reads them).
        The native module checks each argument's size against its element
        type and raises ValueError for a mismatch (an argument that skipped
        prepare_arguments), before the plugin reads it.
        """
        codes = self._input_codes
        if codes is None:
            codes = [code_of_dtype(a.dtype) for a in arguments]
        # Over several devices: the native module cuts each global argument into its
        # devices' blocks and puts each output together (see worker.partitioning).
        execute = (
            self._native.execute if self.partitioning is None else self._native.execute_sharded
        )
        execute(
            [buffer_view(a) for a in arguments],
            codes,
            [buffer_view(o) for o in outputs],
            zero_copy,
        )

    def run(self, arguments: Sequence[ArrayLike], zero_copy: bool = True) -> list[np.ndarray]:
        """Executes the program and returns its outputs with their shapes and dtypes.

        It goes through execute, as extension modules do, which makes it useful
        for tests and interactive checks. When the types of the arguments are
        known, as for an executable from compile_program, each argument converts
        to the type that the program takes, and otherwise it keeps its own dtype.
        """
        prepared = self.prepare_arguments(arguments)
        if self.partitioning is not None:  # over several devices: outputs put together here
            outputs = [np.empty(shape, dtype) for dtype, shape in self.output_types]
            self.run_into(prepared, outputs, zero_copy)
            return outputs
        codes = self._input_codes
        if codes is None:
            codes = [code_of_dtype(a.dtype) for a in prepared]
        values = self._native.execute_values([buffer_view(a) for a in prepared], codes, zero_copy)
        return [host_array(value, t) for value, t in zip(values, self.output_types, strict=True)]

    def prime(self) -> bool:
        """Runs the program PRIME_RUNS times on zeros of its input types, dropping the outputs.

        A plugin's first executions of an executable cost more than later
        ones (docs/facts.md, "First runs"); so a server primes what it loads
        before it says it is ready, and its first request runs at the warm
        speed. Zeros cannot fault a
        StableHLO program (XLA defines division by zero and clamps
        indices), but a loop whose end depends on the inputs may not end
        on zeros: leave such a program unprimed. The runs change nothing a
        later run sees: the program's results depend on its arguments
        only. Not primed, returning False:
        a program whose input types are unknown, and one that keeps state
        between runs or talks to the host (keeps_state: stablehlo.rng's
        counter, infeed/outfeed, send/recv), whose priming a later run
        would observe. A custom call's kernel (register_custom_call) sees
        the priming runs as calls on zeros. Returns True when it ran.
        """
        if self._input_types is None:
            return False
        if self._keeps_state is None:
            self._keeps_state = keeps_state(self._native.serialize())
        if self._keeps_state:
            return False
        arguments = [np.zeros(t.shape, t.dtype) for t in self._input_types]
        outputs = [np.empty(size, np.uint8) for size in self.output_bytes]
        for _ in range(PRIME_RUNS):
            self.run_into(arguments, outputs)
        return True

    def __repr__(self) -> str:
        inputs = "?" if self.input_types is None else ", ".join(map(str, self.input_types))
        outputs = ", ".join(map(str, self.output_types))
        over = "" if self.partitioning is None else f" over {self.partitioning.describe()}"
        return f"<Executable ({inputs}) -> ({outputs}) on {self.platform}{over}>"


def compile_executable(
    code: bytes,
    compile_options: bytes,
    *,
    key: str | None = None,
    input_types: tuple[ArrayType, ...] | None = None,
    partitioning: Partitioning | None = None,
) -> Executable:
    """Executable.compile, for an executable known by a cache key and taking these argument
    types, over the devices of its partitioning (None: one): compile_program's and the
    cache's loaders make every Executable through this, deserialize_executable or
    TopologyExecutable, which alone set what it is known by."""
    code = _as_bytes_like(code, "code")
    options = _as_bytes_like(compile_options, "compile_options")
    if len(code) == 0:
        raise ValueError("code is empty: pass StableHLO bytecode (LoweredProgram.code)")
    runtime = get_runtime()
    client = _client_for(runtime, partitioning)
    ensure_kernels_for(runtime, code)
    try:
        if isinstance(client, _pjrt.Client):
            native = client.compile(code, options)
        else:  # jaxlib's client is told the devices, which a plugin reads from the options
            native = client.compile(code, options, _device_ids(partitioning))
    except PjrtError as error:
        raise explain_missing_handler(error, runtime) from None
    return Executable(native, runtime, input_types, key, partitioning)


def _client_for(runtime: Runtime, partitioning: Partitioning | None) -> Any:
    """The client a program runs on: the runtime's, or one with its partitioning's devices
    (Runtime.client_for: DeviceCountError where there are not that many)."""
    if partitioning is None:
        return runtime.client
    return runtime.client_for(partitioning.devices, partitioning.mesh_text)


def _device_ids(partitioning: Partitioning | None) -> tuple[int, ...] | None:
    """The devices a program runs on (None: the client's first)."""
    return None if partitioning is None else partitioning.device_ids


def deserialize_executable(
    serialized: bytes,
    *,
    key: str | None = None,
    input_types: tuple[ArrayType, ...] | None = None,
    partitioning: Partitioning | None = None,
) -> Executable:
    """Executable.deserialize, for an executable known by a cache key and taking these
    argument types, over the devices of its partitioning (see compile_executable)."""
    serialized = _as_bytes_like(serialized, "serialized")
    if len(serialized) == 0:
        raise ValueError("serialized is empty: pass what Executable.serialize returned")
    runtime = get_runtime()
    client = _client_for(runtime, partitioning)
    serialized = check_stamp(serialized, runtime.identity())
    ensure_kernels_for(runtime, serialized)
    try:
        if isinstance(client, _pjrt.Client):
            native = client.deserialize(serialized)
        else:  # jaxlib's client loads onto the devices it is told (its count must fit)
            native = client.deserialize(serialized, _device_ids(partitioning))
    except PjrtError as error:
        raise explain_missing_handler(error, runtime) from None
    return Executable(native, runtime, input_types, key, partitioning)


class TopologyExecutable(Executable):
    """A program compiled for a topology without its devices: it serializes, it does not run here.

    compile_program(program, topology="v5e:1x1") returns one, compiled here
    or found in the disk cache; its bytes are what a process on devices of
    that topology loads (from the cache, a bundle or Executable.deserialize)
    and runs. run, run_into, prime and native raise NotLoadedError saying so.

    Attributes:
        topology: The topology it was compiled for, as it was named ("v5e:1x1").
    """

    def __init__(
        self,
        runtime: Runtime,
        topology: str,
        output_types: tuple[ArrayType, ...],
        serialized: bytes | _pjrt.UnloadedExecutable,
        input_types: tuple[ArrayType, ...] | None = None,
        key: str | None = None,
        partitioning: Partitioning | None = None,
    ) -> None:
        self._unloaded = serialized if isinstance(serialized, _pjrt.UnloadedExecutable) else None
        self._serialized = None if self._unloaded is not None else bytes(serialized)
        self.topology = topology
        self._set_types(runtime, output_types, input_types, key, partitioning)

    @staticmethod
    def compiled(
        runtime: Runtime,
        topology: str,
        native: _pjrt.UnloadedExecutable,
        *,
        key: str | None = None,
        input_types: tuple[ArrayType, ...] | None = None,
        partitioning: Partitioning | None = None,
    ) -> TopologyExecutable:
        """Wraps what the plugin compiled for a topology (over the devices of its
        partitioning, whose outputs are the global arrays it puts together)."""
        return TopologyExecutable(
            runtime,
            topology,
            output_types_of(native, partitioning),
            native,
            input_types,
            key,
            partitioning,
        )

    def _not_loaded(self) -> NotLoadedError:
        return NotLoadedError(
            f"this executable was compiled for the topology {self.topology} without a device "
            "(compile_program(..., topology=...)) and is not loaded here, so it cannot run: "
            "run it in a process on a host whose devices form that topology, where "
            "compile_program(program) or a Pool(platform=...) loads it from the cache it was "
            "published to without compiling, or ship it there in a bundle "
            "(pjrt-pool bundle create)"
        )

    @property
    def native(self) -> _pjrt.Executable:
        """Raises NotLoadedError: nothing is loaded on a device."""
        raise self._not_loaded()

    def serialize(self) -> bytes:
        """Returns the executable in the plugin's serialized form (see Executable.serialize)."""
        if self._unloaded is not None:
            return self._unloaded.serialize()
        assert self._serialized is not None
        return self._serialized

    def fingerprint(self) -> str | None:
        """The plugin's fingerprint in hex when this process compiled it, else None."""
        found = None if self._unloaded is None else self._unloaded.fingerprint()
        return None if found is None else found.hex()

    def run_into(
        self, arguments: list[np.ndarray], outputs: list[Any], zero_copy: bool = True
    ) -> None:
        """Raises NotLoadedError (see the class)."""
        raise self._not_loaded()

    def run(self, arguments: Sequence[ArrayLike], zero_copy: bool = True) -> list[np.ndarray]:
        """Raises NotLoadedError (see the class)."""
        raise self._not_loaded()

    def prime(self) -> bool:
        """Raises NotLoadedError (see the class)."""
        raise self._not_loaded()

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", compiled for {self.topology}, not loaded>"
