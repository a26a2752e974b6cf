"""A platform is one module: what every platform module promises, and the facts each holds.

worker/plugin/platforms/ has one module per platform (cpu, cuda, rocm, tpu,
and whatever is added), behind one interface (Platform); everything else
reads it. These tests check the promises every platform keeps, and each
hook that this machine can run for real: a CPU client given four devices has
four, on both CPU plugins.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import SECOND_PLUGIN, run_python

from worker.compile.slots import CORES_PER_GPU_COMPILE, SLOTS_ENV, compile_slots
from worker.identity.keys import PlatformPart
from worker.plugin.locate import env_var
from worker.plugin.platforms.platform import (
    NO_SETTINGS,
    DeviceAccess,
    Platform,
    PluginPackage,
    UnlistedPlatform,
)
from worker.plugin.platforms.registry import (
    known_platforms,
    platform_named,
    platform_of_jax_device,
)
from worker.plugin.platforms.tpu import chip_settings

PLATFORMS = [platform.name for platform in known_platforms()]


def test_the_four_platforms_and_only_platforms_are_known():
    assert {"cpu", "cuda", "rocm", "tpu"} <= set(PLATFORMS)
    # The interface and helper modules describe no platform.
    for name in ("platform", "registry", "jax_gpu"):
        assert isinstance(platform_named(name), UnlistedPlatform)


@pytest.mark.parametrize("name", PLATFORMS)
def test_every_platform_keeps_the_interfaces_promises(name: str):
    platform = platform_named(name)
    assert isinstance(platform, Platform) and platform.name == name
    assert platform_named(name) is platform  # one instance per process
    assert platform.jax_names and all(isinstance(n, str) and n for n in platform.jax_names)
    assert env_var(name) == f"PJRT_POOL_PLUGIN_{name.upper()}"
    for package in platform.packages:
        assert isinstance(package, PluginPackage) and package.library.endswith(".so")
    for library in platform.kernels:
        assert library.markers and library.modules and library.description
    assert all(variable.isupper() for variable in platform.flag_variables)
    assert platform.references_apart == (platform.device_access is DeviceAccess.EXCLUSIVE)
    # Platforms are facts: nothing can be set on one.
    with pytest.raises(AttributeError):
        platform.name = "other"  # type: ignore[misc]
    # A worker of one device asks for no create option, so its keys stay as they were.
    assert platform.device_settings(1).create_options == {}
    for count, first in ((0, 0), (1, -1), (1.0, 0)):
        with pytest.raises(ValueError, match="1 or more devices"):
            platform.device_settings(count, first)


def test_an_unlisted_platform_has_the_defaults(monkeypatch: pytest.MonkeyPatch):
    vendor = platform_named("vendor")
    assert isinstance(vendor, UnlistedPlatform) and vendor.name == "vendor"
    assert vendor.jax_names == ("vendor",) and vendor.ffi_name == "VENDOR"
    assert vendor.packages == () and vendor.kernels == () and not vendor.references_apart
    assert vendor.device_settings(1) == NO_SETTINGS
    with pytest.raises(ValueError, match="does not know how to give a vendor worker 2"):
        vendor.device_settings(2)
    # Names that are no module's name are unlisted platforms too, never an import.
    assert isinstance(platform_named("CPU"), UnlistedPlatform)
    assert isinstance(platform_named("os.path"), UnlistedPlatform)
    monkeypatch.delenv(SLOTS_ENV, raising=False)
    assert compile_slots("vendor") is None


def test_the_facts_each_platform_holds(monkeypatch: pytest.MonkeyPatch):
    """The tables the platforms replaced, as each module now states them."""
    cpu, cuda, rocm, tpu = map(platform_named, ("cpu", "cuda", "rocm", "tpu"))
    assert [p.ffi_name for p in (cpu, cuda, rocm, tpu)] == ["Host", "CUDA", "ROCM", "TPU"]
    assert [p.jax_names for p in (cpu, cuda, rocm, tpu)] == [
        ("cpu",),
        ("cuda", "gpu"),
        ("rocm", "gpu"),
        ("tpu",),
    ]
    assert cpu.packages == () and cpu.runs_on_jaxlib  # jaxlib's own client, not a plugin
    pjrt_cpu = platform_named("pjrt_cpu")
    assert not pjrt_cpu.runs_on_jaxlib and pjrt_cpu.jax_names == ("cpu",)
    assert [d.distribution for d in pjrt_cpu.packages] == ["lammps-jax-pjrt-cpu", "xla-cpu-pjrt"]
    assert [p.runs_on_jaxlib for p in (cuda, rocm, tpu)] == [False, False, False]
    assert [d.distribution for d in cuda.packages] == ["jax-cuda13-pjrt", "jax-cuda12-pjrt"]
    assert [d.distribution for d in rocm.packages] == ["jax-rocm7-pjrt", "jax-rocm60-pjrt"]
    assert [d.distribution for d in tpu.packages] == ["libtpu"]
    for gpu in (cuda, rocm):
        assert dict(gpu.client_options) == {"preallocate": False, "allocator": "default"}
    assert dict(cpu.jax_semantics) == {"xla_cpu_enable_fast_min_max": "false"}
    assert tpu.flag_variables == ("LIBTPU_INIT_ARGS",)
    assert cpu.platform_parts == {PlatformPart.HOST}
    assert tpu.platform_parts == {PlatformPart.TOPOLOGY}
    assert [p.shares_autotune_results for p in (cpu, cuda, rocm, tpu)] == [
        False,
        True,
        False,
        False,
    ]
    assert [p.references_apart for p in (cpu, cuda, rocm, tpu)] == [False, False, False, True]
    monkeypatch.delenv(SLOTS_ENV, raising=False)
    gpu_slots = max(1, (os.cpu_count() or 1) // CORES_PER_GPU_COMPILE)
    assert [compile_slots(p.name) for p in (cpu, cuda, rocm, tpu)] == [
        None,
        gpu_slots,
        gpu_slots,
        None,
    ]


def test_which_platform_a_device_of_jaxs_is():
    assert platform_of_jax_device("cpu") == "cpu"
    assert platform_of_jax_device("tpu", "TFRT TPU v5 lite") == "tpu"
    assert platform_of_jax_device("gpu", "rocm 60300") == "rocm"
    assert platform_of_jax_device("gpu", "cuda 12030") == "cuda"
    assert platform_of_jax_device("gpu") == "cuda"  # what lower() took a bare "gpu" for
    assert platform_of_jax_device("METAL", "") == "METAL"  # JAX's own name, unchanged


CPU_PLUGINS = [
    "default",
    pytest.param(
        "second",
        marks=pytest.mark.skipif(SECOND_PLUGIN is None, reason="xla-cpu-pjrt is not installed"),
    ),
]


@pytest.mark.parametrize("plugin", CPU_PLUGINS)
def test_a_cpu_worker_given_k_devices_has_them(plugin: str):
    """The CPU hook for real, on both CPU plugins: a client made with what it gives has the
    devices asked for; up to the plugin's default of 4 it gives nothing (the keys of today's
    workers stay as they are), beyond it cpu_device_count."""
    code = """
        import json
        from worker import _pjrt
        from worker.plugin.locate import find_plugin
        from worker.plugin.platforms.registry import platform_named

        cpu = platform_named("pjrt_cpu")
        plugin = _pjrt.Plugin.load(find_plugin("pjrt_cpu").path)
        counts = {}
        for count in (1, 4, 6):
            options = {**cpu.client_options, **cpu.device_settings(count).create_options}
            counts[count] = [options, _pjrt.Client(plugin, options).num_devices]
        print(json.dumps(counts))
    """
    env = {"PJRT_POOL_PLUGIN_PJRT_CPU": SECOND_PLUGIN} if plugin == "second" else {}
    counts = json.loads(run_python(code, env=env).stdout.strip().splitlines()[-1])
    assert counts == {"1": [{}, 4], "4": [{}, 4], "6": [{"cpu_device_count": 6}, 6]}


@pytest.mark.parametrize(
    "platform, variable", [("cuda", "CUDA_VISIBLE_DEVICES"), ("rocm", "HIP_VISIBLE_DEVICES")]
)
def test_a_gpu_worker_is_given_gpus_among_those_this_process_sees(
    platform: str, variable: str, monkeypatch: pytest.MonkeyPatch
):
    gpus = platform_named(platform)
    monkeypatch.delenv(variable, raising=False)
    settings = gpus.device_settings(2, first=1)
    assert settings.create_options == {} and dict(settings.environment) == {variable: "1,2"}
    assert dict(gpus.device_settings(1).environment) == {variable: "0"}
    # A process limited to some GPUs gives its workers only those.
    monkeypatch.setenv(variable, "4, 5,6")
    assert dict(gpus.device_settings(2, first=1).environment) == {variable: "5,6"}
    with pytest.raises(ValueError, match=f"{variable}=4, 5,6 shows this process 3 device"):
        gpus.device_settings(2, first=2)


def test_a_tpu_worker_is_given_one_chip_or_the_whole_host():
    one_of_four = chip_settings(1, 2, 4, {})
    assert one_of_four.create_options == {}
    assert dict(one_of_four.environment) == {
        "TPU_VISIBLE_CHIPS": "2",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": "1,1,1",
    }
    # Among the chips this process is limited to, not the host's first ones.
    limited = chip_settings(1, 1, 2, {"TPU_VISIBLE_CHIPS": "2,3"})
    assert limited.environment["TPU_VISIBLE_CHIPS"] == "3"
    # The whole host, or a host of one chip (or none here), needs nothing.
    assert chip_settings(4, 0, 4, {}) == chip_settings(1, 0, 1, {}) == NO_SETTINGS
    assert platform_named("tpu").device_settings(1) == NO_SETTINGS  # no chip on this machine
    with pytest.raises(ValueError, match="shows 4 TPU chip"):
        chip_settings(1, 4, 4, {})
    with pytest.raises(ValueError, match="one chip or all 4 of this host, not 2"):
        chip_settings(2, 0, 4, {})


def test_the_tpu_generations_name_topologies_hosts_and_host_bounds(
    monkeypatch: pytest.MonkeyPatch,
):
    """One table (worker.identity.tpu_generations) says every generation's names: the topology
    a key names, the topology of a host's chips, the host bounds a topology name needs."""
    from worker.identity.target import topology_name
    from worker.identity.tpu_generations import GENERATIONS
    from worker.plugin.libtpu import host_topology
    from worker.plugin.topology import derived_options

    for field in ("device_kind", "names", "accelerator_types"):
        values = [
            value
            for generation in GENERATIONS
            for value in (
                getattr(generation, field) if field != "device_kind" else [generation.device_kind]
            )
        ]
        assert len(values) == len(set(values)), f"a {field} names two generations"

    def chips(kind: str, *coords: tuple[int, ...]) -> list[dict]:
        return [{"kind": kind, "attributes": {"coords": c}} for c in coords]

    square = ((0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0))
    assert topology_name(chips("TPU v5 lite", *square)) == "v5e:2x2"
    assert topology_name(chips("TPU v4", *square)) == "v4:2x2x1"
    assert topology_name(chips("TPU v5", *square)) == "v5p:2x2x1"
    assert topology_name(chips("TPU v6 lite", (0, 0, 0))) == "v6e:1x1"
    assert topology_name(chips("TPU v9 giant", (0, 0, 0))) is None
    assert topology_name([*chips("TPU v4", (0, 0, 0)), *chips("TPU v3", (1, 0, 0))]) is None

    hosts = {
        ("v5litepod-4", 4): "v5e:2x2",
        ("v5lite-1", 1): "v5e:1x1",
        ("v6e-8", 8): "v6e:2x4",
        ("v4-8", 4): "v4:2x2x1",
        ("v5p-16", 8): "v5p:2x2x2",
        ("v3-8", 2): "v3:1x2",
        ("v9-8", 2): "v9:1x2",  # a "vN" the table does not know, by its name
    }
    for (accelerator, count), name in hosts.items():
        monkeypatch.setenv("TPU_ACCELERATOR_TYPE", accelerator)
        found = host_topology(chips=count)
        assert found is not None and found.name == name, (accelerator, found)
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "tpu7x-8")
    assert host_topology(chips=8) is None
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-16")
    assert host_topology(chips=16) is None  # no layout known for 16 chips on a host

    # A v5e or v6e slice of at most 8 chips is one host of its own chips; other names fill
    # libtpu's default hosts (2x2x1) or say the bounds they need.
    assert derived_options("v6e:2x4") == {"chips_per_host_bounds": (2, 4, 1)}
    assert derived_options("v5litepod:2x2") == {"chips_per_host_bounds": (2, 2, 1)}
    assert derived_options("V5E:1x1") == {"chips_per_host_bounds": (1, 1, 1)}
    assert derived_options("v5e:4x4") == {}
    assert derived_options("v4:2x2x2") == {}
    assert derived_options("v5lite:2x2") == {}
