// The NCCL link of device-memory sessions. Private to daemon/.
//
// One NCCL transport serves the whole daemon: every engine session that sent NcclConnect is one
// peer of it (a pair of 2-rank communicators, transport/src/nccl/nccl_bootstrap.h). The link has
// its own progress thread (the transports never share one: a UCX worker and NCCL's stream polls
// progress independently) and the device memory that chunk bytes are staged in: a put's bytes
// arrive from the engine's GPU into a device staging buffer and are copied once into the host
// tier's reservation, where the commit checksum is verified over host bytes exactly as for the
// other paths; a get copies the stored chunk into a device staging buffer and sends it from there.
//
// Everything is made on the first NcclConnect (a daemon whose clients never ask needs no GPU and
// starts no NCCL); the first outcome is kept, so a daemon that cannot run NCCL refuses every
// later NcclConnect with the same UNAVAILABLE reason at once.
//
// Threading: Ensure on the io_context thread; the accessors' objects are thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "kvd/daemon/config.h"
#include "kvd/storage/device_memory.h"
#include "kvd/transport/transport.h"
#include "progress_loop.h"

namespace kvd::daemon {

class NcclLink {
 public:
  // `transport` / `memory`: ServerDeps' seams (nullptr: NCCL and CUDA on `device`).
  NcclLink(transport::TransportOptions options, int device,
           std::unique_ptr<transport::Transport> transport,
           std::unique_ptr<storage::DeviceMemory> memory);
  ~NcclLink();  // Stop()s; the transport goes after its progress thread
  NcclLink(const NcclLink&) = delete;
  NcclLink& operator=(const NcclLink&) = delete;

  // OK once the transport, the device memory and the progress thread run; the first failure is
  // kept and returned again: UNAVAILABLE "NCCL link unavailable: <why>" (kvd built without NCCL,
  // no CUDA device, NCCL failed to start).
  Status Ensure();
  // Ends the progress thread (shutdown). Idempotent.
  void Stop();

  // REQUIRES: Ensure() returned OK.
  transport::Transport* transport() { return transport_.get(); }
  ProgressLoop& progress() { return *progress_; }
  storage::DeviceMemory* memory() { return memory_.get(); }
  // The memory type of the staging buffers as the transport sees them: kCuda over NCCL; kHost
  // for a test backend that moves host memory (over a fake device memory living in host memory).
  transport::MemoryType memory_type() const {
    return transport_->capabilities().cuda_memory ? transport::MemoryType::kCuda
                                                  : transport::MemoryType::kHost;
  }
  int device() const { return device_; }

  // Device staging buffers of at least `bytes`, reused: cudaFree synchronizes the whole device
  // (it would stall the link's NCCL streams at every put), so a released buffer is kept for the
  // next put or get of a similar size (at most kCachedBuffers are kept; a buffer is reused for
  // sizes in [its size / 2, its size]). Errors: the device memory's (RESOURCE_EXHAUSTED).
  // Thread-safe. REQUIRES: Ensure() returned OK.
  static constexpr size_t kCachedBuffers = 16;
  StatusOr<void*> AcquireStaging(uint64_t bytes);
  // Gives back what AcquireStaging returned (nullptr: nothing). Thread-safe.
  void ReleaseStaging(void* staging);
  // For stats and tests: buffers lent out now, and buffers allocated on the device now.
  uint64_t staging_in_use() const;
  uint64_t staging_allocated() const;

 private:
  transport::TransportOptions options_;
  const int device_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<storage::DeviceMemory> memory_;
  std::unique_ptr<ProgressLoop> progress_;
  std::optional<Status> outcome_;
  mutable std::mutex staging_mu_;
  std::multimap<uint64_t, void*> staging_free_;       // size -> buffer; GUARDED_BY(staging_mu_)
  std::unordered_map<void*, uint64_t> staging_lent_;  // buffer -> size; GUARDED_BY(staging_mu_)
};

}  // namespace kvd::daemon
