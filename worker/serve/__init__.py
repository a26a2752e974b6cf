"""A pool worker serving its parent: the worker's loop and the wire between them.

protocol.py and shm.py are the two sides' shared contract, so the parent
(pool/executor) imports them too; server.py runs only in a worker process
(``python -m worker``), and never imports JAX.

    protocol.py  the frames: Init, Compile, Run, HotRun, Exit; Ready, Reply, HotReply
    shm.py       shared memory: memfd segments and the 64-byte aligned layout of arrays
    server.py    the worker's loop: the native hot loop, then compile, load and run requests
"""
