"""What this process's plugin and host put into a cache key.

Kept apart from the compiler so that a process that only loads executables
(a production job running a bundle or a manifest) computes the key parts it
matches entries against without importing the compiler, the cache's locking
or the kernel libraries.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from worker.cache.key import key_parts
from worker.compile.target import DeviceTarget
from worker.plugin.build_identity import plugin_build_sha256

if TYPE_CHECKING:
    from worker.cache.store import DiskCache
    from worker.compile.target import Target
    from worker.plugin.runtime import Runtime


@functools.cache
def compile_options() -> bytes:
    """Returns the serialized CompileOptionsProto for one replica and one partition."""
    # executable_build_options (field 3) { num_replicas (4): 1, num_partitions (5): 1 }
    return bytes.fromhex("1a0420012801")


def checked_compile_options(options: Any) -> bytes | None:
    """Returns compile options as given (None: the default ones); refuses what is not bytes."""
    if options is None or isinstance(options, bytes):
        return options
    raise TypeError("compile_options must be bytes (a serialized CompileOptionsProto)")


def options_or_default(options: bytes | None) -> bytes:
    """The serialized compile options to use: the given ones, else the default."""
    return compile_options() if options is None else options


def runtime_key_parts(
    runtime: Runtime,
    cache: DiskCache | None,
    text: str = "",
    options: bytes | None = None,
    target: Target | None = None,
) -> dict[str, Any]:
    """Returns the key parts of a program text on this process's plugin and host.

    With the default empty text, what is left describes the runtime alone
    (plugin build, options, host), to compare with an entry's parts. options
    are the serialized compile options (default: compile_options()). target
    is what the program is compiled for (worker.compile.target; default: the
    runtime's device, whose client this opens). The plugin's digest comes
    from its installed RECORD, or is hashed and memoized in the cache's
    plugins/ folder, or without a cache in the default cache directory's, if
    that exists (Runtime.plugin_sha256).
    """
    if target is None:
        target = DeviceTarget(runtime)
    fields = target.key_fields()
    digest = (
        plugin_build_sha256(runtime.location.path, lambda: cache.memos)
        if cache is not None
        else runtime.plugin_sha256()
    )
    return key_parts(
        text=text,
        platform=runtime.platform,
        plugin_sha256=digest,
        api_version=runtime.api_version,
        platform_version=fields["platform_version"],
        device_kind=fields["device_kind"],
        compile_options=options_or_default(options),
        client_options=runtime.client_options,
        environment=runtime.codegen_environment,
        topology=fields["topology"],
    )
