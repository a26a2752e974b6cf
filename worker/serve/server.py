"""The worker process: serve compile and run requests from the parent.

    parent ──HotRun──────────────▶ socket ──▶ _pjrt.HotLoop ──▶ PJRT execute (arena)
           ◀──HotReply─────────────        ◀──  (no Python, GIL released)
                                                 │ any other frame
                                                 ▼
           ──Init/Compile/Run/Exit──▶         serve() ──▶ compile_program
           ◀──Ready, Reply──────────          ◀──  Executable.run_into(shm)

One request at a time, in order. (A worker on jaxlib's own CPU client, whose
executables the native loop cannot run, serves the same requests from Python:
worker.serve.python_runs.) A program run again and again with its
inputs and outputs in the arena gets a hot slot: the parent then sends a
HotRun of a few bytes for it, which the native hot loop answers with a
HotReply after little more than the run itself (no Python at all: the slot
holds the executable and its places in the arena, checked once when the
first full Run registered it). Every other frame, and a HotRun of a slot the
loop does not know, comes back to serve(), which finishes reading it.
Every failure of a request (a bad program, wrong arguments, a plugin error)
becomes an error Reply and the worker lives on; only a crash of the plugin
itself ends the process, which the parent sees and reports as that request's
failure. Executables stay loaded in an LRU so that repeated runs skip even
the disk cache.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import socket
import sys
import time
from collections import OrderedDict
from itertools import count
from typing import TYPE_CHECKING, Any, NamedTuple

from worker import _pjrt, log
from worker.cache import process_counters
from worker.cache.remote import remote_counters
from worker.compile.by_key import load_cached_executable
from worker.compile.compiler import cache_key_of, compile_program
from worker.compile.executable import Executable
from worker.compile.for_jax import compile_for_jax
from worker.dtypes import code_of_dtype
from worker.errors import PjrtPoolError
from worker.log import get_logger
from worker.phases import last_phases
from worker.plugin.device_errors import fatal_device_error
from worker.plugin.runtime import get_runtime, loaded_runtime
from worker.plugin.topology import TopologySpec
from worker.records import ArrayType, CompileStatistics, ProgramSpec
from worker.serve.placed import (
    InputLayout,
    OutputLayout,
    check_run_inputs,
    in_arena_at,
    run_from_views,
    run_placed,
)
from worker.serve.python_runs import PythonRuns
from worker.wire import places, protocol, shm
from worker.wire.protocol import (
    Compile,
    Exit,
    Fetch,
    HotRun,
    PlacedRun,
    Put,
    RemoteError,
    Reply,
    Run,
)

if TYPE_CHECKING:
    from worker.bundle.reader import Bundle

SPIN_SECONDS = 200e-6
"""How long a worker polls for the next request before sleeping (protocol.spin_until_readable
explains why); the hot loop does the polling."""

DEVICE_FAILURE_EXIT = 75
"""The exit status of a worker that stopped because its device became unusable."""

logger = get_logger("pjrt_pool.worker")


def register_slot(
    loop: _pjrt.HotLoop,
    slot: int,
    executable: Executable,
    input_types: tuple[ArrayType, ...],
    input_offsets: tuple[int, ...],
    output_offsets: tuple[int, ...],
) -> None:
    """Gives a hot loop a slot: the executable and the places of its arrays in the arena.
    An executable the native loop cannot run (Executable.runs_natively) gets none: the loop
    hands its HotRuns back to Python (Server.run_hot)."""
    if not executable.runs_natively:
        return
    inputs = [
        (offset, t.nbytes, code_of_dtype(t.dtype), t.shape)
        for t, offset in zip(input_types, input_offsets, strict=True)
    ]
    outputs = [
        (offset, t.nbytes)
        for t, offset in zip(executable.output_types, output_offsets, strict=True)
    ]
    loop.set_slot(slot, executable.native, inputs, outputs)


class _ArenaViews(NamedTuple):
    """A program's inputs and outputs as views of the worker's arena, and its hot slot."""

    program_id: str
    executable: Executable
    inputs: list[Any]
    outputs: list[Any]
    output_offsets: tuple[int, ...]
    end: int
    slot: int


class PreloadError(PjrtPoolError):
    """A program named in Init.preload did not load (or prime); `program` names it."""

    def __init__(self, program: str, cause: BaseException) -> None:
        super().__init__(f"preloading program {program!r} failed: {cause}")
        self.program = program
        self.cause = cause


class Server:
    """A worker's state: its socket, loaded executables and statistics."""

    def __init__(
        self,
        sock: socket.socket,
        arena: mmap.mmap,
        arena_size: int,
        max_loaded: int,
        never_compile: bool = False,
        topology: TopologySpec | None = None,
    ) -> None:
        self.sock = sock
        self.arena = arena  # arena_size bytes of data, then the control bytes
        self.arena_size = arena_size
        self.max_loaded = max_loaded
        self.never_compile = never_compile
        self.topology = topology
        """The topology this worker compiles for without a device (None: its device)."""
        self.loaded: OrderedDict[str, Executable] = OrderedDict()
        # Each loaded executable's own input layout (None: types unknown), for check_run_inputs.
        self._layouts: dict[str, InputLayout | None] = {}
        # Views of the arena per (program, input layout): a program run again
        # and again reuses them, skipping the views' construction and the
        # argument checks (the parent checked and converted the arguments).
        self._arena_views: dict[tuple[str, tuple[int, ...]], _ArenaViews] = {}
        # The same views by hot slot, for HotRun; the hot loop holds each slot too.
        # Slots are never reused, so a stale one can only miss, never run another program.
        self._hot: dict[int, _ArenaViews] = {}
        self._slots = count()
        self._hot_loop = _pjrt.HotLoop(sock.fileno(), arena, arena_size, SPIN_SECONDS)
        self._preloaded: set[str] = set()  # the keys Init.preload loaded
        self._placed: dict[str, int] = {}  # each loaded program's slot for PlacedRuns
        self._placed_here: dict[int, str] = {}  # the slots this Python side runs: programs
        self._bundles: dict[str, Bundle] = {}  # those runs came from, by source, kept open
        # Runs and kept values of executables the hot loop cannot run (jaxlib's client's).
        self._python = PythonRuns(self._hot_loop)

    def _preloaded_as(self, program: Any, compile_options: bytes | None) -> Executable | None:
        """The preloaded executable that a program (sent by a Run or a Compile) compiles to,
        if it is still loaded: the same cache key, and the same input types (else None)."""
        key = cache_key_of(program, compile_options=compile_options, topology=self.topology)
        executable = self.loaded.get(key) if key in self._preloaded else None
        if executable is None or executable.input_types != program.input_types:
            return None
        return executable

    def _load(
        self,
        program_id: str,
        program: Any,
        cache_key: str | None = None,
        compile_options: bytes | None = None,
        bundle: tuple[str, str] | None = None,
        name: str | None = None,
    ) -> tuple[Executable, CompileStatistics | None, tuple[str, ...]]:
        """Returns the program's executable, compiling or loading it if needed: from the disk
        cache by cache_key, or with bundle (its path or URL, and the program's name) from
        that bundle, read-only. name is the task's name for the program, which an entry
        compiled here records (compile_program's name).

        The statistics are None when the executable was loaded already, or when
        a preloaded one serves the program (see preload).
        """
        executable = self.loaded.get(program_id)
        if executable is not None:
            self.loaded.move_to_end(program_id)
            return executable, None, ()
        if program is not None and self._preloaded:
            executable = self._preloaded_as(program, compile_options)
        if executable is not None:
            statistics = None  # nothing loaded: the preloaded executable serves it
        elif program is not None:
            options = {} if compile_options is None else {"compile_options": compile_options}
            executable, statistics = compile_program(
                program,
                never_compile=self.never_compile,
                topology=self.topology,
                name=name,
                **options,
            )
        elif cache_key is not None:
            started = time.perf_counter()
            if bundle is None:
                executable = load_cached_executable(cache_key)
            else:
                executable = self._from_bundle(*bundle)
            statistics = CompileStatistics(load_seconds=time.perf_counter() - started, loaded=1)
        else:
            raise LookupError(f"program {program_id} is not loaded in this worker")
        self.loaded[program_id] = executable
        types = executable.input_types
        self._layouts[program_id] = None if types is None else InputLayout.of(types)
        evicted = []
        while len(self.loaded) > self.max_loaded:
            evicted.append(self.loaded.popitem(last=False)[0])
            self._preloaded.discard(evicted[-1])
        if evicted:
            gone = set(evicted)
            for views in self._arena_views.values():
                if views.program_id in gone:
                    del self._hot[views.slot]
                    self._hot_loop.drop_slot(views.slot)
            self._arena_views = {k: v for k, v in self._arena_views.items() if k[0] not in gone}
            for program in gone:
                self._layouts.pop(program, None)
                slot = self._placed.pop(program, None)
                if slot is not None:
                    self._hot_loop.drop_slot(slot)
                    self._placed_here.pop(slot, None)
        return executable, statistics, tuple(evicted)

    def _from_bundle(self, source: str, name: str) -> Executable:
        """A program of a bundle, loaded read-only (worker.bundle.loading: the entry built for
        this plugin and host); each bundle is opened, and checked, once per worker."""
        # Here: a worker that runs no bundle's programs starts without the bundle modules.
        from worker.bundle.loading import load_from_bundle
        from worker.bundle.reader import Bundle

        bundle = self._bundles.get(source)
        if bundle is None:
            bundle = self._bundles[source] = Bundle(source)
        return load_from_bundle(bundle, name)[0]

    def preload(
        self, programs: tuple[tuple[str, str], ...], prime: bool
    ) -> tuple[tuple[str, ...], CompileStatistics | None, tuple[protocol.HotSlot, ...]]:
        """Loads executables by cache key before the worker says Ready (Init.preload), priming
        each (Executable.prime) when asked; returns the keys loaded, what loading added,
        and the hot slots of those whose inputs and outputs fit the arena.

        Each is loaded under its key, as a Run by that key loads it, so a task
        for it finds it here, and gets its hot slot at once, laid out as the
        parent lays out its inputs (shm.layout from the arena's start): the
        parent sends its first run as a HotRun. A Run or Compile of a program
        that compiles to a preloaded key uses that executable too, loading
        nothing. A program that does not load raises PreloadError, naming it,
        with the cause chained.
        """
        total: CompileStatistics | None = None
        loaded = []
        for key, name in programs:
            try:
                executable, statistics, _ = self._load(key, None, cache_key=key)
                if prime:
                    executable.prime()
            except Exception as error:
                raise PreloadError(name, error) from error
            if statistics is not None:
                total = statistics if total is None else total.add(statistics)
            loaded.append(key)
            self._preloaded.add(key)
            if executable.input_types is not None:
                self._arena_slot(key, executable, InputLayout.of(executable.input_types))
        hot = tuple(
            protocol.HotSlot(
                key,
                views.slot,
                views.executable.input_types,
                key_offsets,
                views.executable.output_types,
                views.output_offsets,
            )
            for (key, key_offsets), views in self._arena_views.items()
            if key in self.loaded
        )
        return tuple(key for key in loaded if key in self.loaded), total, hot

    def compile(self, request: Compile) -> Reply:
        if request.jax is not None:
            spec, statistics = compile_for_jax(request.program, request.jax, request.name)
            return Reply(request.task_id, spec=spec, statistics=statistics)
        executable, statistics, evicted = self._load(
            request.program_id,
            request.program,
            compile_options=request.compile_options,
            name=request.name,
        )
        return Reply(
            request.task_id,
            spec=ProgramSpec.from_executable(request.name, executable),
            statistics=statistics,
            evicted=evicted,
            phases=None if statistics is None else last_phases(),
        )

    def _arena_slot(
        self, program_id: str, executable: Executable, layout: InputLayout
    ) -> _ArenaViews | None:
        """A program's views of the arena and its hot slot for inputs laid out so, made on
        first use; None when its inputs and outputs do not fit the arena together, and for a
        program over several devices: the hot loop runs programs of one device
        (native/hot_loop.cc), and the others take the general path, splitting and
        assembling their arrays in the native module (Executable.run_into)."""
        key = (program_id, layout.offsets)
        views = self._arena_views.get(key)
        if views is None:
            types = executable.input_types
            offsets, end = shm.layout(executable.output_types, shm.aligned(layout.size))
            if types is None or end > self.arena_size or executable.partitioning is not None:
                return None
            views = _ArenaViews(
                program_id,
                executable,
                shm.views(self.arena, types, layout.offsets),
                shm.views(self.arena, executable.output_types, offsets),
                offsets,
                end,
                next(self._slots),
            )
            register_slot(self._hot_loop, views.slot, executable, types, layout.offsets, offsets)
            self._arena_views[key] = views
            self._hot[views.slot] = views
        return views

    def _run_in_arena(
        self, request: Run, executable: Executable, own: InputLayout
    ) -> _ArenaViews | None:
        """Runs a program whose inputs and outputs fit the arena; None if they do not."""
        views = self._arena_slot(request.program_id, executable, own)
        if views is not None:
            executable.run_into(views.inputs, views.outputs, request.zero_copy)
        return views

    def _placed_slot(self, program_id: str, executable: Executable) -> int:
        """The slot its placed runs name (worker.wire.places.PlacedRun), made on first use: the
        native hot loop's, or for an executable it cannot run this side's (the loop hands
        such a slot's PlacedRuns back: placed_here)."""
        slot = self._placed.get(program_id)
        if slot is None:
            types = executable.input_types
            assert types is not None, "placed runs are of programs of known input types"
            slot = next(self._slots)
            if executable.runs_natively:
                inputs = [(code_of_dtype(t.dtype), list(t.shape)) for t in types]
                self._hot_loop.set_placed_slot(slot, executable.native, inputs)
            else:
                self._placed_here[slot] = program_id
            self._placed[program_id] = slot
        return slot

    def placed_here(self, request: PlacedRun, fds: list[int]) -> None:
        """Answers a PlacedRun that the hot loop left to Python (a slot it does not hold): runs
        a slot of this side's (a program the loop cannot run), else fails with LookupError
        (the program was unloaded: the parent sends the full Run), as the loop would. Its
        segments are mapped first, whatever follows. Any failure is answered as a Run's."""
        try:
            self._apply(request.segments, fds, request.drops, request.forgets)
            protocol.STARTED.pack_into(self.arena, self.arena_size, request.task_id)
            program_id = self._placed_here.get(request.slot)
            if program_id is None:
                raise LookupError(f"hot slot {request.slot} is not loaded in this worker")
            executable = self.loaded[program_id]
            self.loaded.move_to_end(program_id)
            types = executable.input_types
            assert types is not None, "placed runs are of programs of known input types"
            if len(request.sources) != len(types):
                raise ValueError(
                    f"a placed run gives {len(request.sources)} inputs to a program of {len(types)}"
                )
            self._python.run_at(
                request.sources, list(request.destinations), executable, types, request.zero_copy
            )
        except Exception as error:  # as in handle: the request's failure is its reply
            self._send(*self._failed(request.task_id, error))
            return
        finally:
            for fd in fds:
                os.close(fd)
        protocol.send_frame(self.sock, protocol.HotReply(request.task_id))

    def _apply(
        self,
        segments: tuple[tuple[int, int], ...],
        fds: list[int],
        drops: tuple[int, ...],
        forgets: tuple[int, ...],
    ) -> None:
        """Maps a request's new segments (one descriptor each; the caller closes them), then
        drops and forgets what it names: first, whatever fails later (the parent counts the
        segments as mapped once sent, unless the request fails: WorkerMemory.failed)."""
        if len(fds) != len(segments):
            raise ValueError(f"{len(segments)} new segments came with {len(fds)} descriptors")
        self._hot_loop.map_segments(
            [(segment, fd, size) for (segment, size), fd in zip(segments, fds, strict=True)]
        )
        self._hot_loop.drop_values(list(drops))
        self._python.drop(drops)
        self._hot_loop.forget_segments(list(forgets))
        runtime = loaded_runtime()
        if (drops or forgets) and runtime is not None and not runtime.runs_natively:
            # jaxlib drops its references to inputs it read in place (and to values' host
            # copies) when it next holds the GIL: now, so that forgotten segments unmap.
            runtime.plugin.let_go()

    def run(self, request: Run, fds: list[int]) -> tuple[Reply, tuple[int, ...]]:
        self._apply(request.segments, fds, request.drops, request.forgets)
        executable, statistics, evicted = self._load(
            request.program_id,
            request.program,
            request.cache_key,
            request.compile_options,
            (request.bundle, request.name) if request.bundle else None,
            request.name,
        )
        own = self._layouts[request.program_id]
        types = check_run_inputs(request, own)
        reply = functools.partial(
            Reply,
            request.task_id,
            output_types=executable.output_types if request.want_output_types else None,
            statistics=statistics,
            evicted=evicted,
        )
        if own is None or types != own.types or executable.partitioning is not None:
            layout = run_from_views(
                self._hot_loop, self.arena, self.arena_size, request, executable, types
            )
            return reply(
                output_offsets=layout.offsets, output_size=layout.size, output_place=layout.place
            ), () if layout.fd is None else (layout.fd,)
        if self._hot_layout(request, executable, own):
            views = self._run_in_arena(request, executable, own)
            if views is not None:
                return reply(
                    output_offsets=views.output_offsets,
                    output_size=views.end,
                    output_place="arena",
                    hot_slot=views.slot,
                    placed_slot=self._placed_slot(request.program_id, executable),
                ), ()
        placed_slot = self._placed_slot(request.program_id, executable)
        layout = OutputLayout.of(request, types, executable.output_types, self.arena_size)
        if executable.runs_natively:
            run_placed(self._hot_loop, request, placed_slot, layout)
        else:
            self._python.run(request, executable, types, layout)
        answer = reply(
            output_offsets=layout.offsets,
            output_size=layout.size,
            output_place=layout.place,
            placed_slot=placed_slot,
        )
        return answer, () if layout.fd is None else (layout.fd,)

    def _hot_layout(self, request: Run, executable: Executable, own: InputLayout) -> bool:
        """Whether a Run's inputs and outputs lie in the arena as a hot slot lays them out
        (outputs right after the inputs; destinations None lays them so, if they fit), so
        that it runs through, and gives, the program's hot slot."""
        if request.keep or not in_arena_at(request.sources, own.offsets):
            return False
        if request.destinations is None:
            return True
        offsets, _ = shm.layout(executable.output_types, shm.aligned(own.size))
        return request.destinations == tuple((places.PLACE, 0, o) for o in offsets)

    def put(self, request: Put, fds: list[int]) -> Reply:
        """Copies an array from shared memory to the device and keeps it (Pool.put)."""
        self._apply(request.segments, fds, request.drops, request.forgets)
        kind, segment, offset = request.source
        if kind != places.PLACE:
            raise ValueError("a value is put from shared memory")
        array_type = request.array_type
        runtime = get_runtime()
        if not runtime.runs_natively:
            self._python.put(request.value_id, runtime.client, request.source, array_type)
            return Reply(request.task_id)
        self._hot_loop.put_value(
            request.value_id,
            runtime.client,
            segment,
            offset,
            code_of_dtype(array_type.dtype),
            list(array_type.shape),
        )
        return Reply(request.task_id)

    def fetch(self, request: Fetch, fds: list[int]) -> Reply:
        """Copies a kept value into shared memory (DeviceValue.fetch), or, with no value, only
        takes what the parent let go of."""
        self._apply(request.segments, fds, request.drops, request.forgets)
        if request.value_id >= 0:
            kind, segment, offset = request.destination
            if kind != places.PLACE:
                raise ValueError("a value is fetched into shared memory")
            if self._python.holds(request.value_id):
                client = get_runtime().client
                self._python.fetch(request.value_id, client, request.destination)
            else:
                self._hot_loop.fetch_value(request.value_id, segment, offset)
        held = self._hot_loop.value_count + self._python.value_count
        return Reply(request.task_id, values_held=held)

    def run_hot(self, request: HotRun) -> None:
        """Answers a HotRun that the hot loop left to Python: runs its slot and says so.

        The loop leaves a HotRun of a slot it does not know (its program was
        unloaded: a LookupError, after which the parent sends the full Run;
        or its executable is one the loop cannot run, which runs here) and
        one that came with descriptors. Any failure is answered as a Run's
        would be.
        """
        protocol.STARTED.pack_into(self.arena, self.arena_size, request.task_id)
        try:
            views = self._hot.get(request.slot)
            if views is None:
                raise LookupError(f"hot slot {request.slot} is not loaded in this worker")
            if views.executable.runs_natively:
                self._hot_loop.run(request.task_id, request.slot, request.zero_copy)
            else:  # the loop holds no slot for it (register_slot)
                views.executable.run_into(views.inputs, views.outputs, request.zero_copy)
                self.loaded.move_to_end(views.program_id)
        except Exception as error:  # as in handle: the request's failure is its reply
            self._send(*self._failed(request.task_id, error))
            return
        finally:
            self._note_hot_runs()
        protocol.send_frame(self.sock, protocol.HotReply(request.task_id))

    def _note_hot_runs(self) -> None:
        """Tells the LRU of loaded programs about the runs of the hot loop since the last call."""
        for slot in self._hot_loop.take_used():
            views = self._hot.get(slot)
            if views is not None:
                self.loaded.move_to_end(views.program_id)

    def handle(self, request: Any, fds: list[int]) -> bool:
        """Answers one request; returns False when the worker should exit."""
        if isinstance(request, Exit):
            return False
        if type(request) is HotRun:
            for fd in fds:  # a HotRun carries none: any that came are not ours to keep
                os.close(fd)
            self.run_hot(request)
            return True
        if type(request) is PlacedRun:
            self.placed_here(request, fds)
            return True
        task_id = getattr(request, "task_id", -1)
        # Before any work: if this process dies from here on, the parent
        # knows the task had started (see protocol.CONTROL_BYTES).
        protocol.STARTED.pack_into(self.arena, self.arena_size, task_id)
        out_fds: tuple[int, ...] = ()
        failure = None
        try:
            if isinstance(request, Compile):
                reply = self.compile(request)
            elif isinstance(request, Run):
                reply, out_fds = self.run(request, fds)
            elif isinstance(request, Put):
                reply = self.put(request, fds)
            elif isinstance(request, Fetch):
                reply = self.fetch(request, fds)
            else:
                raise TypeError(f"unknown request {type(request).__name__}")
        except Exception as error:  # every request failure is that request's reply
            reply, failure = self._failed(task_id, error)
        finally:
            for fd in fds:
                os.close(fd)
        self._send(reply, failure, out_fds)
        return True

    @staticmethod
    def _failed(task_id: int, error: Exception) -> tuple[Reply, str | None]:
        """The reply of a request that failed, and the device failure that ends the worker."""
        failure = fatal_device_error(error)
        return Reply(task_id, error=RemoteError.of(error), fatal=failure is not None), failure

    def _send(self, reply: Reply, failure: str | None, out_fds: tuple[int, ...] = ()) -> None:
        """Sends a reply (and closes its descriptors); after a device failure, exits."""
        if reply.statistics is not None:
            reply = _with_counters(reply)
        said = log.said()
        if said:
            reply = dataclasses.replace(reply, warnings=said)
        try:
            protocol.send_frame(self.sock, reply, out_fds)
        finally:
            for fd in out_fds:
                os.close(fd)
        if failure is not None:
            # The device context is unusable for good: end the process rather
            # than fail every later task (and skip a teardown that may hang on it).
            logger.error("the device failed (%s); this worker exits", failure)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(DEVICE_FAILURE_EXIT)

    def serve(self) -> None:
        """Answers requests until Exit or until the parent closes the socket."""
        while True:
            try:
                request, fds = self._receive()
            except (protocol.ConnectionLostError, ConnectionResetError):
                return
            except protocol.DescriptorLimitError as error:
                # The request arrived without its segments: answer it as failed.
                task_id = getattr(error.message, "task_id", -1)
                protocol.send_frame(self.sock, Reply(task_id, error=RemoteError.of(error)))
                continue
            if not self.handle(request, fds):
                return

    def _receive(self) -> tuple[Any, list[int]]:
        """The next request that the hot loop, answering HotRuns meanwhile, leaves to Python."""
        while True:
            try:
                first, fds, truncated = self._hot_loop.serve()
            except ConnectionError:
                raise  # the socket's (the hot loop raises nothing else as one): serve() decides
            except Exception as error:  # a run failed (mmap's OSError too): its reply says so
                self._send(*self._failed(self._hot_loop.last_task_id, error))
                continue
            finally:
                self._note_hot_runs()
            return protocol.finish_frame(self.sock, first, fds, truncated)


def _with_counters(reply: Reply) -> Reply:
    """Adds the cache counters to a reply whose request compiled or loaded something."""
    remote = remote_counters()
    return dataclasses.replace(
        reply,
        counters=process_counters()._asdict(),
        remote_counters=remote._asdict() if any(remote) else None,
    )
