// The bulk path over kvd's NCCL link (ClientOptions::nccl): chunk bytes move between CUDA
// device memory on both sides; their checksums are taken over host copies.
#pragma once

#include <memory>
#include <string_view>
#include <vector>

#include "kvd/client/device.h"
#include "transfer_path.h"

namespace kvd::client::internal {

class NcclPath final : public TransferPath {
 public:
  // Creates the link's transport (`options`, its backend already chosen) and joins kvd's link
  // over `client`'s channel (NcclConnect), filling `*session`'s NCCL fields. Errors: the
  // transport's, the channel's, the daemon's; INTERNAL for another reply.
  static StatusOr<std::unique_ptr<NcclPath>> Join(PathContext& client,
                                                  const transport::TransportOptions& options,
                                                  SessionInfo* session);

  // True when a put of `item`, whose data lies `data_at`, goes over the link: CUDA device
  // memory with no window queries held apart (the link sends one buffer per message).
  static bool Carries(const PutItem& item, BufferLocation data_at) {
    return data_at == BufferLocation::kCuda && item.window_queries.empty();
  }

  // Every item's data is CUDA device memory; its checksum is taken over a host copy (on its
  // stream) before the window's first Reserve.
  StatusOr<std::vector<PutResult>> PutWindow(std::span<const PutItem> items) override;

 private:
  using TransferPath::TransferPath;
  // Joined by Join: nothing to connect.
  Status EnsurePeer() override { return Status::Ok(); }
  // A request of CUDA memory (host memory for the loopback backend tests use).
  StatusOr<transport::TransferHandle> Post(transport::TransferOp op, uint64_t tag, void* buffer,
                                           size_t bytes) override;
  // The host copy's, taken by PutWindow.
  StatusOr<uint64_t> SentChecksum(size_t i, const PutItem& item) override;
  // Over a host copy of the received device bytes.
  StatusOr<uint64_t> ReceivedChecksum(const GetItem& item,
                                      const transport::TransferStatus& done) override;

  StagingBuffer host_copy_;              // pinned: each device chunk is checksummed here
  std::vector<uint64_t> put_checksums_;  // of the put window being sent
};

}  // namespace kvd::client::internal
