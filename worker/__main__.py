"""``python -m worker --fd N``: a pool worker serving the parent on socket N."""

from __future__ import annotations

import argparse
import json
import sys

from worker.plugin.runtime import default_platform
from worker.plugin.startup import prepare_worker
from worker.plugin.topology import TopologySpec
from worker.serve.server import main


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="inherited socket descriptor")
    parser.add_argument("--platform", default=None, help="platform whose plugin to load")
    parser.add_argument("--cache-dir", default=None, help="disk cache directory")
    parser.add_argument("--max-loaded", type=int, default=64, help="executables kept loaded")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when it dies")
    parser.add_argument(
        "--never-compile", action="store_true", help="load from the cache only, never compile"
    )
    parser.add_argument(
        "--topology",
        type=lambda text: TopologySpec.from_json(json.loads(text)),
        default=None,
        help="compile for this topology (TopologySpec.to_json) without a device",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    options = _parse(sys.argv[1:])
    prepare_worker(options.platform or default_platform(), options.cache_dir)
    sys.exit(
        main(
            options.fd,
            options.platform,
            options.cache_dir,
            options.max_loaded,
            options.parent_pid,
            options.never_compile,
            options.topology,
        )
    )
