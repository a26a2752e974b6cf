"""The wire between the parent and its pool workers: frames and shared memory.

Both sides' shared contract: the parent (pool/executor) imports it to send
requests and read replies, a pool worker (worker/serve) to answer them. It
uses only the shared records below it, and never imports JAX.

    protocol.py  the frames: Init, Compile, Run, HotRun, Exit; Ready, Reply, HotReply
    places.py    where a run's arrays lie (Where: PLACE, VALUE) and the PlacedRun frame
    shm.py       shared memory: memfd segments and the 64-byte aligned layout of arrays
    fds.py       closing descriptors quietly in cleanup (also the cache's directories')
"""
