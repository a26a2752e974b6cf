"""``python -m worker.plugin.probe PLATFORM``: print the platform's plugin identity as JSON.

The parent runs this once per plugin build (the result is memoized on disk)
to learn which StableHLO versions the plugin reads, without loading the
plugin into its own process. Only the library is loaded, as for deviceless
compiles (so libtpu takes no host lock: a chip's holder may be running);
no client or device is created. For jaxlib's own client
(worker.plugin.jaxlib_cpu) the window is that of jaxlib's MLIR bindings.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from worker import _pjrt
from worker.errors import PluginNotFoundError
from worker.plugin.locate import RuntimeKind, environment_variables, find_plugin
from worker.plugin.runtime import loading_environment


def _version(value: object) -> str | None:
    return ".".join(map(str, value)) if isinstance(value, tuple) else None


def main(argv: list[str]) -> int:
    """Prints {"path", "api_version", "stablehlo_minimum_version", ...} or {"error"}."""
    if len(argv) != 1:
        print("usage: python -m worker.plugin.probe PLATFORM", file=sys.stderr)
        return 2
    try:
        location = find_plugin(argv[0])
        if location.kind is RuntimeKind.JAXLIB:
            from worker.plugin.jaxlib_cpu.client import JaxlibPlugin

            plugin: Any = JaxlibPlugin(location.path)
            api_version = f"jaxlib {plugin.version}"
        else:
            with environment_variables(loading_environment(argv[0], deviceless=True)):
                plugin = _pjrt.Plugin.load(location.path)
            api_version = "{}.{}".format(*plugin.api_version)
    except (PluginNotFoundError, _pjrt.PluginLoadError, _pjrt.PjrtError, ImportError) as error:
        print(json.dumps({"error": str(error), "kind": type(error).__name__}))
        return 1
    attributes = plugin.attributes()
    print(
        json.dumps(
            {
                "platform": argv[0],
                "path": location.path,
                "source": location.source,
                "runtime": location.kind.value,
                "api_version": api_version,
                "stablehlo_minimum_version": _version(attributes.get("stablehlo_minimum_version")),
                "stablehlo_current_version": _version(attributes.get("stablehlo_current_version")),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
