// kvd's chunk checksum (kvd::Checksum64, xxh3-64 with seed 0 and the default secret) of bytes in
// CUDA device memory, computed on the device: a put or get that moves device memory (UCX with
// CUDA, NCCL) can be verified without copying the chunk to the host.
//
// How: xxh3's long-input loop adds each 64-byte stripe's contribution into 8 lane accumulators
// and scrambles them after every 1 KiB block. Within a block the additions commute (mod 2^64), so
// the device first computes every block's 8 lane sums in parallel (one CUDA block per 1 KiB), then
// 8 threads fold the sums in order (add, scramble), and one thread does the tail (the partial
// last block and the last stripe) and the final merge. Checksum64Blocked is the same
// decomposition on the CPU (the twin, equal to Checksum64 for every length; tested everywhere).
// No floating point anywhere: results are bit-exact.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvd/common/status.h"

namespace kvd::kernels {

// Checksum64(data, bytes) computed the device's way on the CPU.
uint64_t Checksum64Blocked(const void* data, size_t bytes);

// Checksum64 of [device_data, device_data + bytes), REQUIRES device memory of the current CUDA
// device (or bytes == 0). Queued on `cuda_stream` (a cudaStream_t; nullptr = the default stream)
// after the caller's earlier work, then waited for. Inputs of at most 240 bytes (xxh3's short
// forms) are copied to the host and hashed there. Errors: UNIMPLEMENTED in a build without CUDA,
// UNAVAILABLE without a device, the CUDA error of a failed launch or copy.
StatusOr<uint64_t> DeviceChecksum64(const void* device_data, size_t bytes,
                                    void* cuda_stream = nullptr);

}  // namespace kvd::kernels
