// A Transport decorator that injects faults, the seam for failure tests of the daemon and client:
// "the Nth post fails", "the peer vanishes after K bytes", "connect fails".
//
// Everything not faulted is forwarded to the wrapped Transport unchanged (same handles). Faulted
// transfers get handles of their own (high bit set) that Check/Wait/Cancel/Release understand.
// Thread-safe like every Transport.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "kvd/transport/transport.h"

namespace kvd::transport {

struct FaultPlan {
  // The 1-based number of the Post call that fails with `post_failure` without reaching the
  // wrapped Transport (counting every Post through this decorator). 0 (default) = never.
  int64_t fail_post_number = 0;
  Status post_failure = Status::Unavailable("injected fault: post failed");

  // Per peer: once the lengths of transfers posted with that peer would pass this many bytes,
  // the peer "vanishes": the crossing Post and every later Post with it fail with UNAVAILABLE
  // (as a handle in kError, like a UCX peer failure seen after posting), its in-flight
  // transfers are cancelled in the wrapped Transport and report UNAVAILABLE, and PeerStatus says
  // UNAVAILABLE. Transfers posted with kAnyPeer are not counted. -1 (default) = never.
  int64_t vanish_after_bytes = -1;

  // When not OK, Connect returns it without reaching the wrapped Transport. Default OK.
  Status connect_failure;

  // The 1-based number of the kRecv Post (counting receives through this decorator) whose bytes
  // arrive damaged: when it finishes with bytes, one byte of them is flipped in the buffer (and
  // checksum_valid is cleared, so the caller hashes what is there), as if damaged on the wire.
  // 0 (default) = never.
  int64_t corrupt_recv_number = 0;
};

class FaultInjectingTransport : public Transport {
 public:
  // REQUIRES: inner != nullptr.
  FaultInjectingTransport(std::unique_ptr<Transport> inner, FaultPlan plan);
  ~FaultInjectingTransport() override;

  // Replaces the plan (counters are kept). Thread-safe.
  void SetPlan(FaultPlan plan);
  // Posts seen so far (including failed ones).
  int64_t post_count() const;
  // Makes `peer` vanish now (as if vanish_after_bytes were reached). NOT_FOUND if unknown.
  Status VanishPeer(PeerHandle peer);
  Transport* inner() { return inner_.get(); }

  const Capabilities& capabilities() const override { return inner_->capabilities(); }
  StatusOr<std::string> LocalAddress() override { return inner_->LocalAddress(); }
  StatusOr<PeerHandle> Connect(std::string_view peer_address) override;
  Status Disconnect(PeerHandle peer) override;
  Status PeerStatus(PeerHandle peer) override;
  // The wrapped Transport's counts (a VanishPeer is not counted there: it is an injected fault).
  PeerCounts peer_counts() override { return inner_->peer_counts(); }
  StatusOr<std::string> PeerBootstrap(PeerHandle peer) override {
    return inner_->PeerBootstrap(peer);
  }
  StatusOr<Region> AllocateRegistered(size_t bytes, MemoryType type) override {
    return inner_->AllocateRegistered(bytes, type);
  }
  StatusOr<Region> RegisterMemory(void* data, size_t bytes, MemoryType type) override {
    return inner_->RegisterMemory(data, bytes, type);
  }
  Status DeregisterMemory(RegionHandle region) override { return inner_->DeregisterMemory(region); }
  StatusOr<std::string> ExportRegion(RegionHandle region) override {
    return inner_->ExportRegion(region);
  }
  StatusOr<RemoteRegionHandle> ImportRegion(PeerHandle peer, std::string_view exported) override;
  Status ReleaseRemoteRegion(RemoteRegionHandle remote) override {
    return inner_->ReleaseRemoteRegion(remote);
  }
  StatusOr<TransferHandle> Post(const TransferRequest& request) override;
  TransferStatus Check(TransferHandle transfer) override;
  Status Wait(TransferHandle transfer, std::chrono::milliseconds timeout) override;
  Status Cancel(TransferHandle transfer) override;
  Status Release(TransferHandle transfer) override;
  int Progress() override { return inner_->Progress(); }
  Status WaitForEvents(std::chrono::milliseconds timeout) override {
    return inner_->WaitForEvents(timeout);
  }
  void Wakeup() override { inner_->Wakeup(); }

 private:
  static constexpr uint64_t kInjectedBit = uint64_t{1} << 63;
  struct PeerFaultState {
    int64_t bytes_posted = 0;
    bool vanished = false;
    std::set<uint64_t> in_flight;  // inner transfer ids posted with this peer
  };
  // REQUIRES: mu_ held.
  void VanishLocked(PeerHandle peer, PeerFaultState& state);
  TransferHandle InjectLocked(Status status);
  // REQUIRES: mu_ held. Damages the bytes of a finished receive chosen by corrupt_recv_number.
  void CorruptLocked(uint64_t transfer_id, TransferStatus& status);

  std::unique_ptr<Transport> inner_;
  mutable std::mutex mu_;
  FaultPlan plan_;                              // GUARDED_BY(mu_)
  int64_t posts_ = 0;                           // GUARDED_BY(mu_)
  int64_t recvs_ = 0;                           // GUARDED_BY(mu_)
  std::map<uint64_t, void*> to_corrupt_;        // inner receive id -> buffer; GUARDED_BY(mu_)
  std::map<uint64_t, PeerFaultState> peers_;    // GUARDED_BY(mu_)
  std::map<uint64_t, uint64_t> transfer_peer_;  // inner transfer id -> peer id; GUARDED_BY(mu_)
  std::set<uint64_t> vanished_transfers_;       // inner ids failed by a vanish; GUARDED_BY(mu_)
  std::map<uint64_t, Status> injected_;         // injected handle id -> status; GUARDED_BY(mu_)
  uint64_t next_injected_ = 1;                  // GUARDED_BY(mu_)
};

}  // namespace kvd::transport
