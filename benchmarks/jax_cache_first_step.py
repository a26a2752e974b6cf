"""An unmodified JAX script's time to its first step, its cache warmed by pjrt-pool elsewhere.

The script (this file's ``script`` command) runs a GPT-2-width language model from
transformers' Flax models: its forward at three sequence lengths and one AdamW train
step, four ``jax.jit`` programs, on parameters it loads from disk (so that nothing else
compiles). Each side is a fresh process running it; what is compared is the time from its
first call to the train step's loss (and the whole process's wall time), and how many
programs JAX's cache found:

    jax warm cache    JAX's own persistent cache, filled by an earlier run of the script here
    pjrt-pool dir     a directory warmed on another machine: pjrt-pool warm --jax-cache DIR
    pjrt-pool tier    the script with pool.jax_cache.install() (its one added line), an empty
                      disk cache, and a file:// remote tier warmed on another machine
                      (warm --jax-cache pjrt-pool --remote)
    cold              an empty cache directory: every program compiles

Usage::

    # where the entries are made (a CPU machine; --platform tpu --topology v5e:1x1 for a VM):
    python benchmarks/jax_cache_first_step.py prepare --out DIR [--platform P --topology T]
    # on the target, DIR copied to the same path:
    python benchmarks/jax_cache_first_step.py measure --out DIR [--rounds 3]

prepare warms the four programs into DIR/warmed (for a script whose cache path is
DIR/warmed) and DIR/tier; measure makes the parameters (on the CPU, once), fills DIR/jax
with one run of the script, then alternates the sides and prints medians and ratios
against JAX's own warm cache. On the machine that prepared the entries (the CPU) every
side can run, as a rehearsal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import Side, compare, report

LAYERS = int(os.environ.get("JCB_LAYERS", "4"))  # fewer: a quick rehearsal
BATCH, LENGTHS = 2, (16, 32, 64)


def _model() -> tuple[Any, Any, Any]:
    """(the model, its jitted forward, its jitted train step): the script's programs."""
    import jax

    from pool.examples.gpt2 import Gpt2

    model = Gpt2(LAYERS, learning_rate=1e-4)
    return model, jax.jit(model.forward), jax.jit(model.step)


def programs() -> list[tuple[str, Any, Any]]:
    """The warm spec: the script's four programs, as it calls them."""
    import jax
    import numpy as np

    model, forward, step = _model()
    params, state = model.shapes()
    tokens = [jax.ShapeDtypeStruct((BATCH, n), np.int32) for n in LENGTHS]
    found = [(f"forward_{n}", forward, (params, t)) for n, t in zip(LENGTHS, tokens, strict=True)]
    return [*found, ("train_step", step, (params, state, tokens[-1]))]


def make_parameters(out: Path) -> None:
    """Writes the parameters and optimizer state the script loads (the ``parameters``
    command, run on the CPU)."""
    import jax
    import numpy as np

    leaves = jax.tree_util.tree_leaves(_model()[0].parameters())
    np.savez(out / "parameters.npz", *leaves)


def _parameters(out: Path) -> None:
    """The parameters and optimizer state the script loads, made once on the CPU."""
    if not (out / "parameters.npz").exists():
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        command = [sys.executable, __file__, "parameters", "--out", str(out)]
        subprocess.run(command, check=True, env=env)


def script(out: Path) -> None:
    """The unmodified script (plus install() when JCB_INSTALL_REMOTE names a tier): prints its
    time to the first step and what JAX's cache found, as one JSON line."""
    started = time.perf_counter()
    remote = os.environ.get("JCB_INSTALL_REMOTE")
    if remote:
        import pool.jax_cache

        pool.jax_cache.install(cache_dir=os.environ["JCB_INSTALL_CACHE"], remote=remote)
    import logging

    import jax
    import numpy as np

    said: list[str] = []  # what JAX's compile path says of each program, by its name

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    compile_log = logging.getLogger("jax._src.compiler")
    compile_log.addHandler(Said(logging.DEBUG))
    compile_log.setLevel(logging.DEBUG)
    model, forward, step = _model()
    leaves = np.load(out / "parameters.npz")
    tree = jax.tree_util.tree_structure(model.shapes())
    arrays = [leaves[f"arr_{i}"] for i in range(len(leaves))]
    params, state = jax.tree_util.tree_unflatten(tree, arrays)
    tokens = {n: model.tokens(BATCH, n) for n in LENGTHS}
    # On the device first, as a script puts its checkpoint there before its first step.
    params, state, tokens = jax.block_until_ready(jax.device_put((params, state, tokens)))
    first = time.perf_counter()
    for n in LENGTHS:
        forward(params, tokens[n]).block_until_ready()
    _, _, loss = step(params, state, tokens[LENGTHS[-1]])
    value = float(loss)
    done = time.perf_counter()
    found = {
        "first_step": done - first,
        "process": done - started,
        # The four programs' lookups (JAX's setup of the model object compiles its own
        # few programs on the CPU, which the warm spec does not list).
        "hits": sum("cache hit for 'jit_" in m and _mine(m) for m in said),
        "misses": sum("CACHE MISS for 'jit_" in m and _mine(m) for m in said),
        "loss": value,
    }
    print(json.dumps(found))


def _mine(message: str) -> bool:
    """Whether a message of JAX's compile path is about one of the script's programs."""
    return "'jit_forward'" in message or "'jit_step'" in message


def _run(out: Path, cache: Path, install: str | None = None) -> dict[str, float]:
    """One fresh process of the script; its figures (the process's own wall time included)."""
    # Every compile is written (JAX's default leaves out those under a second): JAX's own warm
    # cache then holds all four programs, as pjrt-pool's entries do.
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    if os.environ.get("JCB_PLATFORM", "tpu") == "tpu":
        env.pop("JAX_PLATFORMS", None)  # the script's JAX takes the chip
    if install is not None:
        env.pop("JAX_COMPILATION_CACHE_DIR")
        env["JCB_INSTALL_REMOTE"] = install
        env["JCB_INSTALL_CACHE"] = tempfile.mkdtemp(prefix="jcb-cache-")
    started = time.perf_counter()
    command = [sys.executable, __file__, "script", "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the script failed ({done.returncode}):\n{done.stderr[-3000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    figures = ("hits", "misses", "loss")
    return {"wall": found["first_step"], "process_wall": wall, **{f: found[f] for f in figures}}


def prepare(out: Path, platform: str, topology: str | None) -> None:
    """Warms the four programs into out/warmed and out/tier (see the module)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = f"{__file__}:programs"
    command = [sys.executable, "-m", "pool.cli.main", "warm", spec, "--platform", platform]
    command += ["--cache-dir", str(out / "warm-cache")]
    command += [] if topology is None else ["--topology", topology]
    subprocess.run([*command, "--jax-cache", str(out / "warmed")], check=True)
    tier = f"file://{out / 'tier'}"
    (out / "tier").mkdir(exist_ok=True)
    to_tier = ["--jax-cache", "pjrt-pool", "--remote", tier, "--cache-dir", str(out / "tier-cache")]
    subprocess.run([*command, *to_tier], check=True)


def measure(out: Path, rounds: int) -> None:
    """Alternates the four sides on this machine (see the module) and prints the table."""
    _parameters(out)
    jax_own = out / "jax"
    if not jax_own.exists():
        _run(out, jax_own)  # JAX fills its own cache, as a first run of the script does
    tier = f"file://{out / 'tier'}"
    sides = [
        Side("jax warm cache", lambda: _run(out, jax_own), measures=True),
        Side("pjrt-pool dir", lambda: _run(out, out / "warmed"), measures=True),
        Side("pjrt-pool tier (install)", lambda: _run(out, out, install=tier), measures=True),
        Side("cold", lambda: _run(out, Path(tempfile.mkdtemp(prefix="jcb-"))), measures=True),
    ]
    samples = compare(sides, rounds, warmup=0)
    title = "time from the first call to the first step's loss, 4 programs"
    warmed = ("pjrt-pool dir", "pjrt-pool tier (install)")
    report(samples, title, unit="s", goals=dict.fromkeys(warmed, 1.1))
    cold = "the same against a cold compile"
    report(samples, cold, unit="s", baseline="cold", goals=dict.fromkeys(warmed, 0.1))
    report(samples, "the whole process", figure="process_wall", unit="s")
    for side in samples.sides:
        hits, misses = samples.of(side, "hits"), samples.of(side, "misses")
        losses = {f"{x:.6f}" for x in samples.of(side, "loss")}
        print(f"  {side:<28} cache hits {hits}, misses {misses}, losses {sorted(losses)}")
    (out / "measured.json").write_text(json.dumps(samples.values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("prepare", "measure", "script", "parameters"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--platform", default="tpu")
    parser.add_argument("--topology", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.out, args.platform, args.topology)
    elif args.command == "measure":
        measure(args.out, args.rounds)
    elif args.command == "parameters":
        make_parameters(args.out)
    else:
        script(args.out)


if __name__ == "__main__":
    main()
