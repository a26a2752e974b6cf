"""Manifests: what `pjrt-pool warm` put in the cache, for jobs that run it later.

A manifest is JSON::

    {"format": 1, "platform": "cpu", "cache_dir": "...", "created": 1700000000.0,
     "programs": [<ProgramSpec.to_json()>, ...]}

load_manifest() reads one; Manifest.run(name, arguments) runs a program by
name from the warm cache, in this process or through a Pool, without JAX and
without lowering or compiling anything.

A manifest may come from someone else: it is read only if it is a regular
file of at most MAX_MANIFEST_SIZE bytes and nests no deeper than JSON
records do, and each program's key must be a cache key (64 hex digits),
since it names a file in the cache. Anything else is a ManifestError.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from worker.bounded import parse_json, read_file
from worker.cache.atomic import write_atomically
from worker.cache.key import InvalidKeyError, check_key
from worker.records import ProgramSpec

if TYPE_CHECKING:
    from pool.executor.pool import Pool
    from worker.executable import Executable

MANIFEST_FORMAT = 1
MAX_MANIFEST_SIZE = 256 << 20
"""Bytes a manifest may have (one of 10,000 programs is a few MB)."""


class ManifestError(ValueError):
    """A manifest file is missing, malformed, or lacks the program asked for."""


class Manifest:
    """The programs of a warm run, by name, and where their executables are cached."""

    def __init__(
        self,
        specs: Iterable[ProgramSpec],
        cache_dir: str | None = None,
        platform: str | None = None,
    ) -> None:
        self.specs: dict[str, ProgramSpec] = {}
        for spec in specs:
            try:
                check_key(spec.key, f"the key of program {spec.name!r}")
            except InvalidKeyError as error:
                raise ManifestError(str(error)) from None
            self.specs[spec.name] = spec
        self.cache_dir = cache_dir
        self.platform = platform
        self._executables: dict[str, Executable] = {}
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        """The program names, in manifest order."""
        return list(self.specs)

    def spec(self, name: str) -> ProgramSpec:
        """Returns a program's spec; raises ManifestError naming the known programs."""
        try:
            return self.specs[name]
        except KeyError:
            known = ", ".join(sorted(self.specs)) or "none"
            raise ManifestError(f"no program {name!r} in the manifest (it has: {known})") from None

    def executable(self, name: str) -> Executable:
        """Loads (once) a program's executable from the disk cache into this process."""
        from worker.cached import load_cached_executable  # loads the plugin on first use

        with self._lock:
            executable = self._executables.get(name)
            if executable is None:
                executable = load_cached_executable(self.spec(name).key, self.cache_dir)
                self._executables[name] = executable
            return executable

    def run(
        self, name: str, arguments: Sequence[ArrayLike], pool: Pool | None = None
    ) -> list[np.ndarray]:
        """Runs a program by name: through `pool` if given, else in this process."""
        if pool is not None:
            return pool.submit_spec(self.spec(name), arguments).result()
        return self.executable(name).run(arguments)

    def to_json(self) -> dict[str, Any]:
        """Returns the manifest as a JSON-ready dict."""
        return {
            "format": MANIFEST_FORMAT,
            "platform": self.platform,
            "cache_dir": self.cache_dir,
            "created": time.time(),
            "programs": [spec.to_json() for spec in self.specs.values()],
        }

    def write(self, path: str | os.PathLike[str]) -> None:
        """Writes the manifest atomically (readers see the old file or the new one)."""
        data = json.dumps(self.to_json(), indent=2, sort_keys=True).encode()
        write_atomically(Path(path), data, mode=0o644)


def load_manifest(path: str | os.PathLike[str], cache_dir: str | None = None) -> Manifest:
    """Reads a manifest; cache_dir overrides the directory recorded in it."""
    try:
        data = parse_json(read_file(path, MAX_MANIFEST_SIZE, follow_symlinks=True, what="manifest"))
    except FileNotFoundError:
        raise ManifestError(f"manifest {path} does not exist: run pjrt-pool warm first") from None
    except (OSError, ValueError) as error:
        raise ManifestError(f"cannot read manifest {path}: {error}") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{path} is not a pjrt-pool manifest (format {MANIFEST_FORMAT})")
    try:
        specs = [ProgramSpec.from_json(item) for item in data["programs"]]
    except (KeyError, TypeError, ValueError) as error:
        raise ManifestError(f"{path}: {error}") from None
    for field in ("cache_dir", "platform"):
        if not isinstance(data.get(field), (str, type(None))):
            raise ManifestError(f"{path}: {field} must be a string, not {data[field]!r:.80}")
    return Manifest(specs, cache_dir or data.get("cache_dir"), data.get("platform"))
