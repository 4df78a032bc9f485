// Bulk paths over a transport::Transport (bulk_path.h): UcxPath, the client's own transport to
// kvd's worker address, and NcclPath (nccl_path.h), kvd's NCCL link.
#pragma once

#include <memory>
#include <string>

#include "bulk_path.h"
#include "kvd/client/device.h"
#include "kvd/transport/transport.h"

namespace kvd::client::internal {

class PathContext;

// A put window: one Reserve per chunk, one send per chunk to the tag of its reservation, the
// commits sent while the bytes still move (kvd's commit waits for its receive). A get window:
// one receive per chunk posted before its Get, transfers and replies driven together.
class TransferPath : public BulkPath {
 public:
  ~TransferPath() override;  // disconnects from kvd (best effort)

  StatusOr<std::vector<PutResult>> PutWindow(std::span<const PutItem> items) override;
  StatusOr<std::vector<GetResult>> GetWindow(uint64_t lease_id,
                                             std::span<const GetItem> items) override;

  transport::Transport& transport() { return *transport_; }

 protected:
  // `context` prefixes a failed transfer's error; `over_nccl` is the overNccl flag of this
  // path's Reserve and Get messages.
  TransferPath(PathContext& client, std::unique_ptr<transport::Transport> transport,
               const char* context, bool over_nccl);

  // Connects the transport to kvd unless it is (peer_). Called before every window.
  virtual Status EnsurePeer() = 0;
  // Posts a send (kSend) or receive (kRecv) of `bytes` at `buffer` with kvd under `tag`.
  virtual StatusOr<transport::TransferHandle> Post(transport::TransferOp op, uint64_t tag,
                                                   void* buffer, size_t bytes) = 0;
  // The checksum of item `i` of the put window being sent (computed while its bytes move).
  virtual StatusOr<uint64_t> SentChecksum(size_t i, const PutItem& item) = 0;
  // The checksum of the bytes received into `item`'s buffer, `done` being its transfer's end.
  virtual StatusOr<uint64_t> ReceivedChecksum(const GetItem& item,
                                              const transport::TransferStatus& done) = 0;

  PathContext& client_;
  std::unique_ptr<transport::Transport> transport_;
  transport::PeerHandle peer_;  // kvd on the transport; invalid until connected

 private:
  struct PendingGet;
  // Posts every item's receive, then sends its Get. On failure drops what was posted.
  Status PostGets(uint64_t lease_id, std::span<const GetItem> items, std::vector<PendingGet>& gets);
  // Drives the transfers and replies until every get has both (or failed), bounded by
  // transfer_timeout_ms.
  void AwaitGets(std::span<const GetItem> items, std::vector<PendingGet>& gets);
  // One look at get `g`: its transfer's state, then its reply. True once it is finished.
  bool StepGet(const GetItem& item, PendingGet& g);
  // Releases every transfer and reads every reply into the results.
  StatusOr<std::vector<GetResult>> FinishGets(uint64_t lease_id, std::span<const GetItem> items,
                                              std::vector<PendingGet>& gets);
  // Phase 2 of a put window: posts the send of every reserved chunk and checksums it while its
  // bytes move. On failure returns it (the posted sends stay in `sends`).
  Status PostSends(std::span<const PutItem> items, const std::vector<PutResult>& out,
                   const std::vector<uint64_t>& tag, std::vector<transport::TransferHandle>& sends,
                   std::vector<uint64_t>& checksum);
  // Waits for every posted send (dropping them instead once `*first_error` is set); the first
  // failure goes to `*first_error`.
  void FinishSends(std::vector<transport::TransferHandle>& sends, Status* first_error);
  // Waits for `transfer` while watching the control connection, bounded by
  // transfer_timeout_ms; cancelled on failure, always released.
  Status Finish(transport::TransferHandle transfer);
  // Cancels, waits (bounded) and releases a transfer; best effort.
  void Drop(transport::TransferHandle transfer);

  const char* const context_;
  const bool over_nccl_;
};

// The client's own transport (ClientOptions::transport; UCX unless configured otherwise),
// connected to kvd's worker address on the first window, so that a session moving no bytes
// over it holds no endpoint to kvd.
class UcxPath final : public TransferPath {
 public:
  static StatusOr<std::unique_ptr<UcxPath>> Create(PathContext& client,
                                                   const transport::TransportOptions& options);
  // kvd's worker address (HelloReply.workerAddress).
  void set_daemon_address(std::string address) { daemon_address_ = std::move(address); }

  // Data in CUDA device memory, and window queries held apart, are staged in one host buffer
  // per item first (the transport sends one host buffer per put).
  StatusOr<std::vector<PutResult>> PutWindow(std::span<const PutItem> items) override;
  // CUDA device buffers receive in host staging; the bytes go to the device (on the item's
  // stream) once the window's checksums were verified.
  StatusOr<std::vector<GetResult>> GetWindow(uint64_t lease_id,
                                             std::span<const GetItem> items) override;

 private:
  using TransferPath::TransferPath;
  // Connects to kvd's worker address on the first window.
  Status EnsurePeer() override;
  // A receive asks the transport for the checksum of what it wrote (want_checksum).
  StatusOr<transport::TransferHandle> Post(transport::TransferOp op, uint64_t tag, void* buffer,
                                           size_t bytes) override;
  // Over the item's host bytes (PutChunks staged device bytes in host memory).
  StatusOr<uint64_t> SentChecksum(size_t i, const PutItem& item) override;
  // The transport's where it took one, else over the received bytes.
  StatusOr<uint64_t> ReceivedChecksum(const GetItem& item,
                                      const transport::TransferStatus& done) override;

  // Copies `it`'s data and window queries into `staging` and points `it` at the copy.
  static Status Stage(PutItem& it, bool data_on_device, StagingBuffer& staging);

  std::string daemon_address_;
  // Host staging, one buffer per item of a window, pinned for device copies; reused window
  // after window (every transfer of a window ends before the next one starts).
  std::vector<StagingBuffer> put_staging_;
  std::vector<StagingBuffer> get_staging_;
};

}  // namespace kvd::client::internal
