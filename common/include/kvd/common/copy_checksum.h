// The copy of a chunk fused with its checksum (kvd/common/hash.h's Checksum64), for the paths
// that copy chunk bytes and check them end to end (the same-node shared-memory put and get).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvd {

// What becomes of a copy's destination next, which decides how the copy stores it.
enum class CopyDestination {
  // The caller reads it soon (a get's buffer, which the engine uses next): cached stores, and
  // non-temporal (cache-bypassing) stores only from 8 MiB on, where the destination would evict
  // the cache anyway.
  kReadSoon,
  // Nobody on this core reads it soon (a put into an arena slot, read later by other processes
  // or never): non-temporal stores from 32 KiB on, so the copy neither reads the destination's
  // cache lines first (a cached store to a line not in the cache does) nor evicts the cache for
  // lines nobody reads here (about twice as fast into a slot not in the cache from 64 KiB to
  // 2 MiB; docs/benchmarks.md).
  kNotReadSoon,
};

// Copies `size` bytes from `src` to `dst` (like memcpy; the ranges must not overlap; either may
// be null when `size` is 0) and returns Checksum64(src, size), in one pass over the source: each
// 32 KiB block is hashed and then copied while it is in the cache. The stores bypass the cache
// as `destination` says (non-temporal stores are fenced before returning: the bytes are visible
// to other cores once this returns). Thread-safe.
uint64_t CopyWithChecksum64(void* dst, const void* src, size_t size,
                            CopyDestination destination = CopyDestination::kReadSoon);

}  // namespace kvd
