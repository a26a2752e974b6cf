"""The sharded programs on a TPU host: pjrt-pool against jax.jit on the same chip(s), one command.

Usage::

    # on a CPU machine with libtpu (pip install -e '.[tpu]'): bundles for the host
    python tools/tpu_sharding_check.py --make-bundles DIR
    # on the TPU host (copy DIR there; each step is a process of its own, since one
    # process at a time may hold the chips)
    python tools/tpu_sharding_check.py --out OUT --bundles DIR

The cases are pool/examples/sharded.py's (jit over a mesh with replicated and
partly replicated outputs, shard_map psum, all_gather, ppermute, axis_index, a
sharded MLP step over a pytree), over a mesh of every chip of the host (one on
the v5e the check was written for: a 1x1 mesh of axes data and model).

    --make-bundles DIR   without a TPU: pjrt-pool warm of the cases for the host's
                         topology (--topology, default v5e:1x1) and for v5e:2x2, then a
                         bundle of each: DIR/sharded-HOST.bundle, DIR/sharded-v5e-2x2.bundle
    here      (steps, on the host) compile_program and Executable.run in one process,
              whose client holds every chip; outputs saved
    pool      Pool(platform="tpu", devices_per_worker=CHIPS): compile workers and the
              device worker that holds every chip; outputs saved
    bundle    the host's bundle: bundle check (loads), each case run from it, no compile
    refuse    the v5e:2x2 bundle: bundle check refuses every program, naming its mesh,
              4 devices and the host's count; running one raises NotInCacheError
    jax       jax.jit of each case on the chips, same shardings and inputs: each
              pjrt-pool output compared with JAX's (bit-exact, or the relative error)

Writes OUT/summary.json and prints one line per step. TPU_CHECK_PLATFORM=cpu
rehearses the steps but the bundles' on a machine without a TPU (JAX and
the pool on 4 CPU devices); the deviceless compiles and the bundle check's
refusal are tested by tests/test_tpu_sharded.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tpu_check import PLATFORM, _load, _save, log, run_steps

STEPS = ("here", "pool", "bundle", "refuse", "jax")
REHEARSAL_DEVICES = 4
"""JAX's and the pool's CPU devices in a rehearsal (TPU_CHECK_PLATFORM=cpu)."""

SPEC = """
from jax.sharding import AbstractMesh
from pool.examples.sharded import every_program
from pool.warm import WarmProgram

def programs():
    mesh = AbstractMesh({shape!r}, ("data", "model"))
    for name, function, shapes, shardings in every_program(mesh):
        yield WarmProgram(name, function, shapes, **shardings)
"""


def cases(mesh: Any) -> list[tuple[str, Any, list[Any], dict[str, Any]]]:
    """pool.examples.sharded's programs over mesh, imported when first needed (JAX with them)."""
    from pool.examples.sharded import every_program

    return every_program(mesh)


def _chips() -> int:
    if PLATFORM == "cpu":
        return REHEARSAL_DEVICES
    from worker.plugin import libtpu

    return libtpu.attached_chips()


def _mesh_shape(chips: int) -> tuple[int, int]:
    """The host's chips as data x model: 1x1, 1x2 (2), 2x2 (4), 2x4 (8)."""
    return {1: (1, 1), 2: (1, 2), 4: (2, 2), 8: (2, 4)}[chips]


def _inputs(types: list[Any]) -> list[np.ndarray]:
    """Seeded inputs of a program's flat input types (each with a shape and a dtype)."""
    generator = np.random.default_rng(0)
    return [generator.standard_normal(t.shape).astype(t.dtype) for t in types]


def _abstract_cases() -> list[tuple[str, Any, list[Any], dict[str, Any]]]:
    from jax.sharding import AbstractMesh

    return cases(AbstractMesh(_mesh_shape(_chips()), ("data", "model")))


def _programs() -> dict[str, Any]:
    from pool import lower

    return {
        name: lower(function, shapes, platform=PLATFORM, **shardings)
        for name, function, shapes, shardings in _abstract_cases()
    }


def step_here(out: Path) -> dict[str, Any]:
    from worker import compile_program

    outputs: dict[str, list[np.ndarray]] = {}
    compiled = 0
    with tempfile.TemporaryDirectory(prefix="sharding-check-") as cache:
        for name, program in _programs().items():
            executable, statistics = compile_program(program, cache_dir=cache)
            compiled += statistics.compiled
            outputs[name] = executable.run(_inputs(list(program.input_types)))
    _save(out / "in_process.npz", outputs)
    return {"cases": len(outputs), "devices": _chips(), "compiled": compiled}


def step_pool(out: Path) -> dict[str, Any]:
    from pool import Pool

    programs = _programs()
    outputs: dict[str, list[np.ndarray]] = {}
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="sharding-check-") as cache,
        Pool(2, platform=PLATFORM, cache_dir=cache, devices_per_worker=_chips()) as pool,
    ):
        ready = time.perf_counter() - started
        for name, program in programs.items():
            outputs[name] = pool.run(program, _inputs(list(program.input_types)))
        roles = [w["role"] for w in pool.worker_info]
    _save(out / "pool.npz", outputs)
    return {"cases": len(outputs), "start_seconds": round(ready, 2), "roles": roles}


def step_bundle(out: Path, bundles: Path) -> dict[str, Any]:
    from pool.manifest import load_manifest

    name = _host_bundle(bundles)
    checked = _check(name)
    manifest = load_manifest(str(name))
    outputs = {}
    started = time.perf_counter()
    for program in manifest.names:
        spec = manifest.spec(program)
        outputs[program] = manifest.run(program, _inputs(list(spec.input_types or ())))
    _save(out / "bundle.npz", outputs)
    return {
        "check_exit": checked.returncode,
        "check_last_lines": (checked.stdout + checked.stderr).strip().splitlines()[-3:],
        "ran": len(outputs),
        "seconds": round(time.perf_counter() - started, 2),
    }


def _host_bundle(bundles: Path) -> Path:
    found = sorted(bundles.glob("sharded-*.bundle"))
    return next(p for p in found if "2x2" not in p.name or _chips() == 4)


def _check(bundle: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pool.cli.main", "bundle", "check", str(bundle)],
        capture_output=True,
        text=True,
        check=False,
    )


def step_refuse(bundles: Path) -> dict[str, Any]:
    from pool.manifest import load_manifest
    from worker.errors import NotInCacheError

    bundle = bundles / "sharded-v5e-2x2.bundle"
    checked = _check(bundle)
    manifest = load_manifest(str(bundle))
    program = manifest.names[0]
    try:
        manifest.run(program, _inputs(list(manifest.spec(program).input_types)))
        refused = "ran (not refused)"
    except NotInCacheError as error:
        refused = str(error)[:300]
    return {
        "check_exit": checked.returncode,
        "check_lines": (checked.stdout + checked.stderr).strip().splitlines()[-3:],
        "run": refused,
    }


def step_jax(out: Path) -> dict[str, Any]:
    import jax

    from pool.examples.sharded import make_mesh

    mesh = make_mesh(jax.devices(), _mesh_shape(_chips()))
    saved = [w for w in ("in_process", "pool", "bundle") if (out / f"{w}.npz").exists()]
    found = {where: _load(out / f"{where}.npz") for where in saved}
    results: dict[str, Any] = {w: {"bit_exact": 0, "max_relative_error": 0.0} for w in found}
    for name, function, shapes, shardings in cases(mesh):
        leaves, tree = jax.tree.flatten(shapes)
        arguments = jax.tree.unflatten(tree, _inputs(leaves))
        reference = [
            np.asarray(r) for r in jax.tree.leaves(jax.jit(function, **shardings)(*arguments))
        ]
        for where, outputs in found.items():
            got = outputs.get(name)
            if got is None:
                continue
            entry = results[where]
            entry["bit_exact"] += all(
                np.array_equal(a, b) for a, b in zip(got, reference, strict=True)
            )
            for a, b in zip(got, reference, strict=True):
                scale = float(np.max(np.abs(b))) or 1.0
                error = float(np.max(np.abs(a.astype(np.float64) - b))) / scale
                entry["max_relative_error"] = max(entry["max_relative_error"], error)
    return {"devices": [str(d) for d in jax.devices()], "cases": len(cases(mesh)), **results}


def make_bundles(directory: Path, topology: str) -> None:
    """Warms the cases for the host's topology and for v5e:2x2, and bundles each."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in (topology, "v5e:2x2"):
        chips = int(np.prod([int(n) for n in name.split(":")[1].split("x")]))
        work = Path(tempfile.mkdtemp(prefix="sharding-bundle-"))
        spec = work / "spec.py"
        spec.write_text(SPEC.format(shape=_mesh_shape(chips)))
        manifest, bundle = work / "m.json", directory / f"sharded-{name.replace(':', '-')}.bundle"
        environment = {**os.environ, "PJRT_POOL_CACHE_DIR": str(work / "cache")}
        for command in (
            ["warm", str(spec), "--platform", "tpu", "--topology", name, "--manifest",
             str(manifest)],
            ["bundle", "create", str(manifest), "-o", str(bundle)],
        ):  # fmt: skip
            done = subprocess.run(
                [sys.executable, "-m", "pool.cli.main", *command],
                env=environment,
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise SystemExit(f"pjrt-pool {command[0]} failed:\n{done.stdout}{done.stderr}")
        log(f"{bundle}: {len(cases_for(chips))} programs for {name}")


def cases_for(chips: int) -> list[Any]:
    from jax.sharding import AbstractMesh

    return cases(AbstractMesh(_mesh_shape(chips), ("data", "model")))


def _one(step: str, out: Path, bundles: Path | None) -> dict[str, Any]:
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "here": lambda: step_here(out),
        "pool": lambda: step_pool(out),
        "jax": lambda: step_jax(out),
        "bundle": lambda: step_bundle(out, _given(bundles)),
        "refuse": lambda: step_refuse(_given(bundles)),
    }
    return steps[step]()


def _given(bundles: Path | None) -> Path:
    if bundles is None:
        raise SystemExit("this step needs --bundles DIR (made with --make-bundles DIR)")
    return bundles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--bundles", type=Path, default=None, help="what --make-bundles wrote")
    parser.add_argument("--make-bundles", type=Path, default=None, metavar="DIR")
    parser.add_argument("--topology", default="v5e:1x1", help="the host's (for --make-bundles)")
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_bundles is not None:
        make_bundles(args.make_bundles, args.topology)
        return
    if args.out is None:
        parser.error("--out is needed (or --make-bundles)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        print(json.dumps(_one(args.one, args.out, args.bundles), default=str))
        return
    steps = [s for s in args.steps.split(",") if args.bundles or s not in ("bundle", "refuse")]
    extra = ["--bundles", str(args.bundles)] if args.bundles else []
    # The rehearsal's JAX: as many CPU devices as the pool's workers.
    rehearsal = {"PJRT_POOL_REHEARSAL_DEVICES": str(REHEARSAL_DEVICES)} if PLATFORM == "cpu" else {}
    run_steps(
        Path(__file__),
        steps,
        args.out,
        extra,
        lambda step: step == "jax" and PLATFORM == "tpu",
        rehearsal,
    )


if os.environ.get("PJRT_POOL_REHEARSAL_DEVICES"):  # before anything starts JAX's backends
    import jax as _jax

    _jax.config.update("jax_num_cpu_devices", int(os.environ["PJRT_POOL_REHEARSAL_DEVICES"]))

if __name__ == "__main__":
    main()
