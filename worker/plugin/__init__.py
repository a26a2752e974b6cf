"""The process's PJRT plugin: finding it, loading it, and what it needs around it.

Runs in every process that holds a plugin (a pool worker, a user's process
in in-process use, the probe the parent starts) and never imports JAX.

    platforms/              one module per platform: all that is known of a kind of plugin
                            (where it is found, what it loads with, its kernels, flags, key
                            parts, compile slots and devices), behind one interface, Platform
    locate.py               which plugin library serves a platform (environment, packages)
    startup.py              what a pool worker sets up before its plugin loads
    xla_flags.py            the XLA flags a plugin loads with (JAX's semantics)
    runtime.py              the one Runtime of the process: plugin, client, identity
    jaxlib_cpu/             jaxlib's own CPU client as a runtime (the cpu platform's): the XLA
                            jax.jit runs on, through jaxlib's bindings, behind the native
                            module's interface
    devices.py              how a client is given k devices, per platform; refusing more
    kernels.py              XLA FFI handlers: jaxlib's kernels, register_custom_call
    device_errors.py        which errors leave a device context unusable
    topology.py             topologies: the devices a program is compiled for, not held
    libtpu.py               what libtpu needs around it (the tpu platform reads it):
                            environment, this host's chips, its lock
    probe.py                ``python -m worker.plugin.probe``: a plugin's identity, unloaded here
    build_identity.py       a library's SHA-256: which installed RECORD vouches for it, else
                            hashed (the rules and the memo: worker/identity/build.py)
    known_builds.py         plugin builds known to miscompile, and the workarounds
    conformance_records.py  check-plugin's recorded outcomes, and the warning they give
    jaxlib_compile.py       compiling through jaxlib's own clients (CPU, a plugin's topology):
                            executables in the form JAX's persistent cache keeps
"""
