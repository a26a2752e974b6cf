"""A real model's train step through pjrt-pool against jax.jit on the same chip, bit for bit.

Usage (on a TPU VM with transformers' Flax models, flax and optax installed; each side is
a process of its own, since one process at a time may hold the chip)::

    python tools/tpu_models_check.py --out DIR [--layers 4] [--steps 3]

The model is a GPT-2-width language model from transformers (FlaxGPT2LMHeadModel: 768
wide, 12 heads, a 50257-token vocabulary), its train step a cross-entropy loss with
AdamW (optax), fed back for --steps steps from the same parameters (made once, on the
CPU, and saved) and the same tokens. What is compared, each against jax.jit on the chip:

    function       Pool(1, platform).function(step): parameters in and out each step
    function_keep  the same with keep=(0, 1): parameters and optimizer state stay on the chip
    compile        compile_program(lower(step)) and Executable.run in this process
    bundle         pjrt-pool warm of the step, bundle create, load_manifest(bundle).run
    forward        the model's logits at sequence lengths 16, 32 and 64, through
                   Pool.function (the forward's programs differ from the step's)

For each: the losses (as float32 bits) and a SHA-256 of the final parameters. Writes
DIR/summary.json; the last line printed says whether everything was bit-identical (exit
status 0) or what was not (1). TPU_CHECK_PLATFORM=cpu rehearses it on a machine without a
TPU (jax.jit then runs on the CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from pool.examples.gpt2 import Gpt2

PLATFORM = os.environ.get("TPU_CHECK_PLATFORM", "tpu")
LENGTHS = (16, 32, 64)


def model(layers: int) -> Gpt2:
    """The GPT-2-width model of `layers` layers (pool.examples.gpt2), 128 positions."""
    return Gpt2(layers, positions=128)


def inputs(layers: int) -> tuple[Any, Any, Any, dict[int, Any]]:
    """The parameters and optimizer state (made on the CPU, the same in every process), a
    batch of tokens and a prompt of each length."""
    gpt2 = model(layers)
    params, state = gpt2.parameters()
    prompts = {n: gpt2.tokens(2, n, seed=n) for n in LENGTHS}
    return params, state, gpt2.tokens(2, 64), prompts


def digest(tree: Any) -> str:
    """SHA-256 of a pytree's leaves' bytes, in JAX's order."""
    import jax

    sha = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        sha.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return sha.hexdigest()


def bits(value: Any) -> str:
    return np.float32(np.asarray(value)).tobytes().hex()


def run_steps(call: Any, params: Any, state: Any, tokens: Any, steps: int) -> dict[str, Any]:
    """Feeds `call`'s parameters and state back for `steps` steps; losses and final digest."""
    losses = []
    for _ in range(steps):
        params, state, value = call(params, state, tokens)
        losses.append(bits(value))
    return {"losses": losses, "params": digest(params)}


def jit_side(out: Path, layers: int, steps: int) -> None:
    """In the process that holds the chip: jax.jit's results."""
    import jax

    gpt2 = model(layers)
    params, state, tokens, prompts = inputs(layers)
    results = {"step": run_steps(jax.jit(gpt2.step), params, state, tokens, steps)}
    results["forward"] = {n: digest(jax.jit(gpt2.forward)(params, p)) for n, p in prompts.items()}
    results["device"] = str(jax.devices()[0])
    (out / "jit.json").write_text(json.dumps(results))


SPEC = """
from pool.examples.gpt2 import Gpt2

def programs():
    gpt2 = Gpt2({layers}, positions=128)
    params, state = gpt2.parameters()
    return [("gpt2_step", gpt2.step, (params, state, gpt2.tokens(2, 64)), {platform!r})]
"""


def bundle_side(out: Path, layers: int, steps: int, params: Any, state: Any, tokens: Any) -> Any:
    """Warms the step into a fresh cache, bundles it and runs it from the bundle here."""
    import jax

    from pool.manifest import load_manifest

    spec = out / "gpt2_spec.py"
    spec.write_text(SPEC.format(layers=layers, platform=PLATFORM))
    cache, manifest, bundle = out / "bundle-cache", out / "gpt2.json", out / "gpt2.bundle"
    command = [sys.executable, "-m", "pool.cli.main"]
    warm = [*command, "warm", str(spec), "--manifest", str(manifest), "--cache-dir", str(cache)]
    subprocess.run([*warm, "--platform", PLATFORM], check=True)
    subprocess.run([*command, "bundle", "create", str(manifest), "-o", str(bundle)], check=True)
    loaded = load_manifest(str(bundle))
    tree = jax.tree_util.tree_structure((params, state))

    def call(params: Any, state: Any, tokens: Any) -> Any:
        leaves = jax.tree_util.tree_leaves((params, state, tokens))
        outputs = loaded.run("gpt2_step", leaves)
        params, state = jax.tree_util.tree_unflatten(tree, list(outputs[:-1]))
        return params, state, outputs[-1]

    return run_steps(call, params, state, tokens, steps)


def compile_side(step: Any, steps: int, params: Any, state: Any, tokens: Any) -> Any:
    """compile_program(lower(step)) and Executable.run in this process."""
    import jax

    from pool import compile_program, lower

    executable, _ = compile_program(lower(step, [params, state, tokens], platform=PLATFORM))
    tree = jax.tree_util.tree_structure((params, state))

    def run(params: Any, state: Any, tokens: Any) -> Any:
        outputs = executable.run(jax.tree_util.tree_leaves((params, state, tokens)))
        params, state = jax.tree_util.tree_unflatten(tree, list(outputs[:-1]))
        return params, state, outputs[-1]

    return run_steps(run, params, state, tokens, steps)


def pool_side(out: Path, layers: int, steps: int) -> dict[str, Any]:
    """In a process that leaves the chip to pjrt-pool's workers: each path's results."""
    import jax

    from pool import Pool

    gpt2 = model(layers)
    step, forward = gpt2.step, gpt2.forward
    params, state, tokens, prompts = inputs(layers)
    results: dict[str, Any] = {}
    with Pool(1, platform=PLATFORM) as pool:
        results["function"] = run_steps(pool.function(step), params, state, tokens, steps)
        kept = pool.function(step, keep=(0, 1))
        losses, p, s = [], params, state
        for _ in range(steps):
            p, s, value = kept(p, s, tokens)
            losses.append(bits(value))
        results["function_keep"] = {
            "losses": losses,
            "params": digest(jax.tree_util.tree_map(np.asarray, p)),
        }
        model_forward = pool.function(forward)
        results["forward"] = {n: digest(model_forward(params, q)) for n, q in prompts.items()}
    results["compile"] = compile_side(step, steps, params, state, tokens)
    results["bundle"] = bundle_side(out, layers, steps, params, state, tokens)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--side", choices=("jit", "pool"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.side == "jit":
        jit_side(args.out, args.layers, args.steps)
        return 0
    if args.side == "pool":
        (args.out / "pool.json").write_text(
            json.dumps(pool_side(args.out, args.layers, args.steps))
        )
        return 0
    base = [sys.executable, __file__, "--out", str(args.out), "--layers", str(args.layers)]
    base += ["--steps", str(args.steps)]
    jit_env = dict(os.environ)
    if PLATFORM == "tpu":
        jit_env.pop("JAX_PLATFORMS", None)
    else:
        jit_env["JAX_PLATFORMS"] = "cpu"
    subprocess.run([*base, "--side", "jit"], check=True, env=jit_env)
    pool_env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the chip stays free for the workers
    subprocess.run([*base, "--side", "pool"], check=True, env=pool_env)
    jit = json.loads((args.out / "jit.json").read_text())
    ours = json.loads((args.out / "pool.json").read_text())
    summary: dict[str, Any] = {"device": jit["device"], "jit": jit, "pjrt_pool": ours}
    differing = [
        name
        for name in ("function", "function_keep", "compile", "bundle")
        if ours[name] != jit["step"]
    ]
    differing += [
        f"forward[{n}]" for n in LENGTHS if ours["forward"][str(n)] != jit["forward"][str(n)]
    ]
    summary["differing"] = differing
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    for name in ("function", "function_keep", "compile", "bundle"):
        same = "bit-identical" if ours[name] == jit["step"] else "DIFFERS"
        print(f"{name}: {same} (losses {ours[name]['losses']} vs {jit['step']['losses']})")
    print("all bit-identical to jax.jit" if not differing else f"differ: {', '.join(differing)}")
    return 0 if not differing else 1


if __name__ == "__main__":
    raise SystemExit(main())
