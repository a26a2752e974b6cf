"""The platforms: one module each, all that pjrt-pool knows about a kind of plugin.

Runs wherever a platform is named: every process that loads a plugin, and the
parent (lowering, a pool's plan of workers, check-plugin). Never imports JAX.

    platform.py   the interface: Platform (a platform's facts and hooks, with their
                  defaults), PluginPackage, KernelLibrary, DeviceSettings, and the
                  closed sets DeviceAccess and CompileSlots
    registry.py   platform_named (a platform by its name: its module's PLATFORM, else an
                  UnlistedPlatform), known_platforms, platform_of_jax_device
    jax_gpu.py    what JAX's CUDA and ROCm plugins share: client options, kernel layout

Every other module here is one platform, named as users name it
(``Pool(platform="cuda")`` reads ``cuda.py``), and defines ``PLATFORM``, its
Platform; tests/test_structure.py checks that, in place of naming each here,
so that adding a platform is adding its module (and its test): see
docs/plugins.md, "Adding a platform".
"""
