"""The parent's copies of callers' arrays into shared memory, large ones on a few threads.

The one copy a numpy input costs (into its segment, or Pool.asarray's) is,
in a call, a copy from memory to memory, which one thread makes at what one
core draws from memory (docs/facts.md, "Copies from memory"). So a copy of
SPREAD_BYTES or more is cut into page-aligned parts, copied by threads that
a Copier keeps (threads made for each copy would cost more than they save)
while the caller's thread copies the first part; and a copy of STREAM_BYTES
or more is written around the caches (`_pjrt.stream_copy`: streaming
stores, which do not read each destination line before writing it). A pool
whose devices read inputs from host memory themselves streams smaller
copies too, from its platform's size (Platform.input_stream_bytes: a TPU's
1 MiB), spread or not. What each saves: docs/performance.md, "Large arrays"
(benchmarks/bench_copy.py, benchmarks/bench_arrays.py).

A Copier belongs to one pool (its SegmentCache's) and ends with it; its
threads start on the first large copy. A part still copying when the
caller is interrupted is waited for before the interrupt goes on: no
thread may write into a segment after the task that owns it has given it
back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from worker import _pjrt
from worker.wire import shm

SPREAD_BYTES = 8 << 20
"""Copies this large are spread; smaller ones end before a part would reach a thread."""

STREAM_BYTES = 32 << 20
"""Copies this large are written around the caches (`_pjrt.stream_copy`), by default and
on the CPU plugins, whose workers read the inputs with the CPU: a smaller copy leaves part
of itself in the caches for the worker to read, a streamed one nothing (docs/facts.md,
"Copies from memory")."""

COPY_THREADS_VARIABLE = "PJRT_POOL_COPY_THREADS"
MAX_COPY_THREADS = 64
_PART_ALIGNMENT = 4096  # parts start on the destination's page boundaries


def copy_threads() -> int:
    """The threads a large copy is spread over (the caller's among them):
    PJRT_POOL_COPY_THREADS, read at each copy, else 4 or half the CPUs this process may
    use, whichever is fewer; 1 copies on the caller's thread alone."""
    value = os.environ.get(COPY_THREADS_VARIABLE)
    if value is None:
        # Half: the worker, and the plugin's threads still spinning after the last run,
        # want the rest (on 2 CPUs a copy spread over 2 made calls no faster).
        return max(1, min(4, len(os.sched_getaffinity(0)) // 2))
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if not 1 <= threads <= MAX_COPY_THREADS:
        raise ValueError(
            f"{COPY_THREADS_VARIABLE}={value!r}: give the number of threads a large copy "
            f"into shared memory is spread over, 1 to {MAX_COPY_THREADS} (1: the caller's "
            "thread alone), or unset it"
        )
    return threads


class Copier:
    """Copies arrays into shared memory, spreading large copies over threads of its own."""

    def __init__(self, spread_bytes: int = SPREAD_BYTES, stream_bytes: int = STREAM_BYTES) -> None:
        self.spread_bytes = spread_bytes  # copies this large are spread
        self.stream_bytes = stream_bytes  # copies this large are streamed
        self._threads: ThreadPoolExecutor | None = None  # made on the first large copy
        self._closed = False
        self._lock = threading.Lock()

    def writer(self, arrays: Sequence[np.ndarray], offsets: Sequence[int]) -> Callable[[Any], None]:
        """A function that copies arrays into a segment's memory at their offsets
        (SegmentCache.fill's `write`)."""
        return lambda memory: shm.write(memory, arrays, offsets, self.copy)

    def copy(self, destination: memoryview | np.ndarray, source: np.ndarray) -> None:
        """Copies the bytes of a C-contiguous array (as uint8, flat) into a writable buffer
        of as many bytes; returns once every byte is there and no thread copies."""
        spread = source.nbytes >= max(1, self.spread_bytes)
        streamed = source.nbytes >= self.stream_bytes
        if not (spread or streamed):
            if isinstance(destination, memoryview):
                destination[:] = source.data  # a small copy: the fastest way there is
            else:
                destination[...] = source
            return
        into = np.frombuffer(destination, np.uint8)
        copy = _pjrt.stream_copy if streamed else np.copyto
        parts = copy_threads() if spread else 1
        threads = self._executor() if parts > 1 else None
        if threads is None:  # one thread, or the copier is closed
            copy(into, source)
            return
        step = -(-source.nbytes // parts // _PART_ALIGNMENT) * _PART_ALIGNMENT
        futures: list[Future[None]] = []
        try:
            for begin in range(step, source.nbytes, step):
                part = slice(begin, begin + step)
                try:
                    futures.append(threads.submit(copy, into[part], source[part]))
                except RuntimeError:  # closed meanwhile (the pool's close): copied here
                    copy(into[part], source[part])
            copy(into[:step], source[:step])
        finally:
            _join(futures)
        for future in futures:
            future.result()

    def _executor(self) -> ThreadPoolExecutor | None:
        """The copier's threads; None once it is closed (the caller copies alone)."""
        with self._lock:
            if self._threads is None and not self._closed:
                self._threads = ThreadPoolExecutor(
                    MAX_COPY_THREADS - 1, thread_name_prefix="pjrt-pool-copy"
                )
            return self._threads

    def close(self) -> None:
        """Ends the copier's threads once their parts are copied; later copies run on
        their caller's thread."""
        with self._lock:
            threads, self._threads, self._closed = self._threads, None, True
        if threads is not None:
            threads.shutdown(wait=True)


def _join(futures: list[Future[None]]) -> None:
    """Waits for every part, through interrupts: a part must not write after its copy has
    returned (or raised). The first interrupt is raised once all are done."""
    interrupted: BaseException | None = None
    for future in futures:
        while True:
            try:
                future.exception()
                break
            except BaseException as error:
                interrupted = interrupted or error
    if interrupted is not None:
        raise interrupted
