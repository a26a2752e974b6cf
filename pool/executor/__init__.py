"""The Pool: worker processes that compile and run programs, seen from the parent.

Runs in the parent process (the user's, which may have imported JAX). pool.py
is the public Pool; the rest is its machinery: tasks.py (task bookkeeping),
workers.py (process bookkeeping), dispatch.py and manager.py (claiming
workers, replies, the manager thread), segments.py (shared memory for large
inputs and outputs), watch.py (the manager's one wait point) and
compiling.py (compile_many and CompileResult, shared with ClusterPool).
"""
