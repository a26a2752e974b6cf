"""The Pool: worker processes that compile and run programs, seen from the parent.

Runs in the parent process (the user's, which may import JAX, though nothing
here does), in the callers' threads and the pool's manager thread. pool.py
is WorkerPool, what the public Pool (pool.face) runs on, made of parts that
each own their state (its docstring draws them):

    pool.py            WorkerPool: what callers call
    task_making.py     WorkerPool's making of tasks: checks, the task's record, staging
    arrays.py          WorkerPool's arrays that outlive a call: put, fetch, empty, asarray
    caller.py          what a caller's thread does itself: the direct run, reading a
                       waited-for reply, recovering from an interrupt
    dispatch.py        claiming, sending, replies, settling, from any thread
    requests.py        each task's message to its worker
    manager.py         the manager thread
    closing.py         close() and terminate(), and interpreter exit's end of a pool
    wait_set.py        the manager's one wait point (an epoll set)
    starts.py          starting workers, replacing those that end, failed starts
    workers.py         the pool's workers: who holds each, the moves any thread makes
    processes.py       a worker's process: command line, environment, spawning, stopping
    worker_process.py  one worker's record (WorkerProcess) and its table of states
    roles.py           what each worker is for: compiling, running on a device, or both
    tasks.py           the tasks' records, their moves, and the queue
    quarantine.py      programs that crash workers
    segments.py        shared memory for large inputs and outputs
    copier.py          copies of callers' arrays into it, large ones over a few threads
    values.py          DeviceValue: an array a worker keeps on its device between calls
    worker_memory.py   what each worker holds of the pool's memory (segments, values, slots)
    forks.py           which process this is: a pool refuses in a forked child

Beside them: futures.py (the futures it hands out), inputs.py (staging a
run's inputs), programs.py (a program's identity), options.py (the Pool's
options, each declared once: name, type, default, check, documentation),
checks.py (checking one value: its kind and range), settings.py (a Pool's
options checked, and what follows from them), preload.py (what a Pool made with preload= has each
worker load as it starts), never_compile_check.py (never-compile mode's
check at submit) and compile_many.py (compile_many and CompileResult, shared
with ClusterPool).
"""
