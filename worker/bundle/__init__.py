"""Bundles: one file that carries warmed programs from the machine that warmed them.

A bundle is an uncompressed POSIX tar, deterministic in its bytes::

    entries/<key>.pjx   cache entry files, byte for byte (digests and signatures carry over)
    index.json          the programs (ProgramSpecs and their entries' keys); each entry's
                        size, SHA-256 and environment (its key parts but the program's)
    index.mac           with a signing secret: the HMAC-SHA256 of index.json

Modules, one job each: container.py (reading the tar, strictly), index.py
(index.json, its checks and signature), signatures.py (a program's types as
an index says them, against its entry's), reader.py (opening a bundle:
members against the index), remote.py (a bundle at a URL, read with ranged
requests) and urls.py (telling a URL from a path, without remote.py's
imports), writer.py (create and merge), preflight.py (would each program
load here, from key parts alone), loading.py (running straight from a
bundle, read-only) and importing.py (into a cache, all checked first). None
of them needs JAX: they run in the parent (``pjrt-pool bundle``, Manifest)
and in the workers that load a bundle's entries.
"""
