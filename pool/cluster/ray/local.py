"""A Ray cluster on this machine: a head and worker nodes, each a `ray start` process.

For trying a RayClusterPool out (`pjrt-pool warm --ray local:N`) and for the
tests: every node is a real Ray node (its own raylet and object store, as on
another machine), started by `ray start --block` in a session of its own, on
loopback only (LOOPBACK), with small object stores. The head has no CPUs, so it hosts
no NodeActor (pool.cluster.ray.nodes): the cluster's N nodes are the worker
nodes. close() interrupts each `ray start` (which stops its node's
processes) and kills what is left of each node's session: nothing started
here outlives it. Each node may declare resources of its own
(resources={"TPU": 1} stands for a TPU host: pool.cluster.ray.nodes).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from worker.errors import PjrtPoolError

LOOPBACK = "127.0.0.2"
"""The address every node listens and is reached at: loopback, but not 127.0.0.1 nor
localhost, which Ray replaces by this machine's outward address (so that other machines can
reach it), where a local cluster must not be reached."""

START_SECONDS = 120.0
"""How long a node may take to start before LocalRayCluster gives up (a busy 2-core machine
started three in about 15 s)."""

STOP_GRACE_SECONDS = 15.0
"""How long a node's `ray start` has to stop its processes before they are killed."""

OBJECT_STORE_BYTES = 100 << 20
"""Each node's object store: small, since a local cluster's nodes share this machine's memory
(Ray's default is 30% of it per node)."""

_STARTED = "Ray runtime started."
"""What `ray start` prints once its node runs (and, for a worker node, has joined the head)."""

_QUIET = ("--disable-usage-stats", "--include-log-monitor=false")
# Every port a node opens that Ray would otherwise take the same default of on every node:
# 0 lets each pick a free one, so several nodes (and several clusters) share this machine.
_FREE_PORTS = (
    "--dashboard-agent-listen-port=0",
    "--dashboard-agent-grpc-port=0",
    "--runtime-env-agent-port=0",
    "--metrics-export-port=0",
)


class _NodeGaveUpError(PjrtPoolError, RuntimeError):
    """A node's `ray start` exited as it started."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def _ray_command() -> list[str]:
    """How to run Ray's command line in this Python (its script beside this interpreter)."""
    script = Path(sys.executable).with_name("ray")
    if script.is_file():
        return [str(script)]
    found = shutil.which("ray")
    if found is None:
        raise FileNotFoundError(
            "Ray's command line (ray) is neither beside this Python nor on PATH: install the "
            "ray extra in this environment"
        )
    return [found]


class LocalRayCluster:
    """A head and `nodes` worker nodes on this machine (see the module docstring).

    nodes is a count, or one mapping per node of its options: "cpus" (default
    cpus_per_node) and "resources" (a dict of custom resources). It returns
    once every node has joined; address is what ray.init takes. Use it as a
    context manager, or call close().
    """

    def __init__(
        self,
        nodes: int | Sequence[Mapping[str, Any]] = 2,
        *,
        cpus_per_node: int | None = None,
        start_timeout: float = START_SECONDS,
    ) -> None:
        if isinstance(nodes, int):
            if isinstance(nodes, bool) or nodes < 1:
                raise ValueError(f"a local Ray cluster needs at least one node, not {nodes!r}")
            nodes = [{}] * nodes
        self._cpus = cpus_per_node or os.cpu_count() or 1
        self._temp = tempfile.mkdtemp(prefix="pjrt-ray-", dir="/tmp")  # short: Ray's sockets
        self.address = f"{LOOPBACK}:{_free_port()}"
        self.processes: list[subprocess.Popen[bytes]] = []
        self._logs: dict[int, Path] = {}
        self._start_timeout = start_timeout
        self._deadline = time.monotonic() + start_timeout
        atexit.register(self.close)  # a process that exits with it open still stops it
        try:
            head = self._start(
                "head",
                "--head",
                f"--port={self.address.rpartition(':')[2]}",
                "--num-cpus=0",
                "--include-dashboard=false",
                f"--temp-dir={self._temp}",
            )
            self._await_port(head)
            self._await_started(head)
            for index, options in enumerate(nodes):
                self.add_node(index, **options)
        except BaseException:
            self.close()
            raise

    def add_node(
        self, index: int, cpus: int | None = None, resources: Mapping[str, float] | None = None
    ) -> subprocess.Popen[bytes]:
        """Starts one more worker node and waits until it has joined (its log: node-INDEX.log
        in the cluster's directory). One that gives up as it starts (Ray allows a raylet 30 s
        to register, which a busy machine can take) is started again, until the deadline."""
        arguments = [f"--address={self.address}", f"--num-cpus={cpus or self._cpus}"]
        if resources:
            arguments.append(f"--resources={json.dumps(dict(resources))}")
        while True:
            process = self._start(f"node-{index}", *arguments)
            try:
                self._await_started(process)
                return process
            except _NodeGaveUpError:
                self.processes.remove(process)
                with contextlib.suppress(ProcessLookupError):  # what it started of its node
                    os.killpg(process.pid, signal.SIGKILL)
                self._check_deadline()

    def _start(self, name: str, *arguments: str) -> subprocess.Popen[bytes]:
        command = [
            *_ray_command(),
            "start",
            "--block",
            f"--node-ip-address={LOOPBACK}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            *_QUIET,
            *_FREE_PORTS,
            *arguments,
        ]
        path = Path(self._temp, f"{name}.log")
        with open(path, "wb") as log:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its node's processes are this session's: close ends it
                # Ray's sockets live under its temporary directory, whose paths must be short
                # (108 bytes at most): every node's is the cluster's own.
                env={**os.environ, "TMPDIR": self._temp, "RAY_TMPDIR": self._temp},
            )
        self.processes.append(process)
        self._logs[process.pid] = path
        return process

    def log(self, process: subprocess.Popen[bytes]) -> str:
        """A node's log (what its `ray start` printed)."""
        with contextlib.suppress(OSError, KeyError):
            return self._logs[process.pid].read_text(errors="replace")
        return ""

    def _check_deadline(self) -> None:
        if time.monotonic() > self._deadline:
            raise TimeoutError(f"the local Ray cluster did not start in {self._start_timeout:g} s")

    def _await_started(self, process: subprocess.Popen[bytes]) -> None:
        """Waits until a node's `ray start` has said that its node runs (it joined); raises
        _NodeGaveUpError when it exited first."""
        while _STARTED not in self.log(process):
            if process.poll() is not None:
                raise _NodeGaveUpError(
                    f"a local Ray node exited as it started (status {process.returncode}):\n"
                    f"{self.log(process)[-3000:]}"
                )
            self._check_deadline()
            time.sleep(0.2)

    def _await_port(self, head: subprocess.Popen[bytes]) -> None:
        host, _, port = self.address.rpartition(":")
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=0.5).close()
                return
            except OSError:
                if head.poll() is not None:
                    log = self.log(head)[-3000:]
                    raise _NodeGaveUpError(f"the local Ray head exited:\n{log}") from None
                self._check_deadline()
                time.sleep(0.2)

    def kill_node(self, index: int) -> None:
        """Kills worker node `index` at once, every process of it (a machine that died)."""
        process = self.processes[index + 1]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def sessions(self) -> list[int]:
        """The session ids of the nodes' processes (each `ray start`'s pid)."""
        return [process.pid for process in self.processes]

    def close(self) -> None:
        """Stops every node, worker nodes first: interrupted, then what is left of each
        node's session killed after STOP_GRACE_SECONDS. Calling it again does nothing."""
        atexit.unregister(self.close)
        processes, self.processes = self.processes, []
        for process in reversed(processes):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGINT)  # `ray start` stops its processes
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for process in reversed(processes):
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
        for process in processes:
            with contextlib.suppress(ProcessLookupError):  # the session's last processes
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        shutil.rmtree(self._temp, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
