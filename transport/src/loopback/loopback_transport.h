// The in-process loopback backend: Transports of one process that share a domain name connect to
// each other and move bytes with memcpy. Same contract as UCX (tag matching in post order,
// truncation -> OUT_OF_RANGE on the receiver, a destroyed peer fails its partners' transfers
// with UNAVAILABLE), so daemon and client logic can be unit-tested without UCX.
//
// Semantics a test can rely on: a send completes when a receive has taken its bytes (rendezvous:
// an unmatched send stays kInProgress and can be Cancelled); Post does the copy inline, so
// Progress() always returns 0. All Transports of a domain share one mutex.
#pragma once

#include <cstdlib>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvd/transport/loopback_options.h"
#include "kvd/transport/transport.h"

namespace kvd::transport::loopback {

struct Domain;

class LoopbackTransport final : public Transport {
 public:
  static StatusOr<std::unique_ptr<Transport>> Create(const TransportOptions& options);
  // Backend "none": no bulk transport. A loopback transport alone in a domain of its own
  // (Connect reaches nothing, nothing listens); Capabilities::backend "none", no RMA.
  static StatusOr<std::unique_ptr<Transport>> CreateNone(const TransportOptions& options);
  ~LoopbackTransport() override;

  const Capabilities& capabilities() const override { return caps_; }
  StatusOr<std::string> LocalAddress() override;
  StatusOr<PeerHandle> Connect(std::string_view peer_address) override;
  Status Disconnect(PeerHandle peer) override;
  Status PeerStatus(PeerHandle peer) override;
  PeerCounts peer_counts() override;
  StatusOr<Region> AllocateRegistered(size_t bytes, MemoryType type) override;
  StatusOr<Region> RegisterMemory(void* data, size_t bytes, MemoryType type) override;
  Status DeregisterMemory(RegionHandle region) override;
  StatusOr<std::string> ExportRegion(RegionHandle region) override;
  StatusOr<RemoteRegionHandle> ImportRegion(PeerHandle peer, std::string_view exported) override;
  Status ReleaseRemoteRegion(RemoteRegionHandle remote) override;
  StatusOr<TransferHandle> Post(const TransferRequest& request) override;
  TransferStatus Check(TransferHandle transfer) override;
  Status Wait(TransferHandle transfer, std::chrono::milliseconds timeout) override;
  Status Cancel(TransferHandle transfer) override;
  Status Release(TransferHandle transfer) override;
  int Progress() override { return 0; }
  Status WaitForEvents(std::chrono::milliseconds timeout) override;
  void Wakeup() override;

 private:
  struct Peer {
    uint64_t endpoint = 0;  // the partner's endpoint id in the domain
    Status failure;
  };
  struct Transfer {
    TransferOp op = TransferOp::kSend;
    uint64_t peer = 0;
    uint64_t tag = 0;
    void* buffer = nullptr;
    size_t length = 0;
    uint64_t dest_endpoint = 0;  // kSend: where it waits unmatched
    TransferStatus status;
  };
  struct Unexpected {  // a send waiting in this endpoint for a matching receive
    uint64_t src_endpoint = 0;
    uint64_t transfer = 0;
    uint64_t tag = 0;
  };
  struct FreeDeleter {
    void operator()(char* p) const { std::free(p); }
  };
  struct RegionState {
    void* data = nullptr;
    size_t size = 0;
    std::unique_ptr<char, FreeDeleter> owned;  // aligned_alloc'ed (AllocateRegistered only)
  };
  struct RemoteRegion {
    uint64_t peer = 0;
    uint64_t endpoint = 0;
    uint64_t region = 0;
  };

  LoopbackTransport(std::shared_ptr<Domain> domain, uint64_t endpoint);
  // All below REQUIRE domain_->mu held.
  LoopbackTransport* EndpointLocked(uint64_t endpoint) const;
  void CompleteLocked(Transfer& t, TransferState state, Status status, size_t bytes);
  void MatchLocked(LoopbackTransport& src, uint64_t send_id, uint64_t recv_id);
  Status PostRmaLocked(Transfer& t, const TransferRequest& r);
  void PartnerGoneLocked(uint64_t endpoint);
  void CancelLocked(uint64_t id, Status why);

  std::shared_ptr<Domain> domain_;
  const uint64_t endpoint_;
  Capabilities caps_;
  // GUARDED_BY(domain_->mu):
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, Peer> peers_;
  PeerCounts peer_totals_;  // connects, disconnects, vanished
  std::unordered_map<uint64_t, Transfer> transfers_;
  bool wake_pending_ = false;  // a Wakeup not yet consumed by WaitForEvents
  std::unordered_map<uint64_t, RegionState> regions_;
  std::unordered_map<uint64_t, RemoteRegion> remotes_;
  std::deque<uint64_t> posted_recvs_;  // unmatched receive ids, in post order
  std::deque<Unexpected> unexpected_;  // unmatched sends aimed here, in arrival order
};

}  // namespace kvd::transport::loopback
