"""The child programs a parent starts to use a plugin: a pool worker, and the entry check.

Each runs in a process of its own, so that a plugin crash ends that process,
never its parent; they use every floor below (the wire, the cache, the
plugin, compile), and never import JAX.

    start.py        a pool worker's start (``python -m worker``): bound to its parent's
                    life, its plugin loaded, Init answered with Ready, then the server
    server.py       a pool worker's loop: the native hot loop, then compile, load and
                    run requests from the parent over the wire (worker/wire)
    placed.py       a worker's runs by place: where a Run's inputs lie and its outputs
                    go (checked), and the runs that read and write there
    python_runs.py  the runs and kept values of executables the native hot loop cannot
                    run (jaxlib's own client's), served from Python
    command_line.py what a pool worker is started with (WorkerCommand): the parent
                    writes it, ``python -m worker`` reads it
    entry_check.py  ``python -m worker.serve.entry_check``: loads cache entries with the
                    plugin for ``pjrt-pool cache verify --load``
"""
