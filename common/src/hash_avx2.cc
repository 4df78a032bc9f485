// Compiled with -mavx2 (common/CMakeLists.txt); called only when the CPU has AVX2.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstddef>
#include <cstdint>

#include "copy_checksum.h"

namespace kvd::internal {

uint64_t Checksum64Avx2(const void* data, size_t size) { return XXH3_64bits(data, size); }

void Checksum64UpdateAvx2(void* state, const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}

uint64_t CopyWithChecksum64Avx2(void* dst, const void* src, size_t size, size_t streaming_from) {
  return CopyWithChecksum64Blocked(dst, src, size, streaming_from);
}

}  // namespace kvd::internal
