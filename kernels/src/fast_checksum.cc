#include "fast_checksum.h"

// GCC 12 reports -W(maybe-)uninitialized inside its own AVX-512 intrinsics when xxh3 is inlined
// (the `__Y = __Y` idiom of avx512fintrin.h): a false positive, silenced for this file only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvd::kernels::internal {

uint64_t FastChecksum64(const void* data, size_t size) { return XXH3_64bits(data, size); }

}  // namespace kvd::kernels::internal
