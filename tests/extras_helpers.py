"""Environments with only some of pjrt-pool's extras installed, made from this one.

An environment is a real virtual environment (``python -m venv``) whose
site-packages holds links to every entry of this environment's
site-packages except the packages of the extras left out: for each extra
of pyproject.toml not asked for, the distributions it names (and, for one
named with extras of its own such as ``jax[tpu]``, what those extras add:
libtpu), unless the core dependencies or an extra asked for need them, or
need what needs them (pyyaml: distributed needs it, and moto's server too).
To Python's import system a package left out is simply not installed:
``find_spec`` finds nothing, ``import`` raises ModuleNotFoundError,
importlib.metadata knows no such distribution, and a child process the
environment's interpreter starts (a pool worker) sees the same. It is what
``pip install '.[cpu,remote]'`` makes, but for the dependencies of the
extras left out, which stay (nothing of pjrt-pool imports them), and made
in a fraction of a second instead of an install's minutes.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

from conftest import REPO

_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?")
_EXTRA_MARKER = re.compile(r"extra\s*==\s*[\"']([^\"']+)[\"']")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _distributions(requirements: list[str]) -> set[str]:
    """The distributions requirements name, and what the extras they ask of those add."""
    found: set[str] = set()
    for requirement in requirements:
        match = _REQUIREMENT.match(requirement)
        if match is None:
            continue
        name, extras = _normal(match.group(1)), match.group(2)
        found.add(name)
        for extra in (extras or "").split(","):
            if extra.strip():
                found |= _added_by(name, extra.strip())
    return found


def _added_by(distribution: str, extra: str) -> set[str]:
    """What a distribution's extra adds to it (its requirements marked extra == NAME)."""
    try:
        requirements = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return set()
    marked = [r for r in requirements if (m := _EXTRA_MARKER.search(r)) and m.group(1) == extra]
    return _distributions([r.partition(";")[0] for r in marked])


def _needed(requirements: list[str]) -> set[str]:
    """The distributions requirements name, with every one those need, as installed here:
    their requirements for the extras asked of them, and the rest whatever their markers
    (a python_version marker that does not hold keeps a distribution more, never less)."""
    needed: set[str] = set()
    pending = list(requirements)
    while pending:
        requirement = pending.pop()
        match = _REQUIREMENT.match(requirement)
        if match is None:
            continue
        name = _normal(match.group(1))
        asked = {e.strip() for e in (match.group(2) or "").split(",") if e.strip()}
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: nothing of it to keep
        if name in needed and not asked:
            continue
        needed.add(name)
        for line in requires:
            marker = _EXTRA_MARKER.search(line.partition(";")[2])
            if marker is None or marker.group(1) in asked:
                pending.append(line.partition(";")[0])
    return needed


def left_out(extras: set[str]) -> set[str]:
    """The distributions an environment with only these extras of pjrt-pool lacks."""
    project = _pyproject()
    optional = project["optional-dependencies"]
    unknown = extras - set(optional)
    assert not unknown, f"pjrt-pool has no extra {sorted(unknown)}"
    asked = [requirement for extra in extras for requirement in optional[extra]]
    kept = _needed([*project["dependencies"], *asked]) | {"pjrt-pool"}
    dropped: set[str] = set()
    for extra, requirements in optional.items():
        if extra not in extras:
            dropped |= _distributions(requirements)
    return dropped - kept


def installed(extra: str) -> bool:
    """Whether every distribution an extra of pjrt-pool names is installed here."""
    for name in _distributions(_pyproject()["optional-dependencies"][extra]):
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            return False
    return True


def _entries_of(distribution: str) -> set[str]:
    """The names in site-packages that an installed distribution's files lie under."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        return set()  # not installed here either
    return {file.parts[0] for file in files if file.parts and file.parts[0] != ".."}


def make_environment(place: Path, extras: set[str]) -> Path:
    """Makes a virtual environment at place with only these extras (see the module
    docstring); returns its bin directory, which holds python and pjrt-pool."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(place)], check=True)
    site = Path(sysconfig.get_paths()["purelib"])
    relative = site.relative_to(sys.prefix)
    target = place / relative
    dropped = left_out(extras)
    hidden = {entry for name in dropped for entry in _entries_of(name)}
    for distribution in importlib.metadata.distributions():  # folders they share stay
        if _normal(distribution.metadata["Name"] or "") not in dropped:
            hidden -= {f.parts[0] for f in distribution.files or [] if f.parts}
    for entry in site.iterdir():
        if entry.name not in hidden:
            (target / entry.name).symlink_to(entry)
    bin_dir = place / "bin"
    script = bin_dir / "pjrt-pool"
    script.write_text(
        f"#!{bin_dir / 'python'}\nimport sys\nfrom pool.cli.main import main\nsys.exit(main())\n"
    )
    script.chmod(0o755)
    return bin_dir


def environment_variables(bin_dir: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's variables for a child in the environment of bin_dir (first on PATH;
    the repository on PYTHONPATH, as the tests' children have it), with env added."""
    variables = dict(os.environ)
    variables["PATH"] = os.pathsep.join([str(bin_dir), variables.get("PATH", "")])
    variables["PYTHONPATH"] = str(REPO)
    variables.pop("VIRTUAL_ENV", None)
    variables.update(env or {})
    return variables
