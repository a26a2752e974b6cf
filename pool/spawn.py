"""How the parent starts Python processes that run worker-side modules.

Children are fresh interpreters (never forks of a parent that imported JAX)
and must import the very `worker` package the parent imported, whatever the
current directory holds: the package's parent directory goes first on
PYTHONPATH, and -P keeps the current directory off sys.path.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import worker
from worker.plugin.startup import SPAWNED_AT_ENV


def python_command(module: str, *args: str) -> list[str]:
    """Returns the command line that runs `python -m module args...` in a child."""
    return [sys.executable, "-P", "-m", module, *args]


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Returns the environment for a child: this one, with the worker package importable."""
    environment = dict(os.environ)
    package_root = str(Path(worker.__file__).resolve().parent.parent)
    paths = [package_root, *environment.get("PYTHONPATH", "").split(os.pathsep)]
    environment["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    # Lets a worker time its interpreter's start (worker.phases: spawn_to_main).
    environment[SPAWNED_AT_ENV] = repr(time.time())
    if extra:
        environment.update(extra)
    return environment
