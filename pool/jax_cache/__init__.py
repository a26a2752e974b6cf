"""JAX's own persistent compilation cache, made and backed by pjrt-pool (the parent side:
it imports JAX).

    target.py    the machine an entry is made for (platform, devices, cache path, flags)
    versions.py  the JAX versions whose cache was checked, and the private JAX it uses
    keys.py      the key JAX files a program under on the target, part by part
    entries.py   an entry's value (compile time, executable, compression) and its file
    backing.py   install(): unmodified jax.jit reads and publishes through pjrt-pool
    explain.py   why a key missed: the parts that differ from the nearest entry
"""

from pool.jax_cache.backing import JaxCacheBacking, JaxCacheMissWarning, install
from pool.jax_cache.keys import JaxProgram, jax_program
from pool.jax_cache.target import Compression, JaxTarget
from pool.jax_cache.versions import JaxVersionError

__all__ = [
    "Compression",
    "JaxCacheBacking",
    "JaxCacheMissWarning",
    "JaxProgram",
    "JaxTarget",
    "JaxVersionError",
    "install",
    "jax_program",
]
