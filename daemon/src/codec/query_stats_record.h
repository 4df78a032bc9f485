// The saved form of a model's expected-attention query statistics (kernels/expected_attention.h),
// kept in the CalibrationStore beside VECTOR's records. Little-endian:
//   "KVQS", uint32 format version 1, uint32 layers L, uint32 query heads Q, uint32 head_dim d,
//   int64 counts [L], float64 sum [L*Q*d], sum_sq [L*Q*d], sum_cross [L*Q*d],
//   uint64 xxh3-64 (common/hash.h Checksum64) of every byte before it.
// Private to the daemon.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/kernels/expected_attention.h"

namespace kvd::daemon {

std::vector<uint8_t> SerializeQueryStatistics(const kernels::QueryStatistics& stats);

// Statistics of `layers` x `q_heads` over `rope`'s head_dim from `bytes`. DATA_LOSS on a bad
// magic, version, size or checksum, or on another shape than asked for (naming both).
StatusOr<kernels::QueryStatistics> DeserializeQueryStatistics(std::span<const uint8_t> bytes,
                                                              int layers, int q_heads,
                                                              const kernels::RopeTable& rope);

}  // namespace kvd::daemon
