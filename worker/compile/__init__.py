"""Compiling programs, and loading their executables from the disk cache.

Runs in every process that holds a plugin (worker/plugin) and never imports
JAX; the cache itself is worker/cache.

    compiler.py       compile_program: one compile per key across processes, walking the tiers
    tiers.py          the tiers walked (lookup, claim, publish): the disk cache, then a remote
    entries.py        one key's entry read, checked and loaded through a target, or the Miss
    by_key.py         loading an executable by its cache key alone (manifests)
    never_compile.py  never-compile mode: serving processes that only load
    explain_miss.py   why a program would miss: its nearest entries and the key parts that differ
    target.py         what a compile is for: this process's device, or a topology without one
    executable.py     Executable: a program loaded into the plugin's client
    arguments.py      converting a call's arguments to a program's input types; seeded inputs
    stamp.py          the plugin build and host stamped into serialized executables
    slots.py          compile slots: how many compiles run at once on the machine
    for_jax.py        compiling a program for JAX's own persistent cache, filed under its key
"""
