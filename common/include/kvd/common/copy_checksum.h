// The copy of a chunk fused with its checksum (kvd/common/hash.h's Checksum64), for the paths
// that copy chunk bytes and check them end to end (the same-node shared-memory put and get).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvd {

// Copies `size` bytes from `src` to `dst` (like memcpy; the ranges must not overlap; either may
// be null when `size` is 0) and returns Checksum64(src, size), in one pass over the source: each
// 32 KiB block is hashed and then copied while it is in the cache. From 8 MiB on, the stores
// bypass the cache (non-temporal; fenced before returning). Thread-safe.
uint64_t CopyWithChecksum64(void* dst, const void* src, size_t size);

}  // namespace kvd
