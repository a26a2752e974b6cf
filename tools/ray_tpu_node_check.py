"""On a TPU host: a RayClusterPool node's side (NodeActor) on the chip, without Ray's services.

Usage (on the TPU VM, with the tpu and ray extras)::

    python tools/ray_tpu_node_check.py

Ray cannot run on a host whose sandbox opens no TCP socket (its GCS and raylets
speak gRPC over TCP), so this checks what a TPU host's actor does, as a plain
object in this process: NodeActor(platform="tpu", tpu_chips=N) is what
pool.cluster.ray.nodes starts on a node with Ray's TPU resource. It compiles
a few programs (its Pool's compile workers), runs them on the chip (its
device worker), compares each output with jax.jit's on the chip bit for bit,
keeps a value on the chip across three steps of a small training loop
(keep=, as RayClusterPool.function(..., keep=0) sends it), fetches it, and
checks that the host's topology (NodeActor.facts' host_topology, what the
CPU nodes compile for) compiles the same keys on a deviceless Pool. It
prints one line per check and "all checks passed", or raises.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from pool import Pool, lower
from pool.cluster.carried import CarriedError, original_error
from pool.cluster.ray.actor import NodeActor
from pool.cluster.ray.values import Held, KeptOnNode
from worker.plugin.platforms.registry import platform_named


def _value(answer):
    if isinstance(answer, CarriedError):
        raise original_error(answer)
    return answer


def main() -> int:
    chips = platform_named("tpu").attached_devices() or 0
    if not chips:
        print("no TPU is attached here: run this on the TPU VM", file=sys.stderr)
        return 2
    topology = platform_named("tpu").host_topology(chips)
    print(f"{chips} chip(s); the host's topology, for the CPU nodes: {topology}")
    node = NodeActor({"platform": "tpu", "workers": 2, "devices_per_worker": chips}, chips)
    try:
        f32 = jax.ShapeDtypeStruct((256, 256), jnp.float32)
        functions = [lambda x, n=n: jnp.tanh(x @ x) * n for n in range(1, 4)]
        programs = [lower(f, [f32], platform="tpu") for f in functions]
        specs = [_value(node.compile(p, f"p{i}", None, None)).spec for i, p in enumerate(programs)]
        print(f"compiled {len(specs)} programs on the host's compile workers")
        x = np.random.default_rng(0).standard_normal((256, 256), np.float32)
        for function, program in zip(functions, programs, strict=True):
            got = _value(node.run(program, [x], "check", None, None, (), ()))
            want = np.asarray(jax.jit(function)(x))
            assert np.array_equal(got[0], want), "a run differs from jax.jit on the chip"
        print("each run on the chip equals jax.jit's bit for bit")

        def step(p, b):
            return p * 0.5 + b, jnp.sum(p)

        train = lower(step, [f32, f32], platform="tpu")
        params: object = x
        want_params = x
        for _ in range(3):
            outputs = _value(node.run(train, [params, x], "step", None, None, (0,), ()))
            assert type(outputs[0]) is KeptOnNode, outputs[0]
            params = Held(outputs[0].id)
            want_params, _ = jax.jit(step)(want_params, x)
        fetched = _value(node.fetch(params.id, ()))
        assert np.array_equal(fetched, np.asarray(want_params)), "the kept value differs"
        print("a value kept on the chip for three steps equals jax.jit's")
        if topology is not None:
            with Pool(1, platform="tpu", topology=topology) as deviceless:
                keys = [s.key for s in deviceless.compile_many(programs)]
            assert keys == [s.key for s in specs], "a CPU node's keys differ from the host's"
            print("a deviceless Pool for the host's topology computes the host's keys")
    finally:
        node.close()
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
