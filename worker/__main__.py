"""``python -m worker --fd N ...``: a pool worker serving the parent on socket N.

Its command line is worker.serve.command_line.WorkerCommand's; its cache
directory is its PJRT_POOL_CACHE_DIR, which the parent set.
"""

from __future__ import annotations

import sys

from worker.plugin.runtime import default_platform
from worker.plugin.startup import prepare_worker
from worker.serve.command_line import WorkerCommand
from worker.serve.start import main

if __name__ == "__main__":
    command = WorkerCommand.parse(sys.argv[1:])
    prepare_worker(command.platform or default_platform())
    sys.exit(main(command))
