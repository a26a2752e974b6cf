"""Every command on a machine that is not set up for it: one line on stderr, exit 2 (issue 42).

A table of bad environments (a plugin variable naming a file that is not a
plugin, garbage, or nothing; no plugin installed; a cache directory anyone can
write, or that is a file; a manifest and a bundle that cannot be read) against
every command: each cell runs the real `pjrt-pool` in a child process and
expects the documented exit status with one line on stderr that names what
is wrong and what to do, and no traceback. Cells a bad environment does not
touch (a cache command and the plugin, a bundle run and the cache) are not
run: they are the commands' own tests.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import os
import shutil
from pathlib import Path

import pytest
from conftest import REPO, pjrt_pool

TINY_SPEC = """
import jax, jax.numpy as jnp

def programs():
    return [("add", lambda a, b: a + b, [jax.ShapeDtypeStruct((4,), jnp.float32)] * 2)]
"""

# Each command as a user types it; SPEC, MANIFEST, BUNDLE, OUT and REMOTE stand for
# the files of the `made` fixture (the manifest records no cache directory: the
# environment's PJRT_POOL_CACHE_DIR is the cache, as for the cache commands).
COMMANDS = {
    "warm": ["warm", "SPEC"],
    "run": ["run", "MANIFEST", "add"],
    "run --workers 1": ["run", "MANIFEST", "add", "--workers", "1"],
    "run a bundle": ["run", "BUNDLE", "add"],
    "bundle create": ["bundle", "create", "MANIFEST", "-o", "OUT"],
    "bundle merge": ["bundle", "merge", "BUNDLE", "-o", "OUT"],
    "bundle import": ["bundle", "import", "BUNDLE", "--manifest", "OUT"],
    "bundle check (bundle)": ["bundle", "check", "BUNDLE"],
    "bundle check (manifest)": ["bundle", "check", "MANIFEST"],
    "check-plugin": ["check-plugin", "--cases", "elementwise/sin/float32/n7", "--workers", "1"],
    "cache info": ["cache", "info"],
    "cache list": ["cache", "list"],
    "cache verify": ["cache", "verify"],
    "cache verify --load": ["cache", "verify", "--load"],
    "cache prune": ["cache", "prune", "--max-size", "1G"],
    "cache clear": ["cache", "clear", "--yes"],
    "cache push": ["cache", "push", "--remote", "REMOTE"],
    "cache pull": ["cache", "pull", "--remote", "REMOTE"],
}

PLUGIN = {"run", "run --workers 1", "run a bundle", "bundle import", "check-plugin"}
PLUGIN |= {"warm", "bundle check (bundle)", "bundle check (manifest)", "cache verify --load"}
"""The commands that load the plugin."""
CACHE = set(COMMANDS) - {"run a bundle", "bundle merge", "bundle check (bundle)"}
"""The commands that use the cache directory."""
FILES = {name for name, words in COMMANDS.items() if {"MANIFEST", "BUNDLE"} & set(words)}
"""The commands that read the manifest or the bundle."""

# Each bad environment: the commands it touches, and what the one line must say.
ENVIRONMENTS = {
    "plugin variable names a library that is not a plugin": (
        PLUGIN,
        ["is not a PJRT plugin", "PJRT_POOL_PLUGIN_CPU"],
    ),
    "plugin variable names a garbage file": (
        PLUGIN,
        ["cannot load PJRT plugin", "PJRT_POOL_PLUGIN_CPU"],
    ),
    "plugin variable names a missing file": (
        PLUGIN,
        ["does not name a file", "PJRT_POOL_PLUGIN_CPU"],
    ),
    # The cpu platform runs on jaxlib's own client, which pjrt-pool's jax brings: a CPU
    # plugin is missing for the platform that needs one, pjrt_cpu, as the default platform.
    # The commands that take the default platform (not a manifest's) meet it.
    "no plugin installed": (
        {"warm", "check-plugin"},
        ["no PJRT plugin found for platform 'pjrt_cpu'", "[cpu]'", "PJRT_POOL_PLUGIN_PJRT_CPU"],
    ),
    "cache directory anyone can write": (CACHE, ["mode 0777", "chmod o-w"]),
    "cache directory is a file": (CACHE, ["is a file, not a directory", "name a directory"]),
    "manifest and bundle cannot be read": (FILES, ["cannot be read (Not a directory)"]),
}

CELLS = [
    pytest.param(command, environment, id=f"{command} / {environment}")
    for environment, (touched, _) in ENVIRONMENTS.items()
    for command in COMMANDS
    if command in touched
]


def library_that_is_not_a_plugin() -> str:
    """The path of a real shared library that exports no GetPjrtApi: zlib, as this process
    has it mapped (else numpy's core extension, a shared object too)."""
    name = ctypes.util.find_library("z")
    if name is not None:
        ctypes.CDLL(name)
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1]
            if os.path.basename(path).startswith("libz.so"):
                return path
    import numpy

    return str(next(Path(numpy.__file__).parent.glob("_core/_multiarray_umath*.so")))


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A warmed cache, its manifest (recording no cache directory), a bundle, a remote."""
    directory = tmp_path_factory.mktemp("made")
    spec, cache = directory / "spec.py", directory / "cache"
    manifest, bundle = directory / "m.json", directory / "b.bundle"
    spec.write_text(TINY_SPEC)
    environment = {"PJRT_POOL_CACHE_DIR": str(cache)}
    done = pjrt_pool("warm", str(spec), "--manifest", str(manifest), env=environment)
    assert done.returncode == 0, done.stderr
    done = pjrt_pool("bundle", "create", str(manifest), "-o", str(bundle), env=environment)
    assert done.returncode == 0, done.stderr
    (directory / "remote").mkdir()
    return {"spec": spec, "cache": cache, "manifest": manifest, "bundle": bundle}


def bad_environment(
    environment: str, made: dict[str, Path], place: Path
) -> tuple[dict[str, str], dict[str, str]]:
    """The variables of a bad environment, and the files the command names in it."""
    cache = place / "cache"
    shutil.copytree(made["cache"], cache)  # a good cache, unless the environment spoils it
    variables = {"PJRT_POOL_CACHE_DIR": str(cache), "PJRT_POOL_PLUGIN_CPU": ""}
    files = {
        "SPEC": str(made["spec"]),
        "MANIFEST": str(made["manifest"]),
        "BUNDLE": str(made["bundle"]),
        "OUT": str(place / "out"),
        "REMOTE": (place / "remote").as_uri(),
    }
    (place / "remote").mkdir()
    if environment == "plugin variable names a library that is not a plugin":
        variables["PJRT_POOL_PLUGIN_CPU"] = library_that_is_not_a_plugin()
    elif environment == "plugin variable names a garbage file":
        garbage = place / "garbage.so"
        garbage.write_bytes(os.urandom(4096))
        variables["PJRT_POOL_PLUGIN_CPU"] = str(garbage)
    elif environment == "plugin variable names a missing file":
        variables["PJRT_POOL_PLUGIN_CPU"] = str(place / "no" / "plugin.so")
    elif environment == "no plugin installed":
        # Both CPU plugin packages shadowed by packages without their libraries.
        for package in ("lammps_jax_pjrt_cpu", "xla_plugins/xla_cpu_pjrt"):
            (place / "shadow" / package).mkdir(parents=True)
            (place / "shadow" / package / "__init__.py").write_text("")
        (place / "shadow" / "xla_plugins" / "__init__.py").write_text("")
        variables["PYTHONPATH"] = os.pathsep.join([str(place / "shadow"), str(REPO)])
        variables["PJRT_POOL_PLATFORM"] = "pjrt_cpu"
    elif environment == "cache directory anyone can write":
        cache.chmod(0o777)
    elif environment == "cache directory is a file":
        shutil.rmtree(cache)
        cache.write_text("not a cache")
    elif environment == "manifest and bundle cannot be read":
        regular = place / "a-file"
        regular.write_text("not a directory")
        files["MANIFEST"], files["BUNDLE"] = str(regular / "m.json"), str(regular / "b.bundle")
    return variables, files


@pytest.mark.parametrize(("command", "environment"), CELLS)
def test_every_command_says_what_is_wrong_with_the_environment_in_one_line(
    command: str, environment: str, made: dict[str, Path], tmp_path: Path
) -> None:
    variables, files = bad_environment(environment, made, tmp_path)
    words = [files.get(word, word) for word in COMMANDS[command]]
    done = pjrt_pool(*words, env=variables, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    named = itertools.takewhile(lambda w: w.islower() and w[0] != "-", COMMANDS[command])
    assert lines[0].startswith(" ".join(["pjrt-pool", *named]) + ": "), lines[0]
    for fragment in ENVIRONMENTS[environment][1]:
        assert fragment in lines[0], lines[0]
    assert not (tmp_path / "out").exists()  # nothing written on the way
