#include "fast_checksum.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvd::client::internal {

#if defined(KVD_CLIENT_HAVE_AVX2_CHECKSUM)
uint64_t Checksum64Avx2(const void* data, size_t size);  // fast_checksum_avx2.cc
#endif

namespace {
using ChecksumFn = uint64_t (*)(const void*, size_t);

uint64_t Checksum64Baseline(const void* data, size_t size) { return XXH3_64bits(data, size); }

ChecksumFn Pick() {
#if defined(KVD_CLIENT_HAVE_AVX2_CHECKSUM)
  if (__builtin_cpu_supports("avx2")) return &Checksum64Avx2;
#endif
  return &Checksum64Baseline;
}
}  // namespace

uint64_t FastChecksum64(const void* data, size_t size) {
  static const ChecksumFn fn = Pick();
  return fn(data, size);
}

}  // namespace kvd::client::internal
