"""A never-compile Pool refuses programs that are not in its cache before they reach a worker.

In never-compile mode each worker's Ready message carries the key parts of
its plugin and host (worker.serve.start.main), so the parent computes the key a
program would have there and refuses it at submit, with the same
NeverCompileError a worker would raise, when the pool's cache holds no entry
under that key: no worker is claimed and no worker time is spent. A program
that passes is remembered (one set lookup per later submit); a worker still
refuses before compiling if the entry it finds is unusable.

With a remote tier behind the workers' cache (Pool(remote=), or
PJRT_POOL_CACHE_REMOTE in their environment), a local miss is no refusal:
the worker fetches the entry from the remote, or refuses with the same
NeverCompileError when the remote lacks it too. The parent does not ask the
remote itself, since that would be a download here as well as there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pool.executor.programs import program_key_parts
from worker.cache.store import DiskCache
from worker.compile.never_compile import refusal
from worker.identity.keys import key_of
from worker.partitioning import compile_options_for
from worker.records import LoweredProgram


class NeverCompileCheck:
    """The check (see the module docstring) for one pool's cache and workers."""

    def __init__(
        self, directory: Path, parts: dict[str, Any] | None, *, remote: bool = False
    ) -> None:
        self._cache = DiskCache(directory, create=False)
        self._parts = parts
        self._remote = remote
        """Whether the workers have a remote tier (then a local miss is theirs to settle)."""
        self._present: set[str] = set()

    def check(
        self,
        program: LoweredProgram,
        program_id: str,
        text_digest: str,
        compile_options: bytes | None,
        name: str | None,
    ) -> None:
        """Raises NeverCompileError if the program's entry is not in the pool's cache."""
        if program_id in self._present or self._parts is None:
            return  # known to be there, or the workers did not say: they refuse themselves
        if program.platform not in (None, self._parts.get("platform")):
            return  # the worker refuses it for its platform, which says more
        options = compile_options_for(program, compile_options)
        parts = program_key_parts(self._parts, text_digest, options)
        key = key_of(parts)
        if self._cache.usable and self._cache.path_of(key).is_file():
            self._present.add(program_id)
            return
        if self._remote:
            return  # the worker looks in the remote tier, and refuses if it is not there
        raise refusal(name or program.name, key, self._cache if self._cache.usable else None, parts)
