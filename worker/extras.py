"""pjrt-pool's optional extras: which feature needs which package, and where to install it from.

Runs in every process that may use a feature behind an extra: the parent, a
pool worker, a Dask or Ray node. Each Feature names the package it imports and the
extra of pjrt-pool that installs it; ``require`` checks that the package is
there (without importing it) and ``import_for`` imports it, each raising
MissingExtraError, an ImportError, when it is not: one line naming the
feature, the package, the extra and the pip command that installs it.

No package index serves pjrt-pool, so that command installs the extra from
where this pjrt-pool came from (``install_extra_command``): the checkout or
the wheel its installed distribution's direct_url.json (PEP 610) records, or
the source tree this module runs from. The plugins, also extras (cpu, cuda12,
cuda13, tpu), are found by worker.plugin.locate, whose PluginNotFoundError
names their extras with the same command.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

from worker.errors import MissingExtraError


class _Needs(NamedTuple):
    module: str  # the top-level module the feature imports
    extra: str  # the pjrt-pool extra that installs it
    what: str  # the feature, as a message names it


class Feature(enum.Enum):
    """A feature behind one of pjrt-pool's extras: the package it needs, and the extra."""

    CLUSTER = _Needs("distributed", "cluster", "compiling and running on a Dask cluster")
    RAY = _Needs("ray", "ray", "compiling and running on a Ray cluster")
    ED25519 = _Needs(
        "cryptography",
        "remote",
        "signing or verifying remote records with Ed25519 (PJRT_POOL_CACHE_PRIVATE_KEY_FILE, "
        "PJRT_POOL_CACHE_PUBLIC_KEY)",
    )
    S3 = _Needs("obstore", "s3", "a remote cache or bundle at an s3:// URL")
    GCS = _Needs("obstore", "gcs", "a remote cache or bundle at a gs:// URL")
    AZURE = _Needs("obstore", "azure", "a remote cache or bundle at an az:// URL")
    HTTP = _Needs("obstore", "remote", "a remote cache or bundle at an http(s):// URL")

    @property
    def module(self) -> str:
        """The top-level module the feature imports."""
        return self.value.module

    @property
    def extra(self) -> str:
        """The pjrt-pool extra that installs the module."""
        return self.value.extra

    def missing(self) -> MissingExtraError:
        """The error saying that this feature's package is not installed, and how to install it."""
        command = install_extra_command(self.extra)
        return MissingExtraError(
            f"{self.value.what} needs the {self.module} package, which pjrt-pool's "
            f"{self.extra} extra installs: {command}",
            name=self.module,
            extra=self.extra,
            install=command,
        )


STORE_FEATURES = {"s3": Feature.S3, "gs": Feature.GCS, "az": Feature.AZURE}
"""The feature a remote URL's scheme needs (worker.cache.remote.location's schemes): obstore's
stores; http and https are Feature.HTTP, and file:// needs no package."""


def require(feature: Feature) -> None:
    """Raises MissingExtraError unless the feature's package can be imported; imports nothing."""
    if importlib.util.find_spec(feature.module) is None:
        raise feature.missing()


def import_for(feature: Feature, module: str | None = None) -> ModuleType:
    """Imports `module` (default: the feature's package); MissingExtraError if the package is
    not installed. A module the package itself imports and cannot find (a broken install)
    keeps its own ModuleNotFoundError, which names it."""
    try:
        return importlib.import_module(module or feature.module)
    except ModuleNotFoundError as error:
        if error.name is None or error.name.partition(".")[0] != feature.module:
            raise
        raise feature.missing() from None


def install_extra_command(extra: str) -> str:
    """The pip command that installs one of pjrt-pool's extras, from where pjrt-pool came from.

    No package index serves pjrt-pool: the extra is installed from the
    checkout or the wheel that pjrt-pool was installed from, as the
    installed distribution's direct_url.json (PEP 610) records it (an
    editable checkout: ``pip install -e '/path/to/checkout[extra]'``; a
    wheel: ``pip install '/path/to/pjrt_pool-….whl[extra]'``; a VCS or URL:
    a requirement naming it), or from the source tree this module runs
    from. Otherwise the command says to fill in the checkout or wheel.
    """
    import shlex  # here: only a message needs it, and a worker starts without it

    source = installed_from()
    if source is None:
        return f"pip install '<the checkout or wheel pjrt-pool came from>[{extra}]'"
    if source.url:  # a URL pip fetches: a requirement that names it
        return f"pip install {shlex.quote(f'pjrt-pool[{extra}] @ {source.url}')}"
    editable = "-e " if source.editable else ""
    return f"pip install {editable}{shlex.quote(f'{source.path}[{extra}]')}"


class Source(NamedTuple):
    """Where pjrt-pool was installed from: a local path (a checkout, a wheel), or a URL."""

    path: str = ""
    url: str = ""
    editable: bool = False

    def describe(self) -> str:
        """Where it came from, for people: the path or URL, and "editable" for an editable
        install."""
        return (self.url or self.path) + (" (editable)" if self.editable else "")


def installed_from() -> Source | None:
    """Where pjrt-pool was installed from, as its installed distribution records it; the
    source tree this module runs from when it is not installed; None when nothing says."""
    # Here: only a message needs them, and a worker starts without them.
    import json
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    try:
        recorded = metadata.distribution("pjrt-pool").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        # Not installed, run from a source tree on the path: that tree is the source.
        root = Path(__file__).resolve().parents[1]
        return Source(str(root)) if (root / "pyproject.toml").is_file() else None
    try:
        direct = json.loads(recorded) if recorded else None
    except ValueError:
        return None
    if not isinstance(direct, dict) or not isinstance(direct.get("url"), str):
        return None  # from an index, or by a tool that records nothing
    url, vcs = direct["url"], direct.get("vcs_info")
    if isinstance(vcs, dict) and isinstance(vcs.get("vcs"), str):
        commit = vcs.get("commit_id")
        return Source(url=f"{vcs['vcs']}+{url}" + (f"@{commit}" if isinstance(commit, str) else ""))
    parsed = urlparse(url)
    if parsed.scheme != "file":
        return Source(url=url)
    dir_info = direct.get("dir_info")
    editable = isinstance(dir_info, dict) and dir_info.get("editable") is True
    return Source(unquote(parsed.path), editable=editable)
