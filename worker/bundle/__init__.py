"""Bundles: one file that carries warmed programs from the machine that warmed them.

A bundle is an uncompressed POSIX tar, deterministic in its bytes::

    entries/<key>.pjx   cache entry files, byte for byte (digests and signatures carry over)
    index.json          the programs (ProgramSpecs and their entries' keys); each entry's
                        size, SHA-256 and environment (its key parts but the program's)
    index.mac           with a signing secret: the HMAC-SHA256 of index.json

Modules, one job each: container (reading the tar, strictly), index
(index.json, its checks and signature), reader (opening a bundle: members
against the index), writer (create and merge), preflight (would each
program load here, from key parts alone), loading (running straight from a
bundle, read-only) and importing (into a cache, all checked first). None of
them needs JAX: they run in the parent (``pjrt-pool bundle``, Manifest) and
in the workers that load a bundle's entries.
"""
