"""Running straight from a bundle: read-only, one program at a time, checked as cache loads are.

No cache directory is needed and nothing is written: the entry that
preflight.judge picks for this process (from the index alone) is read from
the bundle, checked (its SHA-256 against the index, its digests, its
signature when a secret is set) and deserialized by the plugin, which
rejects what it cannot load. Only the programs that run are read.
"""

from __future__ import annotations

from worker.bundle.preflight import judge
from worker.bundle.reader import Bundle
from worker.bundle.signatures import recorded_types
from worker.compile.executable import Executable, deserialize_executable
from worker.errors import NotInCacheError, PjrtError
from worker.identity.target import runtime_key_parts
from worker.plugin.runtime import get_runtime
from worker.records import ProgramSpec


def load_from_bundle(bundle: Bundle, name: str) -> tuple[Executable, ProgramSpec]:
    """Loads a program of a bundle into this process; returns it and its spec.

    Raises KeyError for a name the bundle lacks, NotInCacheError when no
    entry of the program was built for this plugin and host (naming the key
    parts that differ) or the plugin rejects it, and BundleError for an
    entry changed since the bundle was made.
    """
    program = bundle.index.programs[name]
    runtime = get_runtime(program.platform)
    verdict = judge(bundle.index, program, runtime_key_parts(runtime, None))
    if not verdict.loads:
        lines = [line for other in verdict.elsewhere for line in other.differences]
        raise NotInCacheError(
            f"{bundle.path} has no entry of {name} for this plugin and host ({verdict.reason}; "
            f"it would need key {verdict.key}): "
            + ("; ".join(dict.fromkeys(lines)) or "no entry differs in its environment")
            + ". Warm it on a machine like this one and merge that bundle in "
            "(pjrt-pool bundle merge)",
            program=name,
            key=verdict.key,
            location=bundle.path,
            differences="\n".join(verdict.describe().splitlines()[1:]),
        )
    entry = bundle.entry(verdict.key)
    spec = program.spec(verdict.key)  # its types are the entry's: Bundle.entry checked them
    inputs = recorded_types(entry.metadata)[0]
    try:
        executable = deserialize_executable(
            entry.payload, key=verdict.key, input_types=inputs, partitioning=spec.partitioning
        )
    except (PjrtError, ValueError) as error:
        raise NotInCacheError(
            f"the plugin rejected {name}'s entry {verdict.key} in {bundle.path}: {error}",
            program=name,
            key=verdict.key,
            location=bundle.path,
        ) from None
    return executable, spec
