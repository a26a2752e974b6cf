"""What a cache key is made of: the key's parts, where each comes from, and the key itself.

An executable may be reused only where it was compiled for the same program
text, platform, plugin build, compile options, client create options,
code-generation environment, host CPU (on CPU) and topology (on TPU); its
key is the SHA-256 of those parts. Which platform has which part is the
platform's to say (worker.plugin.platforms, which the runtime hands over):
nothing here names a platform but the TPU generations, which a TPU key's
topology part is named by. Runs in every process that computes or
matches keys: pool workers, a user's process compiling or loading in
process, the parent (Pool.key_parts, warm, bundles, manifests) and the
command line. It never imports JAX, the native module or another package of
the worker side (only worker.errors, the base of its errors, and
worker.untrusted, for reading RECORD files), so the
shared records, the cache, plugins, compiling and bundles all take from it::

    keys.py         key_parts (one key's parts, assembled) and key_of (the key); the parts
                    only some platforms have (PlatformPart); the form of a key (is_key,
                    check_key); comparing parts (explain_key, foreign_parts, differing_parts)
    environment.py  what the plugin reads from the environment as it loads (XLA_FLAGS and a
                    platform's own variables of flags, TPU's LIBTPU_INIT_ARGS, normalized;
                    thread counts), and the host's CPU features
    options.py      the serialized compile options: the default ones, a sharded program's
                    (encoded here, as jaxlib serializes them), and checking given ones
    target.py       what a runtime and a target put in a key (platform version, device kind,
                    a TPU topology's part); runtime_key_parts, a program's key parts here
    tpu_generations.py  the TPU generations (one row each: their names, device kind,
                    accelerator types, axes, chips on a host), which target.py names a
                    topology by and the tpu platform reads
    build.py        a plugin build's SHA-256 (vouched for by its installed RECORD, else
                    hashed), and the one memo of values computed from a library file
"""
