"""Cache keys stay byte-identical: fixed parts give the keys pinned here.

An executable is found by its key, in every cache, remote and bundle made
before: a change in how a key is derived (the parts' names, their order, how
flags are normalized, how a topology or the host is described) turns every
existing entry into a miss. The literal keys below were computed before the
key's code moved to worker/identity (main 7201f66); a change that alters one
must bump KEY_FORMAT and say why.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform

from worker.identity import environment, keys
from worker.identity.build import memoized_by_file
from worker.identity.keys import PlatformPart
from worker.identity.options import compile_options
from worker.identity.target import runtime_key_parts, topology_fields

TPU_FLAGS = ("LIBTPU_INIT_ARGS",)
"""The TPU platform's own variable of XLA flags (worker.plugin.platforms.tpu)."""
ENVIRON = {
    "XLA_FLAGS": "--xla_cpu_enable_fast_math=true --xla_dump_to=/tmp/x  --xla_b='q r' -xla_a",
    "NPROC": "4",
    "LIBTPU_INIT_ARGS": "--xla_tpu_use_enhanced_launch_barrier=true --xla_tpu_x=1",
}
ENVIRONMENT = {
    "xla_flags": ["xla_a=true", "xla_b=q r", "xla_cpu_enable_fast_math=true"],
    "NPROC": "4",
    "libtpu_init_args": ["xla_tpu_x=1"],
}
CPU_PARTS = {
    "client_options": {"a": "x", "b": 1},
    "compile_options": "1a0420012801",
    "environment": ENVIRONMENT,
    "format": 2,
    "host": {"cpu_features": "0123456789abcdef01234567", "machine": "x86_64"},
    "platform": "cpu",
    "plugin": {
        "api_version": "0.115",
        "device_kind": "cpu",
        "platform_version": "cpu",
        "sha256": "ab" * 32,
    },
    "program_sha256": "77321275d090728bda0d52d53d969ea88a6bb0d06a5de65260515084e884236e",
}
CPU_KEY = "2f611f47431caf38b4913a1ab954e51151451eba19aafd8ca6375c22bc71c00b"
TPU_KEY = "a9c9b3965b443bee90e4b647323b95ee37bdaf947e49a5d21d14deb0b8e46d69"
TOPOLOGY_PART = {
    "chips": "1x1x1",
    "device_kind": "TPU v5 lite",
    "devices": 1,
    "name": "v5e:1x1",
    "sha256": "368cf2c5d960bf92dcf8daed6a16e154e4ce1327dc3025782c5c1ddd454b34fc",
}


def test_the_code_generation_environment_is_normalized_as_before():
    assert environment.codegen_environment(ENVIRON, flag_variables=TPU_FLAGS) == ENVIRONMENT
    flags = (
        "--xla_dump_to=/x --xla_log_foo=1 --a_dump_b=1 --xla_gpu_per_fusion_autotune_cache_dir=/d"
        " --xla_enable_dumping --xla_cpu_use_thunk_runtime=false"
        ' --xla_cpu_use_thunk_runtime=true --s="a \\"b\\" c"'
    )
    assert environment.normalized_xla_flags(flags) == [
        's=a "b" c',
        "xla_cpu_use_thunk_runtime=true",
    ]


def test_the_host_part_is_derived_as_before(monkeypatch):
    monkeypatch.setattr(environment, "host_cpu_flags", lambda: ("avx", "sse4_2"))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert environment.host_cpu_features.__wrapped__() == "990cfe11b06cfd16a4611264"


def test_a_cpu_key_is_pinned(monkeypatch):
    monkeypatch.setattr(keys, "host_cpu_features", lambda: "0123456789abcdef01234567")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    parts = keys.key_parts(
        text="module @jit_f {}",
        platform="cpu",
        plugin_sha256="ab" * 32,
        api_version="0.115",
        platform_version="cpu",
        device_kind="cpu",
        compile_options=compile_options(),
        client_options={"b": 1, "a": "x"},
        environment=environment.codegen_environment(ENVIRON, flag_variables=TPU_FLAGS),
        platform_parts=frozenset({PlatformPart.HOST}),
    )
    assert parts == CPU_PARTS
    assert keys.key_of(parts) == CPU_KEY
    assert keys.key_of(json.loads(json.dumps(CPU_PARTS))) == CPU_KEY  # as an entry records them


class _Topology:
    devices = [{"kind": "TPU v5 lite", "attributes": {"coords": (0, 0, 0)}}]  # noqa: RUF012
    platform_version = "TFRT TPU v5 lite"

    def serialize(self) -> bytes:
        return b"topology-bytes"


class _Client:
    platform_version = "TFRT TPU v5 lite"
    device_kind = "TPU v5 lite"


class _Runtime:
    """What runtime_key_parts reads of a runtime on a TPU v5e chip."""

    platform = "tpu"
    platform_parts = frozenset({PlatformPart.TOPOLOGY})
    api_version = "0.70"
    client_options = {"z": True}  # noqa: RUF012
    codegen_environment = ENVIRONMENT
    client = _Client()

    def device_topology(self) -> _Topology:
        return _Topology()

    def plugin_sha256(self) -> str:
        return "cd" * 32


class _TopologyTarget:
    def key_fields(self):
        return topology_fields(_Topology())


def test_a_tpu_key_is_pinned_on_the_device_and_without_it():
    on_device = runtime_key_parts(_Runtime(), None, "module @jit_g {}")
    assert on_device["topology"] == TOPOLOGY_PART
    assert "host" not in on_device
    assert keys.key_of(on_device) == TPU_KEY
    deviceless = runtime_key_parts(_Runtime(), None, "module @jit_g {}", target=_TopologyTarget())
    assert keys.key_of(deviceless) == TPU_KEY


def test_a_memo_record_is_named_as_before(tmp_path):
    """Records of plugin builds in a cache's plugins/ folder keep hitting (their names hold
    the file identity they were computed for)."""
    library = tmp_path / "plugin.so"
    library.write_bytes(b"a plugin build")
    written: dict[str, dict] = {}

    class Memos:
        def read(self, name):
            return None

        def write(self, name, record):
            written[name] = record

    assert memoized_by_file(str(library), Memos(), "kind", lambda: "value") == "value"
    found = os.stat(library)
    identity = (os.path.realpath(library), found.st_size, found.st_mtime_ns, found.st_ino)
    name = f"kind-{hashlib.sha256(repr(identity).encode()).hexdigest()[:32]}.json"
    assert written == {name: {"identity": list(identity), "value": "value"}}
