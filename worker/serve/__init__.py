"""The child programs a parent starts to use a plugin: a pool worker, and the entry check.

Each runs in a process of its own, so that a plugin crash ends that process,
never its parent; they use every floor below (the wire, the cache, the
plugin, compile), and never import JAX.

    server.py       a pool worker (``python -m worker``): the native hot loop, then compile,
                    load and run requests from the parent over the wire (worker/wire)
    command_line.py what a pool worker is started with (WorkerCommand): the parent
                    writes it, ``python -m worker`` reads it
    entry_check.py  ``python -m worker.serve.entry_check``: loads cache entries with the
                    plugin for ``pjrt-pool cache verify --load``
"""
