"""A feature whose extra is not installed says so in one line, naming how to install it (issue 53).

Each case runs the real `pjrt-pool` (or Python) in a child process of an
environment that lacks the extras' packages: a virtual environment made of
this one less the packages of every extra but cpu (extras_helpers), where,
to Python's import system, distributed, obstore and cryptography are simply
not installed. The command must exit 2 with one line on stderr, naming the
feature, the extra and the pip command that installs it from where this
pjrt-pool came from; the API raises MissingExtraError, a
ModuleNotFoundError, with the same text.

Also here: the pip command for each way pjrt-pool can have been installed
(direct_url.json, PEP 610), and `pjrt-pool --version`.
"""

from __future__ import annotations

import json
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from conftest import REPO, pjrt_pool
from extras_helpers import environment_variables, make_environment
from install_sources import SOURCES, installed_as

import pool
from worker.extras import Feature, install_extra_command, installed_from
from worker.plugin.locate import find_plugin

TINY_SPEC = """
import jax, jax.numpy as jnp

def programs():
    return [("add", lambda a, b: a + b, [jax.ShapeDtypeStruct((4,), jnp.float32)] * 2)]
"""
PUBLIC_KEY = "ab" * 32  # a public key's form: the missing package is said before it is read


@pytest.fixture(scope="module")
def cpu_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin directory of an environment with only the cpu extra."""
    return make_environment(tmp_path_factory.mktemp("cpu-only"), {"cpu"})


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A spec, its manifest (warmed here) and a bundle."""
    directory = tmp_path_factory.mktemp("made")
    spec, manifest, bundle = directory / "spec.py", directory / "m.json", directory / "b.bundle"
    spec.write_text(TINY_SPEC)
    env = {"PJRT_POOL_CACHE_DIR": str(directory / "cache")}
    assert pjrt_pool("warm", str(spec), "--manifest", str(manifest), env=env).returncode == 0
    assert pjrt_pool("bundle", "create", str(manifest), "-o", str(bundle), env=env).returncode == 0
    return {"spec": spec, "manifest": manifest, "bundle": bundle, "dir": directory}


def in_environment(
    bin_dir: Path, *command: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs a command of the environment of bin_dir (pjrt-pool, python) in a child process."""
    return subprocess.run(
        [str(bin_dir / command[0]), *command[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment_variables(bin_dir, env),
        cwd=cwd,
        check=False,
    )


# Each command that uses a feature behind an extra, the variables it runs with (REMOTE:
# a file:// remote; the rest as named), and the extra its one line must name.
COMMANDS = {
    "warm --scheduler": (["warm", "SPEC", "--scheduler", "local:2"], {}, "cluster"),
    "run --scheduler": (["run", "MANIFEST", "add", "--scheduler", "local:2"], {}, "cluster"),
    "warm --ray": (["warm", "SPEC", "--ray", "local:2"], {}, "ray"),
    "run --ray": (["run", "MANIFEST", "add", "--ray", "127.0.0.1:6379"], {}, "ray"),
    "warm --remote s3://": (["warm", "SPEC", "--remote", "s3://bucket/prefix"], {}, "s3"),
    "warm, PJRT_POOL_CACHE_REMOTE gs://": (
        ["warm", "SPEC"],
        {"PJRT_POOL_CACHE_REMOTE": "gs://bucket/prefix"},
        "gcs",
    ),
    "cache push --remote az://": (["cache", "push", "--remote", "az://container/p"], {}, "azure"),
    "cache info --remote https://": (
        ["cache", "info", "--remote", "https://example.invalid/p"],
        {},
        "remote",
    ),
    "run of a bundle at s3://": (["run", "s3://bucket/app.bundle", "add"], {}, "s3"),
    "warm with a public key": (
        ["warm", "SPEC"],
        {"PJRT_POOL_CACHE_REMOTE": "REMOTE", "PJRT_POOL_CACHE_PUBLIC_KEY": PUBLIC_KEY},
        "remote",
    ),
    "run with a private key": (
        ["run", "MANIFEST", "add", "--remote", "REMOTE"],
        {"PJRT_POOL_CACHE_PRIVATE_KEY_FILE": "KEY"},
        "remote",
    ),
}


@pytest.mark.parametrize("case", list(COMMANDS))
def test_a_command_without_its_extra_says_how_to_install_it_in_one_line(
    case: str, cpu_only: Path, made: dict[str, Path], tmp_path: Path
) -> None:
    words, variables, extra = COMMANDS[case]
    (tmp_path / "remote").mkdir()
    key = tmp_path / "ci.pem"
    key.write_text("not read: the package is missing first\n")
    key.chmod(0o600)
    files = {
        "SPEC": str(made["spec"]),
        "MANIFEST": str(made["manifest"]),
        "REMOTE": (tmp_path / "remote").as_uri(),
        "KEY": str(key),
    }
    env = {name: files.get(value, value) for name, value in variables.items()}
    env["PJRT_POOL_CACHE_DIR"] = str(tmp_path / "cache")
    done = in_environment(cpu_only, "pjrt-pool", *(files.get(w, w) for w in words), env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"'s {extra} extra installs: {install_extra_command(extra)}" in lines[0], lines[0]
    assert lines[0].startswith(f"pjrt-pool {words[0]}"), lines[0]
    assert not (tmp_path / "cache" / "entries").exists() or not any(
        (tmp_path / "cache" / "entries").iterdir()
    )


API = """
import json, sys
from pool import MissingExtraError
try:
    {call}
except ImportError as error:  # what handlers of a missing package catch
    print(json.dumps({{"class": type(error).__name__, "module_not_found":
        isinstance(error, ModuleNotFoundError), "missing": isinstance(error, MissingExtraError),
        "name": error.name, "extra": getattr(error, "extra", None),
        "install": getattr(error, "install", None), "message": str(error)}}))
    sys.exit(0)
sys.exit("no error")
"""

CALLS = {
    "import pool.cluster.dask": ("import pool.cluster.dask", "cluster", "distributed"),
    "from pool import ClusterPool": ("from pool import ClusterPool", "cluster", "distributed"),
    "import pool.cluster.ray": ("import pool.cluster.ray", "ray", "ray"),
    "from pool import RayClusterPool": ("from pool import RayClusterPool", "ray", "ray"),
    "Pool(remote=s3://...)": (
        "from pool import Pool; Pool(1, remote='s3://bucket/p')",
        "s3",
        "obstore",
    ),
    "load_manifest of a bundle at gs://": (
        "from pool.manifest import load_manifest; load_manifest('gs://bucket/app.bundle')",
        "gcs",
        "obstore",
    ),
    "generate_private_key": (
        "from worker.cache.remote import generate_private_key; generate_private_key('k.pem')",
        "remote",
        "cryptography",
    ),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_the_api_raises_one_exception_naming_the_extra(
    case: str, cpu_only: Path, tmp_path: Path
) -> None:
    call, extra, package = CALLS[case]
    done = in_environment(cpu_only, "python", "-c", API.format(call=call), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    raised = json.loads(done.stdout)
    assert raised["class"] == "MissingExtraError" and raised["module_not_found"], raised
    assert raised["name"] == package and raised["extra"] == extra, raised
    assert raised["install"] == install_extra_command(extra), raised
    assert raised["message"].endswith(f"{extra} extra installs: {raised['install']}"), raised
    assert not (tmp_path / "k.pem").exists()  # nothing made on the way


def test_every_feature_and_its_message_is_in_the_command_line_page() -> None:
    """The closing note's table of messages is docs/cli.md's: one row per feature."""
    page = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    for feature in Feature:
        text = str(feature.missing())
        head = text[: text.index(": pip install")]
        assert f"`{feature.module}`" in page, feature
        assert head.split(", which")[1] in page or head in page, (feature, head)


# -- where pjrt-pool came from: the command that installs an extra -----------------------


@pytest.mark.parametrize("source", list(SOURCES))
def test_the_install_command_names_where_pjrt_pool_came_from(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    direct_url, command = SOURCES[source]
    monkeypatch.syspath_prepend(str(installed_as(tmp_path, direct_url)))
    assert metadata.distribution("pjrt-pool").locate_file("") == tmp_path
    assert install_extra_command("remote") == command.format(extra="remote")


# -- pjrt-pool --version --------------------------------------------------------------


def test_version_says_the_version_the_source_and_each_platform_s_plugin(cpu_only: Path) -> None:
    assert pool.__version__ == metadata.version("pjrt-pool")
    done = pjrt_pool("--version")
    assert done.returncode == 0 and not done.stderr, done.stderr
    lines = done.stdout.splitlines()
    source = installed_from()
    assert source is not None
    assert lines[0] == f"pjrt-pool {pool.__version__}, from {source.describe()}", lines[0]
    assert f"jax {metadata.version('jax')}, jaxlib {metadata.version('jaxlib')}" in lines[1]
    plugins = {line.split()[0]: line.split(None, 1)[1] for line in lines[3:]}
    jaxlib = metadata.version("jaxlib")
    assert plugins["cpu"] == (
        f"jaxlib {jaxlib}'s own CPU client, the XLA jax.jit uses here "
        f"(identity: {find_plugin('cpu').path})"
    )
    cpu = find_plugin("pjrt_cpu")
    assert plugins["pjrt_cpu"].startswith(
        f"lammps-jax-pjrt-cpu {metadata.version('lammps-jax-pjrt-cpu')}: {cpu.path}; "
        "the XLA of jaxlib 0.11.2"
    )  # another build of XLA than jax.jit's, and so said:
    assert "results may differ from jax.jit's in the last bits" in plugins["pjrt_cpu"]
    assert plugins["cuda"].startswith("none: no PJRT plugin found for platform 'cuda'")
    assert install_extra_command("cuda13") in plugins["cuda"]
    # Without the tpu extra (and with a platform named by its variable):
    other = in_environment(
        cpu_only, "pjrt-pool", "--version", env={"PJRT_POOL_PLUGIN_FOO": cpu.path}
    )
    named = {line.split()[0]: line.split(None, 1)[1] for line in other.stdout.splitlines()[3:]}
    assert install_extra_command("tpu") in named["tpu"] and named["tpu"].startswith("none: ")
    assert named["foo"] == f"{cpu.path} (environment variable PJRT_POOL_PLUGIN_FOO)"
