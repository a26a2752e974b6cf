// Large copies into shared memory that write around the CPU's caches: the
// parent's copy of a large numpy input into its segment (pool/executor/copier.py).
#pragma once

#include <cstddef>

namespace pjrt_pool {

// Copies `size` bytes as memcpy does (the ranges must not overlap), with
// streaming (non-temporal) stores on x86-64: a copy larger than the caches
// then does not read each destination line before writing it, and runs in
// 0.76-0.83x memcpy's time from memory (benchmarks/bench_copy.py, "Copier 1").
// For copies that fit the caches memcpy is faster, and it leaves what it
// wrote there for the reader: callers keep this for large copies.
// Elsewhere it is memcpy. The stores are fenced before it returns.
void StreamCopy(void* destination, const void* source, size_t size);

}  // namespace pjrt_pool
