#include "kvd/storage/options.h"

#include <string>

namespace kvd::storage {

Status HostTierOptions::Validate() const {
  if (alignment < 8 || alignment > (1u << 20) || (alignment & (alignment - 1)) != 0) {
    return Status::InvalidArgument(
        "host tier: alignment must be a power of two in [8, 1 MiB], got " +
        std::to_string(alignment));
  }
  if (reservation_ttl.count() <= 0) {
    return Status::InvalidArgument("host tier: reservation_ttl must be > 0 ms, got " +
                                   std::to_string(reservation_ttl.count()));
  }
  if (lease_ttl.count() <= 0) {
    return Status::InvalidArgument("host tier: lease_ttl must be > 0 ms, got " +
                                   std::to_string(lease_ttl.count()));
  }
  if (read_ttl.count() <= 0) {
    return Status::InvalidArgument("host tier: read_ttl must be > 0 ms, got " +
                                   std::to_string(read_ttl.count()));
  }
  if (segment_bytes % alignment != 0) {
    return Status::InvalidArgument("host tier: segment_bytes " + std::to_string(segment_bytes) +
                                   " is not a multiple of the alignment (" +
                                   std::to_string(alignment) + ")");
  }
  if (capacity_bytes != 0 && capacity_bytes < alignment) {
    return Status::InvalidArgument("host tier: capacity_bytes " + std::to_string(capacity_bytes) +
                                   " is smaller than one alignment unit (" +
                                   std::to_string(alignment) + ")");
  }
  return Status::Ok();
}

Status DiskTierOptions::Validate() const {
  if (path.empty()) return Status::InvalidArgument("disk tier: path is required");
  if (capacity_bytes == 0) return Status::InvalidArgument("disk tier: capacity_bytes must be > 0");
  if (write_buffer_bytes < (1u << 20)) {
    return Status::InvalidArgument("disk tier: write_buffer_bytes must be >= 1 MiB, got " +
                                   std::to_string(write_buffer_bytes));
  }
  if (sync_writes && !use_wal) {
    return Status::InvalidArgument("disk tier: sync_writes requires use_wal");
  }
  if (resume_interval_ms < 10) {
    return Status::InvalidArgument("disk tier: resume_interval_ms must be >= 10, got " +
                                   std::to_string(resume_interval_ms));
  }
  return Status::Ok();
}

Status TierManagerOptions::Validate() const {
  if (!(high_watermark > 0.0 && high_watermark <= 1.0)) {
    return Status::InvalidArgument("tier manager: high_watermark must be in (0, 1], got " +
                                   std::to_string(high_watermark));
  }
  if (!(low_watermark >= 0.0 && low_watermark <= high_watermark)) {
    return Status::InvalidArgument("tier manager: low_watermark must be in [0, high_watermark=" +
                                   std::to_string(high_watermark) + "], got " +
                                   std::to_string(low_watermark));
  }
  return Status::Ok();
}

}  // namespace kvd::storage
