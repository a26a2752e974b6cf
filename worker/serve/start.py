"""A pool worker's start (``python -m worker``): bound to its parent's life, its plugin
loaded, the parent's Init answered with Ready, then the Server's loop.

Runs in a pool worker, first (worker/__main__.py calls main); the requests
that follow are worker.serve.server's.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from worker import log
from worker.cache import open_cache, process_counters
from worker.cache.remote import REMOTE_ENV
from worker.compile.target import target_for
from worker.identity.target import runtime_key_parts
from worker.plugin.runtime import get_runtime
from worker.plugin.topology import TopologySpec
from worker.records import CompileStatistics
from worker.serve.command_line import WorkerCommand
from worker.serve.server import PreloadError, Server
from worker.wire import protocol, shm
from worker.wire.protocol import Init, Ready, RemoteError

if TYPE_CHECKING:
    from worker.cache.store import DiskCache
    from worker.compile.target import Target
    from worker.plugin.runtime import Runtime

PARENT_POLL_SECONDS = 0.5
"""How often the watchdog thread checks that the parent lives (_watch_parent)."""

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Makes the kernel kill this process when the parent's thread that spawned it ends.

    The pool spawns workers from its manager thread, which outlives them.
    This holds even for a stopped (SIGSTOPped) or hung worker, which the
    watchdog thread below cannot help. The parent may have died before the
    call took effect, hence the check after it.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(0)


def _watch_parent(parent_pid: int) -> None:
    """Exits the process when the parent dies, even in the middle of a long compile.

    The socket's EOF tells an idle worker; this thread tells a busy one (and
    covers systems without PR_SET_PDEATHSIG).
    """
    while True:
        time.sleep(PARENT_POLL_SECONDS)
        if os.getppid() != parent_pid:
            os._exit(0)


def _run_initializer(payload: bytes) -> None:
    import cloudpickle  # only workers with an initializer pay for the import

    function, arguments = cloudpickle.loads(payload)
    function(*arguments)


def _describe_plugin(
    plugin: dict[str, Any],
    runtime: Runtime,
    cache: DiskCache,
    target: Target,
    topology: TopologySpec | None,
    never_compile: bool,
) -> None:
    """Fills in what Ready says of the plugin: its description, the topology it compiles for,
    and the key parts of its plugin and host where the parent computes keys (to refuse
    programs not in the cache, or to prefetch their entries from the remote tier:
    pool.warm.warming). What was filled in before a failure stays, for the report."""
    plugin.update(runtime.describe())
    if topology is not None:
        plugin["topology"] = str(topology)
    if never_compile or os.environ.get(REMOTE_ENV, "").strip():
        plugin["key_parts"] = runtime_key_parts(
            runtime, cache if cache.usable else None, target=target
        )


def main(command: WorkerCommand) -> int:
    """Starts the worker its command line describes (an inherited socket descriptor, ...);
    returns the exit status.

    In never-compile mode the worker loads what the disk cache holds and
    refuses the rest (worker.compile.never_compile), and its Ready message carries
    the key parts of its plugin and host, so that the parent can refuse
    programs that are not in the cache before they reach a worker. With a
    topology the worker compiles for it without a device and opens none (a
    compile worker: see worker.compile.target); its runs fail with
    NotLoadedError.
    """
    started = time.perf_counter()
    log.pass_on_warnings()  # its own output reaches only the pool's debug log
    platform, never_compile, topology = command.platform, command.never_compile, command.topology
    parent_pid = os.getppid() if command.parent_pid is None else command.parent_pid
    _die_with_parent(parent_pid)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    sock = socket.socket(fileno=command.fd)
    error = None
    plugin: dict[str, Any] = {}
    arena = mmap.mmap(-1, shm.ALIGNMENT)  # replaced by the parent's arena below
    arena_size = 0
    server: Server | None = None
    loaded: tuple[str, ...] = ()
    hot: tuple[protocol.HotSlot, ...] = ()
    statistics: CompileStatistics | None = None
    failed_program: str | None = None
    try:
        # The cache before the plugin: loading it reads and fills the cache's
        # records about plugin builds only if the cache exists (runtime._existing_memos).
        # It is this process's default cache: the parent gave the worker its directory
        # as PJRT_POOL_CACHE_DIR (worker.serve.command_line).
        cache = open_cache()
        runtime = get_runtime(platform, deviceless=topology is not None)
        target = target_for(runtime, topology)
        _describe_plugin(plugin, runtime, cache, target, topology, never_compile)
        request, fds = protocol.recv_frame(sock)
        if not isinstance(request, Init) or len(fds) != 1:
            raise RuntimeError(f"expected Init with an arena first, got {request!r}")
        arena = shm.attach(fds[0], request.arena_size + protocol.CONTROL_BYTES)
        arena_size = request.arena_size
        if request.initializer:
            _run_initializer(request.initializer)
        server = Server(sock, arena, arena_size, command.max_loaded, never_compile, topology)
        if request.preload:
            loaded, statistics, hot = server.preload(request.preload, request.prime)
    except protocol.ConnectionLostError:
        return 0
    except PreloadError as failure:  # the program's own error, for the parent to raise
        error, failed_program = RemoteError.of(failure.cause), failure.program
    except Exception as failure:  # start-up failures are reported, then the worker exits
        error = RemoteError.of(failure)
    counters = None if statistics is None else process_counters()._asdict()
    protocol.send_frame(
        sock,
        Ready(
            os.getpid(),
            plugin,
            time.perf_counter() - started,
            error,
            loaded,
            statistics,
            counters,
            failed_program,
            hot,
            log.said(),
        ),
    )
    if error is not None or server is None:
        return 1
    sys.stdout.flush()
    server.serve()
    return 0
