"""What a Pool made with preload= has each worker load as it starts.

A Pool can start loaded: given a Manifest (load_manifest's), or the path of
a manifest or of a bundle, every worker loads the programs it names from the
pool's disk cache before it says it is ready (worker.wire.protocol.Init's
preload), so that no task for one of them waits for a load. Workers load
only from the cache directory, so a bundle's entries are imported into it
first (worker.bundle.importing: every member checked, then published), as
`pjrt-pool bundle import` does. Each program is then named by its cache key,
the key a ProgramSpec's run (Pool.submit_spec, Manifest.run) sends.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pool.manifest import Manifest, ManifestError, load_manifest
from worker.bundle.importing import import_bundle
from worker.cache import DiskCache
from worker.errors import BundleError


def preload_programs(preload: Any, names: Any, directory: Path) -> tuple[tuple[str, str], ...]:
    """The (cache key, name) of each program to preload, in the manifest's order.

    preload is None (nothing), a Manifest, or a manifest's or bundle's path
    (a bundle's URL too, as load_manifest takes it);
    names restricts it to some of its programs (None: all). A bundle, given
    either way, is imported into the pool's cache directory here.
    Raises ManifestError for a manifest that does not read, a bundle that
    does not import, or a name the manifest does not have.
    """
    if preload is None:
        if names is not None:
            raise TypeError("preload_names restricts preload=, which was not given")
        return ()
    if isinstance(preload, Manifest):
        manifest = preload
        if manifest.bundle is not None:
            _import(manifest.bundle.path, directory)
    elif isinstance(preload, (str, os.PathLike)):
        manifest = load_manifest(preload)  # a manifest, or a bundle's file or URL
        if manifest.bundle is not None:
            _import(preload, directory)
    else:
        raise TypeError(
            "preload must be a Manifest or the path of a manifest or bundle, "
            f"not {type(preload).__name__} {preload!r:.80}"
        )
    if names is None:
        chosen = manifest.names
    elif isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise TypeError(f"preload_names must be a list of program names, not {names!r:.80}")
    else:
        chosen = list(dict.fromkeys(names))
    return tuple((manifest.spec(name).key, name) for name in chosen)


def _import(path: str | os.PathLike[str], directory: Path) -> None:
    """Imports a bundle's entries into the pool's cache directory (see the module docstring)."""
    try:
        with DiskCache(directory) as cache:  # closed after: nothing kept per pool made
            import_bundle(path, cache)
    except BundleError as error:
        raise ManifestError(f"cannot preload bundle {os.fspath(path)}: {error}") from None
