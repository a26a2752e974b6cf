"""A worker's process: its command line and environment, spawning it, and stopping workers.

What the operating system sees of a worker, and nothing of the pool's books:
spawn_worker makes the arena, the socket pair and the `python -m worker`
process and sends it its Init; stop_all ends workers together. Only the
pool's manager thread spawns workers (pool.executor.starts), since their
PR_SET_PDEATHSIG is tied to the thread that spawned them, which outlives
them all.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time

from pool.executor.roles import ROLE_ENV, WorkerPlan
from pool.executor.settings import PoolSettings
from pool.executor.tasks import Kind
from pool.executor.worker_process import ARENA_SIZE, WorkerProcess
from pool.spawn import child_environment, python_command, with_huge_pages
from worker.cache import CACHE_DIR_ENV
from worker.cache.remote.location import REMOTE_ENV
from worker.serve.command_line import WorkerCommand
from worker.wire import protocol, shm
from worker.wire.fds import close_quietly


def spawn_worker(index: int, settings: PoolSettings, plan: WorkerPlan) -> WorkerProcess:
    """Starts the worker of slot `index` as the pool's settings and its plan say; it is
    STARTING until its Ready comes. Raises what spawning raised, leaving nothing behind."""
    started_at = time.monotonic()
    # The arena and socket come first: a failure here leaves no process behind.
    arena_fd, arena = shm.create(ARENA_SIZE + protocol.CONTROL_BYTES, "pjrt-pool-arena")
    protocol.STARTED.pack_into(arena, ARENA_SIZE, -1)
    try:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    except BaseException:
        close_quietly(arena_fd)
        raise
    try:
        command = _worker_command(child_end.fileno(), settings, plan)
        process = subprocess.Popen(
            python_command("worker", *command.arguments()),
            pass_fds=(child_end.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_worker_environment(settings, plan),
            # Its own session: a Ctrl-C meant for the parent must not kill
            # workers behind the pool's back; the pool stops them itself.
            start_new_session=True,
        )
    except BaseException:
        close_quietly(arena_fd)
        parent_end.close()
        raise
    finally:
        child_end.close()
    worker = WorkerProcess(index, plan.role, process, parent_end, arena, started_at)
    # What a pool preloads is to run: a compile worker, which runs nothing (and on a
    # TPU host holds no chip to load onto), preloads none of it.
    runs = plan.role.takes(Kind.RUN)
    init = protocol.Init(
        settings.initializer,
        ARENA_SIZE,
        settings.preload if runs else (),
        settings.prime and runs,
    )
    try:
        worker.send(init, (arena_fd,))
    except OSError:
        pass  # the worker died at once; the pool sees the end of its socket
    finally:
        close_quietly(arena_fd)
    return worker


def _worker_command(fd: int, settings: PoolSettings, plan: WorkerPlan) -> WorkerCommand:
    """A worker's command line (worker.serve.command_line), for its slot's plan."""
    return WorkerCommand(
        fd=fd,
        max_loaded=settings.max_loaded,
        parent_pid=os.getpid(),
        platform=settings.platform,
        never_compile=settings.never_compile,
        topology=plan.topology,
    )


def _worker_environment(settings: PoolSettings, plan: WorkerPlan) -> dict[str, str]:
    """A worker's environment: this process's, with the pool's cache directory (the one way a
    worker is given it) and remote tier, for this worker only (remote False: none at all),
    its plan's variables, and huge pages for the plugin's large buffers (see
    with_huge_pages)."""
    given = {CACHE_DIR_ENV: str(settings.cache_dir)}
    if settings.remote:
        given[REMOTE_ENV] = settings.remote
    environment = child_environment(given)
    if settings.remote is False:
        environment.pop(REMOTE_ENV, None)
    environment.update(plan.environment)
    environment[ROLE_ENV] = plan.role.value
    return with_huge_pages(environment)


def stop_all(workers: list[WorkerProcess], grace: float) -> None:
    """Stops workers together: Exit request, then SIGTERM, then SIGKILL; reaps each.

    All of them get each step at once, so stopping N hung workers takes about
    2 x grace seconds, not N times that.
    """
    running = [w for w in workers if w.process.poll() is None]
    for worker in running:
        with contextlib.suppress(OSError):
            worker.send(protocol.Exit())
    running = _still_running(running, grace)
    for worker in running:
        with contextlib.suppress(ProcessLookupError):
            worker.process.terminate()
    running = _still_running(running, grace)
    for worker in running:
        worker.kill()
    _still_running(running, 10.0)
    for worker in workers:
        worker.close()


def _still_running(workers: list[WorkerProcess], seconds: float) -> list[WorkerProcess]:
    """Waits up to `seconds` in all for workers to end; returns those that did not."""
    deadline = time.monotonic() + seconds
    for worker in workers:
        worker.wait_exit(max(0.0, deadline - time.monotonic()))
    return [w for w in workers if w.process.poll() is None]
