"""The Pool: worker processes that compile and run programs, seen from the parent.

Runs in the parent process (the user's, which may import JAX), in the
callers' threads and the pool's manager thread. pool.py is WorkerPool, what
the public Pool (pool.face) runs on, made of parts that each own their state
(its docstring draws them):
manager.py (the manager thread), dispatch.py (sending tasks, replies,
settling), workers.py (process bookkeeping), tasks.py (task bookkeeping and
the queue), quarantine.py, segments.py (shared memory for large inputs and
outputs), watch.py (the manager's one wait point). Beside them: futures.py
(the futures it hands out), inputs.py (staging a run's inputs), programs.py
(a program's identity), settings.py (checking what a Pool is given),
preload.py (what a Pool made with preload= has each worker load as it starts),
never.py (never-compile mode's check at submit) and compile_many.py
(compile_many and CompileResult, shared with ClusterPool).
"""
