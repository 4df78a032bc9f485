// CopyWithChecksum64's loop (hash.h), compiled once per instruction set: by hash.cc (baseline)
// and by hash_avx2.cc (-mavx2). Include after <xxhash.h> with XXH_INLINE_ALL. Private to common/.
//
// The functions here are `static` on purpose: each including file must keep its own build of
// them. With `inline` (external linkage) the linker keeps one of the two, and the AVX2 entry
// point called the baseline loop, SSE2 hash included (common_simd_builds_are_separate checks).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#define KVD_HAVE_STREAMING_STORES 1
#endif

namespace kvd::internal {

// Each block is hashed from the source and then copied while it is still in the core's cache
// (L1 32-48 KiB, L2 0.5-2 MiB on x86 servers), so the source is read from memory once.
inline constexpr size_t kCopyChecksumBlockBytes = size_t{32} << 10;
// From these sizes on the copy's stores bypass the cache (non-temporal; CopyDestination in
// kvd/common/copy_checksum.h): a destination read soon from 8 MiB on (it would evict the cache
// anyway); one not read soon from the first size that takes blocks (a cached store first reads
// the destination line it writes, and the line then evicts one the caller may need).
inline constexpr size_t kStreamingCopyBytes = size_t{8} << 20;
inline constexpr size_t kStreamingColdCopyBytes = kCopyChecksumBlockBytes + 1;

#if defined(KVD_HAVE_STREAMING_STORES)
// memcpy with non-temporal stores (SSE2, every x86-64): 64-byte lines once dst is aligned.
static inline void CopyStreaming(std::byte* dst, const std::byte* src, size_t n) {
  const size_t head = std::min(n, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
}
#endif

// REQUIRES: [dst, dst + size) and [src, src + size) do not overlap. Non-temporal stores when
// `size` >= `streaming_from` (where the CPU has them). Returns XXH3_64bits(src).
static inline uint64_t CopyWithChecksum64Blocked(void* dst, const void* src, size_t size,
                                                 size_t streaming_from) {
  if (size == 0) return XXH3_64bits(src, 0);
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  if (size <= kCopyChecksumBlockBytes) {
    const uint64_t h = XXH3_64bits(s, size);
    std::memcpy(d, s, size);
    return h;
  }
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
#if defined(KVD_HAVE_STREAMING_STORES)
  const bool streaming = size >= streaming_from;
#endif
  for (size_t at = 0; at < size; at += kCopyChecksumBlockBytes) {
    const size_t n = std::min(kCopyChecksumBlockBytes, size - at);
    XXH3_64bits_update(&state, s + at, n);
#if defined(KVD_HAVE_STREAMING_STORES)
    if (streaming) {
      CopyStreaming(d + at, s + at, n);
      continue;
    }
#endif
    std::memcpy(d + at, s + at, n);
  }
#if defined(KVD_HAVE_STREAMING_STORES)
  if (streaming) _mm_sfence();  // the streamed lines are visible before the caller publishes
#endif
  return XXH3_64bits_digest(&state);
}

}  // namespace kvd::internal
