// GpuTier: chunks in ONE device allocation, sub-allocated with ArenaAllocator, above the host
// tier (TierManager places new chunks here when the node has a GPU, demotes the least recently
// used ones to host under pressure and promotes host chunks back on a hit).
//
// The tier copies whole chunks in and out through a DeviceMemory (device_memory.h): Insert and
// ReadInto take host bytes; InsertFromDevice and ReadIntoDevice move device bytes without a host
// round trip (for engines and kernels that keep KV on the GPU). A read pins its chunk while the
// copy runs without the tier's lock; Remove of a pinned chunk fails, Evict hides it and frees its
// space at the last unpin (like the host tier).
//
// It never drops a chunk on its own: an Insert that finds no free block large enough fails with
// RESOURCE_EXHAUSTED (the chunk may have no other copy; TierManager demotes to host first and
// retries). Checksums: Insert verifies Checksum64 of the host bytes before storing; ReadInto
// verifies the bytes it copied out (DATA_LOSS drops the chunk) unless verify_checksums is off.
// The device paths (InsertFromDevice, ReadIntoDevice) trust the checksum the caller passes and
// do not verify (that needs a device checksum kernel: not written yet).
//
// Thread safety: thread-safe (one mutex for the index; copies run outside it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvd/common/clock.h"
#include "kvd/common/status.h"
#include "kvd/storage/device_memory.h"
#include "kvd/storage/tier.h"

namespace kvd::storage {

struct GpuTierOptions {
  // Bytes of the one device allocation (the topology's tiers.gpu.capacity). Required (> 0).
  uint64_t capacity_bytes = 0;
  // Alignment of every chunk's offset and size in the allocation (power of two, 8..1 MiB;
  // default 256, what CUDA kernels like for vector loads).
  uint64_t alignment = 256;
  // Largest single chunk accepted (bytes); 0 (default) = up to capacity.
  uint64_t max_chunk_bytes = 0;
  // Verify Checksum64 of the bytes ReadInto copied to host. Default true.
  bool verify_checksums = true;

  // INVALID_ARGUMENT naming the first bad field.
  Status Validate() const;
};

class GpuTier final : public Tier {
 public:
  // Allocates options.capacity_bytes through `device` (owned). Errors: INVALID_ARGUMENT
  // (options), the device's Allocate errors (RESOURCE_EXHAUSTED with the free bytes).
  static StatusOr<std::unique_ptr<GpuTier>> Create(const GpuTierOptions& options,
                                                   std::unique_ptr<DeviceMemory> device,
                                                   Clock* clock = nullptr);
  ~GpuTier() override;
  GpuTier(const GpuTier&) = delete;
  GpuTier& operator=(const GpuTier&) = delete;

  // ---- Tier (see tier.h; Insert never evicts, see the file comment) ----
  TierKind kind() const override { return TierKind::kGpu; }
  Status Insert(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                std::span<const std::byte> bytes) override;
  StatusOr<ChunkMeta> ReadInto(const ChunkKey& key, std::span<std::byte> out) override;
  StatusOr<ChunkMeta> Describe(const ChunkKey& key) const override;
  Status Remove(const ChunkKey& key) override;
  std::vector<ChunkMeta> List(const ChunkFilter& filter, size_t limit) const override;
  EvictResult Evict(const ChunkFilter& filter) override;
  TierStats GetStats() const override;
  void SetEventListener(ChunkEventListener* listener) override;

  // ---- device-resident paths ----
  // Insert's contract with `device_src` a device pointer of this tier's device (copied on the
  // device). The checksum is recorded, not verified.
  Status InsertFromDevice(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                          const void* device_src, uint64_t bytes) override;
  // ReadInto's contract into device memory (`capacity` bytes at `device_dst`); not verified.
  StatusOr<ChunkMeta> ReadIntoDevice(const ChunkKey& key, void* device_dst, uint64_t capacity);

  // ---- placement queries (tier.h) ----
  bool Contains(const ChunkKey& key) const override;
  // Counts one lookup of `key`: a hit (true, the chunk becomes most recently used) or a miss.
  bool Touch(const ChunkKey& key) override;
  // Up to `max_chunks` unpinned chunks, least recently used first.
  std::vector<ChunkMeta> LeastRecentlyUsed(size_t max_chunks) const override;
  // Allocated bytes (incl. alignment padding) / capacity, in [0, 1].
  double Occupancy() const override;
  // Whether a chunk of `bytes` fits now without demoting anything.
  bool HasRoomFor(uint64_t bytes) const override;
  // Whether a chunk of `bytes` could be held at all: 1..max_chunk_bytes (when set) and, rounded
  // up to the alignment, within the capacity. False means demoting makes no room for it.
  bool CanEverHold(uint64_t bytes) const override;
  // Counts a chunk moved down to host (TierManager's demotion) as an eviction.
  void CountDemotion() override;

  std::string device_name() const;
  uint64_t capacity_bytes() const;

 private:
  class Impl;
  explicit GpuTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvd::storage
