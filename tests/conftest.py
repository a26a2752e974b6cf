"""Shared fixtures: an isolated cache directory per test, and child Python processes.

The test process loads one plugin (the default CPU plugin) the first time a
test compiles; tests that need another plugin, or a fresh process, run code
in a child with run_python.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from remote_helpers import FaultProxy, Remote

REPO = Path(__file__).resolve().parent.parent

# Tests of Ctrl-C send real SIGINTs, here and in children. A shell that starts
# the suite as a background job hands it SIGINT ignored, and Python then keeps
# it ignored: give it Python's own handler, which children inherit as the
# default (a handler is reset at exec, an ignored signal stays ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
JAX_CPU_DEVICES = 8
"""The devices of this process's JAX CPU backend: programs over several devices
(tests/test_sharding.py) are compared with jax.jit over as many. Set before any test starts
JAX's backends, through JAX's config, not XLA_FLAGS, which worker processes would inherit
(and key: worker.identity.environment). Programs of one device run on the first."""


def _set_jax_cpu_devices() -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", JAX_CPU_DEVICES)


_set_jax_cpu_devices()


def _package_dir(package: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:  # its parent package is not installed (only pytest is, say)
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


_second = _package_dir("xla_plugins.xla_cpu_pjrt")
SECOND_PLUGIN = str(_second / "xla_cpu_pjrt.so") if _second else None
"""The xla-cpu-pjrt plugin (PJRT API 0.81, StableHLO 1.13.3): the test extra installs it."""

_default = _package_dir("lammps_jax_pjrt_cpu")
DEFAULT_PLUGIN = str(_default / "pjrt_c_api_cpu_plugin.so") if _default else None
"""The default CPU plugin, lammps-jax-pjrt-cpu (PJRT API 0.115)."""


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Points PJRT_POOL_CACHE_DIR at a fresh directory for each test."""
    directory = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("PJRT_POOL_CACHE_DIR", str(directory))
    return directory


CLI_COMMAND = (sys.executable, "-c", "import sys; from pool.cli.main import main; sys.exit(main())")
"""The installed console script's code (pool.cli.main), run in a child."""


def repo_environment(
    env: dict[str, str] | None = None, *, empty_unsets: bool = True
) -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH, and env added to
    it: a value of "" removes the variable (or, empty_unsets=False, sets it empty)."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), environment.get("PYTHONPATH", "")) if p
    )
    environment.update(env or {})
    if empty_unsets:
        environment = {name: value for name, value in environment.items() if value != ""}
    return environment


def pjrt_pool(
    *args: str,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Runs the command line (CLI_COMMAND) in a child process, as the console script does.

    env adds to (or, with a value of "", removes from) this process's environment.
    """
    command, environment = [*CLI_COMMAND, *args], repo_environment(env)
    return subprocess.run(  # its exit status is the caller's to check
        command, capture_output=True, text=True, timeout=timeout, env=environment, cwd=cwd
    )


def run_tool(
    name: str, *args: str, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs tools/NAME with args in a child (this environment plus env, the repository first
    on PYTHONPATH); its exit status is the caller's to check."""
    command = [sys.executable, str(REPO / "tools" / name), *args]
    environment = repo_environment(env, empty_unsets=False)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)


def load_tool(name: str) -> ModuleType:
    """Imports tools/NAME.py from its path (tools/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def printed(done: subprocess.CompletedProcess[str], *texts: str) -> None:
    """Asserts that a child printed each of texts (each somewhere in its stdout)."""
    for text in texts:
        assert text in done.stdout, done.stdout


def run_python(
    code: str,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Runs Python code in a fresh interpreter (with this environment plus `env`)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=repo_environment(env, empty_unsets=False),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"child failed with {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n"
            f"{done.stderr[-4000:]}"
        )
    return done


@pytest.fixture(scope="session")
def ffi_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test FFI handler library (tests/ffi/handlers.cc), built once per session.

    It exports the typed XLA FFI handlers ``add_one`` (f32 in, in + 1 out) and
    ``null_deref`` (crashes with SIGSEGV when run).
    """
    from ffi.build import build_handlers

    return build_handlers(tmp_path_factory.mktemp("ffi"))


@pytest.fixture(scope="session")
def handlers(ffi_library: Path) -> str:
    """The test FFI handler library's path as a str, for pool_helpers.handler_initializer."""
    return str(ffi_library)


def child(body: str, handlers: str = "", timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Runs a pool scenario in a fresh interpreter with the test helpers importable.

    The scenario has `handlers` (the FFI test library's path), the names of
    pool_helpers and of pool in scope; a hang fails the test after `timeout`
    seconds instead of hanging the suite.
    """
    prelude = f"""
        import os, signal, sys, threading, time
        import numpy as np
        sys.path.insert(0, {str(REPO / "tests")!r})
        from pool_helpers import *
        from pool import *
        handlers = {handlers!r}
    """
    return run_python(textwrap.dedent(prelude) + textwrap.dedent(body), timeout=timeout)


# The remote tier's servers (remote_helpers.py holds the classes).


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on the loopback at a random port, for this module."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(params=["s3", "file"])
def remote(request, tmp_path, monkeypatch) -> Remote:
    """A fresh, empty remote: a bucket on the moto server, or a directory."""
    from remote_helpers import S3_ENV, Remote

    if request.param == "file":
        root = tmp_path / "remote"
        return Remote(f"file://{root}/fleet", {}, root / "fleet")
    import boto3

    endpoint = request.getfixturevalue("s3_endpoint")
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    bucket = f"fleet-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket=bucket)
    env = {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}
    return Remote(f"s3://{bucket}/fleet", env, None, s3, bucket)


@pytest.fixture
def s3_proxy(s3_endpoint, monkeypatch) -> Iterator[tuple[FaultProxy, Remote]]:
    """A fresh bucket on the moto server, reached through a FaultProxy."""
    import boto3
    from remote_helpers import S3_ENV, FaultProxy, Remote

    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    bucket = f"fleet-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket=bucket)
    proxy = FaultProxy(s3_endpoint)
    env = {**S3_ENV, "AWS_ENDPOINT_URL": proxy.url}
    yield proxy, Remote(f"s3://{bucket}/fleet", env, None, s3, bucket)
    proxy.close()
