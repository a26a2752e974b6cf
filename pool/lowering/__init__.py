"""Lowering JAX functions to StableHLO for a target plugin.

Runs in the parent process and imports JAX. lower.py has lower() and
lowering_platform(); stablehlo.py serializes for the plugin's StableHLO
window; options.py gives the compile options jax.jit compiles a program with;
plugin_info.py learns that window without loading the plugin here;
workarounds.py rewrites what a plugin build is known to miscompile;
devices.py keeps this process's JAX off a TPU that the workers must hold;
sharding.py gives a program over several devices every boundary sharding and
works out its Partitioning (the blocks the worker splits and assembles);
function.py is PoolFunction, what Pool.function returns: jax.jit's
counterpart for a Pool (pool.face's Pool makes it); inputs.py is
save_inputs, a program's inputs from its function's arguments, in the file
that pjrt-pool run --inputs reads.
"""
