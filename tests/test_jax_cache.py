"""JAX's own persistent cache, made and backed by pjrt-pool (pool.jax_cache).

Each case runs JAX in a fresh process (its cache is process-wide state): keys equal the
keys JAX itself computes (on this machine for the CPU, and as measured on a TPU v5e VM for
a topology warmed here), install() makes an unmodified jax.jit read and publish through
pjrt-pool's stores, and a miss says which part of JAX's key differs.
"""

from __future__ import annotations

import json
import textwrap

import jax
import pytest
from conftest import pjrt_pool, run_python

from pool.jax_cache.versions import jax_version

PRELUDE = """
    import json, os, sys
    import numpy as np, jax, jax.numpy as jnp
    from jax import monitoring

    events = []
    monitoring.register_event_listener(lambda name, **kw: events.append(name))

    def small(w, x):
        return jnp.tanh(x @ w) @ w.T + jnp.sin(x)

    rng = np.random.default_rng(0)
    W = rng.standard_normal((256, 256)).astype(np.float32)
    X = rng.standard_normal((64, 256)).astype(np.float32)
    SHAPES = [jax.ShapeDtypeStruct(W.shape, W.dtype), jax.ShapeDtypeStruct(X.shape, X.dtype)]

    def counted():
        return {
            "hits": events.count("/jax/compilation_cache/cache_hits"),
            "misses": events.count("/jax/compilation_cache/cache_misses"),
        }
"""

CPU = {"JAX_PLATFORMS": "cpu"}


def child(body: str, env: dict[str, str] | None = None, timeout: float = 240) -> dict:
    """Runs PRELUDE + body in a fresh JAX process; returns the JSON its last line prints."""
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    done = run_python(code, env={**CPU, **(env or {})}, timeout=timeout)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cpu_key_is_the_key_jax_files_the_program_under(tmp_path):
    """On each checked JAX: the key computed for this machine's CPU equals the one JAX's own
    jax.jit writes its entry under, for a plain function and for a jit with options."""
    found = child(
        f"""
        from functools import partial
        from pool.jax_cache.keys import jax_program
        from pool.jax_cache.target import JaxTarget, local_compression

        path = {str(tmp_path / "jax")!r}
        donating = jax.jit(small, donate_argnums=(1,))
        target = JaxTarget("cpu", path, compression=local_compression())
        ours = [jax_program(f, SHAPES, None, target) for f in (small, donating)]
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.jit(small)(W, X).block_until_ready()
        donating(W, X.copy()).block_until_ready()
        files = sorted(n[: -len("-cache")] for n in os.listdir(path) if n.endswith("-cache"))
        print(json.dumps({{"ours": sorted(p.key for p in ours), "jax": files,
                          "parts": [name for name, _ in ours[0].parts]}}))
        """
    )
    assert found["ours"] == found["jax"], found
    assert found["parts"][:2] == ["computation", "jax_lib version"]
    assert "compile_options" in found["parts"] and "XLA flags" in found["parts"]


@pytest.mark.skipif(jax_version() != (0, 10), reason="measured on the TPU VM with jax 0.10.2")
@pytest.mark.skipif(
    jax.__version__ != "0.10.2", reason="the chip's keys were measured with jax 0.10.2"
)
def test_a_tpu_key_made_here_is_the_key_the_chip_computes():
    """A v5e:1x1 key made on this CPU machine equals what jax.jit computed on a TPU v5e VM
    (jax 0.10.2, libtpu 0.0.42.1, jax_compilation_cache_dir=/tmp/jit/jaxcache): its key
    and every part. A deviceless compile of the same jit (JAX's own way to compile for a
    topology here) files it under another key."""
    pytest.importorskip("libtpu")
    found = child(
        """
        from pool.jax_cache.keys import jax_program
        from pool.jax_cache.target import JaxTarget
        from worker.plugin.topology import parse_topology

        target = JaxTarget("tpu", "/tmp/jit/jaxcache", topology=parse_topology("v5e:1x1"))
        made = jax_program(small, SHAPES, None, target)
        print(json.dumps({"key": made.key, "parts": dict(made.parts)}))
        """,
        env={"ALLOW_MULTIPLE_LIBTPU_LOAD": "true", "TPU_SKIP_MDS_QUERY": "1"},
    )
    assert found["key"] == (
        "jit_small-e3862199627fe2d7130c38961825bdf0376084f0c4a5de70f296e86fe8c6c6b0"
    )
    chip = {  # each part's SHA-256 as JAX logged it on the chip
        "computation": "111f939e8845ae1519bc42e66cd5f667f30b89edc379bd690f489d37754aeca4",
        "backend version": "fa1ee1c8d643053005761b562e94cdb94740cae2715bfa2f067f66d7c6eb0a3b",
        "XLA flags": "542121283c29d07821f077110af0f57c569ed8ea4865a1e540e2676eabe4a410",
        "compile_options": "5fd71357bec94ca4c4a9f637624fa67ba57a95f5c8552c685e11a6170bd69807",
        "accelerator_config": "2af2b1e916cbf0d28010a5304e02dcce409f106b5f66e8ee96fcdb4678a4523b",
    }
    assert {name: found["parts"][name] for name in chip} == chip


def test_installed_jax_publishes_what_it_compiles_and_a_fresh_process_loads_it(tmp_path):
    """install(): the first process misses, compiles and publishes into pjrt-pool's disk
    cache (nothing in a JAX directory); a fresh one hits and compiles nothing; the results
    are bit for bit the same."""
    script = f"""
        from pool.jax_cache import install
        install(cache_dir={str(tmp_path / "cache")!r}, remote=False)
        np.save(os.environ["OUT"], np.asarray(jax.jit(small)(W, X)))
        print(json.dumps(counted()))
    """
    first = child(script, env={"OUT": str(tmp_path / "out0.npy")})
    second = child(script, env={"OUT": str(tmp_path / "out1.npy")})
    assert (first["hits"], first["misses"]) == (0, 1), first
    assert (second["hits"], second["misses"]) == (1, 0), second
    import numpy as np

    outs = sorted(tmp_path.glob("out*.npy"))
    assert len(outs) == 2 and np.array_equal(np.load(outs[0]), np.load(outs[1]))


def test_a_miss_says_which_part_of_jaxs_key_differs(tmp_path):
    """A program compiled under other XLA flags misses; the warning names the XLA flags (and
    the compile options, whose debug options JAX makes from them), not the program."""
    script = f"""
        import warnings
        from pool.jax_cache import install
        backing = install(cache_dir={str(tmp_path / "cache")!r}, remote=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.jit(small)(W, X).block_until_ready()
        said = [str(w.message) for w in caught if "JAX cache miss" in str(w.message)]
        print(json.dumps({{"said": said, **counted()}}))
    """
    first = child(script)
    assert first["misses"] == 1
    assert first["said"] == [
        "JAX cache miss for 'jit_small': no entry of this program (0 entries of other programs)"
    ]
    second = child(script, env={"XLA_FLAGS": "--xla_backend_optimization_level=2"})
    assert second["misses"] == 1
    assert len(second["said"]) == 1 and "differs in 2 part(s)" in second["said"][0]
    assert "XLA flags:" in second["said"][0] and "compile_options:" in second["said"][0]
    assert "computation:" not in second["said"][0]


SPEC = """
import jax, jax.numpy as jnp

def small(w, x):
    return jnp.tanh(x @ w) @ w.T + jnp.sin(x)

def mlp(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2

def programs():
    f32 = jnp.float32
    shapes = [jax.ShapeDtypeStruct((256, 256), f32), jax.ShapeDtypeStruct((64, 256), f32)]
    mlp_shapes = [jax.ShapeDtypeStruct(s, f32) for s in ((8, 32), (32, 64), (64, 10))]
    return [("small", small, shapes), ("mlp", jax.jit(mlp, static_argnums=()), mlp_shapes)]
"""

RUN_SCRIPT = """
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_CACHE"])
    def mlp(x, w1, w2):
        return jnp.tanh(x @ w1) @ w2
    a = np.asarray(jax.jit(small)(W, X))
    b = np.asarray(jax.jit(mlp, static_argnums=())(X[:8, :32], W[:32, :64], W[:64, :10]))
    np.save(os.environ["OUT"], np.concatenate([a.ravel(), b.ravel()]))
    print(json.dumps(counted()))
"""


def test_warm_makes_entries_that_an_unmodified_script_loads_without_compiling(tmp_path):
    """pjrt-pool warm --jax-cache DIR: a fresh process running plain jax.jit with
    jax_compilation_cache_dir=DIR finds both programs (a plain function, and a jax.jit with
    options) and compiles none; its results are a cold jax.jit's bit for bit."""
    import numpy as np

    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    jax_dir = tmp_path / "jax"
    done = pjrt_pool(
        "warm", str(spec), "--jax-cache", str(jax_dir), "--cache-dir", str(tmp_path / "cache")
    )
    assert "JAX cache: 2 entries in" in done.stdout, done.stdout + done.stderr
    assert len(list(jax_dir.glob("jit_*-cache"))) == 2
    warm = child(RUN_SCRIPT, env={"JAX_CACHE": str(jax_dir), "OUT": str(tmp_path / "warm.npy")})
    cold = child(
        RUN_SCRIPT, env={"JAX_CACHE": str(tmp_path / "empty"), "OUT": str(tmp_path / "cold.npy")}
    )
    assert (warm["hits"], warm["misses"]) == (2, 0), warm  # each miss is a compile
    assert cold["hits"] == 0, cold
    assert np.array_equal(np.load(tmp_path / "warm.npy"), np.load(tmp_path / "cold.npy"))

    # cache explain --jax-cache: both would hit; under other XLA flags, each miss names them.
    cache = ("--jax-cache", str(jax_dir), "--cache-dir", str(tmp_path / "cache"))
    done = pjrt_pool("cache", "explain", str(spec), *cache)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "2 of 2 programs would hit, 0 miss", done.stdout
    assert f"is in the JAX cache {jax_dir}" in done.stdout
    flags = {"XLA_FLAGS": "--xla_backend_optimization_level=2"}
    done = pjrt_pool("cache", "explain", str(spec), "small", *cache, env=flags)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("small: would miss (JAX key jit_small-"), done.stdout
    assert "differs in 2 part(s) of JAX's key: " in lines[1], done.stdout
    assert "XLA flags:" in lines[1] and "compile_options:" in lines[1]
    assert "computation" not in lines[1]
    # A manifest holds no function to key: refused.
    done = pjrt_pool("cache", "explain", str(tmp_path / "m.json"), "--jax-cache", str(jax_dir))
    assert done.returncode == 2 and "give the spec" in done.stderr


@pytest.mark.skipif(jax.__version__ != "0.10.2", reason="the chip's key was measured with 0.10.2")
def test_warm_for_a_tpu_topology_files_its_entry_under_the_chips_key(tmp_path):
    """On this CPU machine, warm --platform tpu --topology v5e:1x1 for a script whose
    jax_compilation_cache_dir is /tmp/jit/jaxcache on the VM: the entry is named with the key
    the chip computed, and holds jaxlib's serialized form (its IFRT header)."""
    pytest.importorskip("libtpu")
    from worker.cache.jax_values import Compression, unpack

    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    jax_dir = tmp_path / "jax"
    done = pjrt_pool(
        "warm",
        f"{spec}:programs",
        "--platform",
        "tpu",
        "--topology",
        "v5e:1x1",
        "--jax-cache",
        str(jax_dir),
        "--jax-cache-path",
        "/tmp/jit/jaxcache",
        "--cache-dir",
        str(tmp_path / "cache"),
        env={"ALLOW_MULTIPLE_LIBTPU_LOAD": "true", "TPU_SKIP_MDS_QUERY": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    name = "jit_small-e3862199627fe2d7130c38961825bdf0376084f0c4a5de70f296e86fe8c6c6b0-cache"
    serialized, _ = unpack((jax_dir / name).read_bytes(), Compression.ZLIB)
    assert b"pjrt_ifrt" in serialized[:200]


def test_a_jax_whose_cache_was_not_checked_is_refused_with_the_versions_that_were(monkeypatch):
    """Another JAX's entry format and key function may differ: refused in one error naming the
    checked versions (the installed JAX is told it is 0.99)."""
    from pool.jax_cache import versions

    versions.jax_internals.cache_clear()
    monkeypatch.setattr(jax, "__version_info__", (0, 99, 0))
    try:
        with pytest.raises(versions.JaxVersionError, match=r"checked: 0\.10, 0\.11, 0\.12"):
            versions.jax_internals()
    finally:
        versions.jax_internals.cache_clear()
