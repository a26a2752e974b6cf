"""Manifests: what `pjrt-pool warm` put in the cache, for jobs that run it later.

A manifest is JSON::

    {"format": 1, "platform": "cpu", "cache_dir": "...", "created": 1700000000.0,
     "programs": [<ProgramSpec.to_json()>, ...]}

with ``"partial": true`` added when the warm that wrote it did not warm every
program of its spec (a Ctrl-C or SIGTERM stopped it, or programs failed), and
then ``"missing": {name: why, ...}``, the programs it leaves out and what
happened to each ("lowering error: ...", "interrupted").

load_manifest() reads one, or a bundle (``pjrt-pool bundle create``:
worker.bundle), which carries the executables themselves; Manifest.run(name,
arguments) runs a program by name from the warm cache or the bundle, in this
process or through a Pool, whose workers load it as this process would,
without JAX and without lowering or compiling anything. Run from a bundle,
no cache directory is needed (nor made) and only the programs that run are
read.

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
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from worker.bundle.container import looks_like_archive
from worker.bundle.urls import is_url, shown
from worker.errors import BundleError, PjrtPoolError
from worker.identity.keys import InvalidKeyError, check_key
from worker.records import ProgramSpec
from worker.untrusted import parse_json, read_file

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    from worker.bundle.reader import Bundle
    from worker.cache.remote.transfer import TransferReport
    from worker.compile.executable import Executable

MANIFEST_FORMAT = 1
MAX_MANIFEST_SIZE = 256 << 20
"""Bytes a manifest may have (one of 10,000 programs is a few MB)."""


class SpecRunner(Protocol):
    """What Manifest.run runs a program through: a Pool or a ClusterPool (named by what they
    do, not imported, since the Pool imports this module to start loaded)."""

    def submit_spec(self, spec: ProgramSpec, arguments: Any, /, *, bundle: str | None) -> Any:
        """Runs the executable a spec names, from the cache or (bundle: its path or URL) a
        bundle; returns a future whose result() is the outputs."""
        ...


class ManifestError(PjrtPoolError, ValueError):
    """A manifest file is missing, malformed, or lacks the program asked for."""


class BundleRefusedError(ManifestError):
    """load_manifest refused a bundle as it opened it: damaged (cut short, added to, a member
    changed), changed after it was made, signed otherwise, or unreadable at its URL. The
    message says which; the command line exits 1 for it, as bundle check does."""


class Manifest:
    """The programs of a warm run, by name, and where their executables are: a cache or a bundle.

    For a bundle whose programs have entries built for several environments,
    a program's spec names its first entry until the program is loaded, and
    from then on the entry that was loaded: the one built for this
    process's plugin and host.
    """

    def __init__(
        self,
        specs: Iterable[ProgramSpec],
        cache_dir: str | None = None,
        platform: str | None = None,
        bundle: Bundle | None = None,
        *,
        prime: bool = False,
        remote: str | Literal[False] | None = None,
        partial: bool = False,
        missing: dict[str, str] | None = None,
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
        self.bundle = bundle
        """The bundle the executables come from, or None: the cache directory."""
        self.remote = remote
        """The remote cache tier a program the cache lacks is fetched from: its URL, None
        (PJRT_POOL_CACHE_REMOTE) or False (none); unused for a bundle."""
        self.partial = partial
        """Whether the warm that wrote it did not warm every program of its spec (it was
        interrupted, or programs failed): the manifest names the programs that were warmed
        ("partial": true in the file)."""
        self.missing: dict[str, str] = dict(missing or {})
        """For a partial manifest, the programs of the spec it leaves out, each with what
        happened to it ("compile error: ...", "interrupted"), as far as its warm said."""
        self.prime_on_load = prime
        """Whether each program is primed (run twice on zeros) as it loads (Executable.prime),
        so that its first real run is at the warm speed."""
        self._executables: dict[str, Executable] = {}
        self._primed: dict[str, bool] = {}  # whether its priming run ran, once tried
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
        """Loads (once) a program's executable from the disk cache or bundle into this process.

        From a cache, an entry the cache lacks is fetched from the remote tier
        (self.remote) and published into the cache, as load_cached_executable
        does. Raises ManifestError for an unknown name, NotInCacheError when
        there is no usable entry for this plugin and host (saying how the
        entries found differ), and BundleError for a bundle entry changed
        since it was made.
        """
        with self._lock:
            executable = self._executables.get(name)
            if executable is None:
                spec = self.spec(name)
                # Imported here: a manifest's run needs none of the bundle's
                # modules, nor a bundle's the cache's store and locks.
                if self.bundle is not None:
                    from worker.bundle.loading import load_from_bundle

                    executable, self.specs[name] = load_from_bundle(self.bundle, name)
                else:
                    from worker.compile.by_key import load_cached_executable

                    executable = load_cached_executable(
                        spec.key, self.cache_dir, remote=self.remote, platform=spec.platform
                    )
                if self.prime_on_load:
                    self._primed[name] = executable.prime()
                self._executables[name] = executable
            return executable

    def prime(self, names: Iterable[str] | None = None) -> list[str]:
        """Loads programs (default: all) into this process and primes each once; returns
        the names whose priming run ran.

        Priming runs a program twice on zeros of its input types
        (Executable.prime says which programs it skips, and what a program
        can notice of it). Raises what executable() raises, for the first
        program that does not load.
        """
        ran = []
        for name in self.names if names is None else list(names):
            executable = self.executable(name)
            with self._lock:
                if name not in self._primed:
                    self._primed[name] = executable.prime()
                if self._primed[name]:
                    ran.append(name)
        return ran

    def prefetch(
        self, remote: str | None = None, *, concurrency: int | None = None
    ) -> TransferReport:
        """Fetches the programs' entries that the cache directory lacks from the remote tier.

        remote is its URL (default: the manifest's remote, else
        PJRT_POOL_CACHE_REMOTE). The entries are
        fetched concurrently (concurrency at once; default
        PJRT_POOL_CACHE_REMOTE_CONCURRENCY, else 16), each verified as a
        single remote lookup verifies it, and published into the cache;
        entries already there are not fetched. Returns each key's outcome
        (worker.cache.remote.transfer): an object that fails a check, a
        missing one or a failing remote is an outcome, not an exception.
        Raises ManifestError for a bundle or when no remote is named.
        """
        if self.bundle is not None:
            raise ManifestError("a bundle carries its executables: there is nothing to prefetch")
        # Here: a manifest's runs need neither the remote tier nor the cache's store.
        from worker.cache.open_caches import open_cache
        from worker.cache.remote import open_remote, prefetch

        tier = open_remote(self.remote if remote is None else remote)
        if tier is None:
            raise ManifestError(
                "no remote cache to prefetch from: pass its URL, or set PJRT_POOL_CACHE_REMOTE"
            )
        keys = [spec.key for spec in self.specs.values()]
        return prefetch(tier, open_cache(self.cache_dir), keys, concurrency=concurrency)

    def run(
        self, name: str, arguments: Sequence[ArrayLike], pool: SpecRunner | None = None
    ) -> list[np.ndarray]:
        """Runs a program by name: through `pool` (a Pool, or a ClusterPool, whose nodes
        each run it in their Pool) if given, else in this process.

        A pool's workers load the program as this process would: from their
        cache directory, or from the bundle, read-only (each the entry built
        for its plugin and host; a ClusterPool's nodes open the bundle at the
        same path, or URL: one each node can read).
        """
        if pool is not None:
            source = None if self.bundle is None else self.bundle.source
            return pool.submit_spec(self.spec(name), arguments, bundle=source).result()
        return self.executable(name).run(arguments)

    def to_json(self) -> dict[str, Any]:
        """Returns the manifest as a JSON-ready dict."""
        data = {
            "format": MANIFEST_FORMAT,
            "platform": self.platform,
            "cache_dir": self.cache_dir,
            "created": time.time(),
            "programs": [spec.to_json() for spec in self.specs.values()],
        }
        if self.partial:  # only then: complete manifests stay as they were
            data["partial"] = True
            data["missing"] = self.missing
        return data

    def write(self, path: str | os.PathLike[str]) -> None:
        """Writes the manifest atomically (readers see the old file or the new one)."""
        from worker.cache.atomic import write_atomically  # writers only

        data = json.dumps(self.to_json(), indent=2, sort_keys=True).encode()
        write_atomically(Path(path), data, mode=0o644)


def is_bundle(path: str | os.PathLike[str]) -> bool:
    """Whether load_manifest takes path for a bundle (a URL, or a tar file) or a manifest."""
    return is_url(path) or looks_like_archive(path)


def kind_of(path: str | os.PathLike[str]) -> str:
    """What a path given as a manifest or a bundle is, for messages: "bundle" for a bundle,
    and for a file that is missing (or cannot be read) but is named like one (*.bundle);
    else "manifest"."""
    if is_bundle(path) or (not os.path.isfile(path) and os.fspath(path).endswith(".bundle")):
        return "bundle"
    return "manifest"


def does_not_exist(path: str | os.PathLike[str]) -> str:
    """What to say of a manifest or bundle that does not exist, and where one comes from."""
    if kind_of(path) == "bundle":
        return (
            f"bundle {os.fspath(path)} does not exist: check the path, or make the bundle "
            "with pjrt-pool bundle create"
        )
    return (
        f"manifest {os.fspath(path)} does not exist: check the path, or write the manifest "
        "with pjrt-pool warm --manifest"
    )


def load_manifest(
    path: str | os.PathLike[str],
    cache_dir: str | None = None,
    *,
    prime: bool = False,
    remote: str | Literal[False] | None = None,
) -> Manifest:
    """Reads a manifest, or opens a bundle; cache_dir overrides the directory a manifest records.

    remote is the remote cache tier behind the cache (Manifest.remote): a
    URL, None for PJRT_POOL_CACHE_REMOTE, or False for none; a URL the tier
    cannot use raises ValueError (TypeError for what is no URL). A bundle
    carries its executables: it takes no cache directory and no remote URL.

    With prime, each program is primed (run twice on zeros) as it loads (Manifest.prime_on_load),
    so that its first real run is at the warm speed; programs still load when
    first used, or all at once with Manifest.prime().

    A bundle is checked as it opens (worker.bundle.reader): one that was
    changed after it was made, is damaged or is not a bundle raises
    ManifestError saying what is wrong. A URL (s3://, gs://, az://, file://,
    http(s)://) names a bundle, read by ranges: its index as it opens, then
    only the entries of the programs that run (worker.bundle.remote).
    """
    if remote is not None:
        from pool.remote_option import check_remote  # only then: it imports the tier's location

        remote = check_remote(remote)
    if is_bundle(path):
        return _open_bundle(path, cache_dir, prime, remote)
    try:
        data = parse_json(read_file(path, MAX_MANIFEST_SIZE, follow_symlinks=True, what="manifest"))
    except FileNotFoundError:
        raise ManifestError(does_not_exist(path)) from None
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
    directory = cache_dir or data.get("cache_dir")
    partial = data.get("partial") is True
    missing = data.get("missing")
    if not isinstance(missing, dict) or not all(
        isinstance(name, str) and isinstance(why, str) for name, why in missing.items()
    ):
        missing = None  # what it leaves out, for messages only: unreadable, unsaid
    return Manifest(
        specs,
        directory,
        data.get("platform"),
        prime=prime,
        remote=remote,
        partial=partial,
        missing=missing,
    )


def _open_bundle(
    path: str | os.PathLike[str],
    cache_dir: str | None,
    prime: bool,
    remote: str | Literal[False] | None,
) -> Manifest:
    if cache_dir is not None or remote:
        what = "the cache directory" if cache_dir is not None else "the remote cache"
        raise ManifestError(
            f"{shown(path)} is a bundle, which carries its executables: leave {what} out, or "
            "import the bundle into a cache (pjrt-pool bundle import) and use a manifest"
        )
    from worker.bundle.reader import Bundle

    try:
        bundle = Bundle(path)
    except BundleError as error:
        raise BundleRefusedError(str(error)) from None
    programs = list(bundle.index.programs.values())
    specs = [program.spec(program.keys[0]) for program in programs]
    return Manifest(specs, None, programs[0].platform if programs else None, bundle, prime=prime)
