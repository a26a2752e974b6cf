"""Why JAX's cache missed: the parts of its key that differ from the nearest entry's.

Every entry pjrt-pool files for JAX records the digest of each part of its key
(pool.jax_cache.keys), as does a miss. The nearest entry is one of the same
program name (the module's, jit_ and the function's name) differing in the
fewest parts; what differs is said in words a user acts on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

PART_MEANINGS = {
    "computation": "the program itself (its module: the function, its shapes, its jit options)",
    "jax_lib version": "the jaxlib version",
    "backend version": "the backend (the platform and its runtime's version, libtpu's build)",
    "XLA flags": "the XLA flags (XLA_FLAGS, LIBTPU_INIT_ARGS and --xla arguments; JAX adds "
    "--xla_tpu_use_enhanced_launch_barrier=true on a TPU VM)",
    "compile_options": "the compile options (they include jax_compilation_cache_dir's path)",
    "accelerator_config": "the devices (their topology)",
    "compression": "the compression (zstandard where the reading JAX can import it, else zlib)",
    "custom_hook": "JAX's custom hook (jax._src.cache_key.custom_hook)",
}
"""What each part of JAX's key stands for, by the name JAX gives it."""


class Known(NamedTuple):
    """An entry filed for JAX, as explanations read it."""

    key: str
    """JAX's key."""
    parts: Mapping[str, str]
    """Each part's digest."""
    metadata: Mapping[str, Any]
    """What the entry records for people (who made it, for which target, when)."""


class Explanation(NamedTuple):
    """Why a key missed."""

    name: str
    key: str
    nearest: Known | None
    """The entry of the same program differing in the fewest parts (None: no entry of it)."""
    differing: tuple[str, ...]
    """The parts in which it differs."""
    others: int
    """How many entries of other programs there are."""

    def __str__(self) -> str:
        if self.nearest is None:
            return (
                f"JAX cache miss for '{self.name}': no entry of this program "
                f"({self.others} entr{'y' if self.others == 1 else 'ies'} of other programs)"
            )
        made = _made(self.nearest.metadata)
        if not self.differing:
            return (
                f"JAX cache miss for '{self.name}': an entry of the same key exists ({made}) "
                "but could not be read"
            )
        reasons = "; ".join(f"{part}: {PART_MEANINGS.get(part, part)}" for part in self.differing)
        return (
            f"JAX cache miss for '{self.name}': the nearest entry ({made}) differs in "
            f"{len(self.differing)} part(s) of JAX's key: {reasons}"
        )


def _made(metadata: Mapping[str, Any]) -> str:
    by = metadata.get("made_by")
    target = metadata.get("target")
    words = [f"made by {by}" if isinstance(by, str) else "an entry"]
    if isinstance(target, str):
        words.append(f"for {target}")
    return " ".join(words)


def name_of(key: str) -> str:
    """A JAX key's program name (what precedes its last dash)."""
    return key.rpartition("-")[0] or key


def explain(key: str, parts: Mapping[str, str], known: Iterable[Known]) -> Explanation:
    """Explains a miss of `key` (its parts' digests) against the entries `known`."""
    name = name_of(key)
    best: tuple[int, Known, tuple[str, ...]] | None = None
    others = 0
    for entry in known:
        if name_of(entry.key) != name:
            others += 1
            continue
        differing = tuple(p for p in parts if entry.parts.get(p) != parts[p])
        if best is None or len(differing) < best[0]:
            best = (len(differing), entry, differing)
    if best is None:
        return Explanation(name, key, None, (), others)
    return Explanation(name, key, best[1], best[2], others)
