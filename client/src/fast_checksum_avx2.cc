// Compiled with -mavx2 (see client/CMakeLists.txt); called only when the CPU has AVX2.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstddef>
#include <cstdint>

namespace kvd::client::internal {

uint64_t Checksum64Avx2(const void* data, size_t size) { return XXH3_64bits(data, size); }

}  // namespace kvd::client::internal
