#include "kvd/transport/fault_injection.h"

#include <utility>

namespace kvd::transport {

FaultInjectingTransport::FaultInjectingTransport(std::unique_ptr<Transport> inner, FaultPlan plan)
    : inner_(std::move(inner)), plan_(std::move(plan)) {}

FaultInjectingTransport::~FaultInjectingTransport() = default;

void FaultInjectingTransport::SetPlan(FaultPlan plan) {
  std::lock_guard<std::mutex> lock(mu_);
  plan_ = std::move(plan);
}

int64_t FaultInjectingTransport::post_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return posts_;
}

StatusOr<PeerHandle> FaultInjectingTransport::Connect(std::string_view peer_address) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!plan_.connect_failure.ok()) return plan_.connect_failure;
  }
  KVD_ASSIGN_OR_RETURN(PeerHandle peer, inner_->Connect(peer_address));
  std::lock_guard<std::mutex> lock(mu_);
  peers_[peer.id];
  return peer;
}

Status FaultInjectingTransport::Disconnect(PeerHandle peer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer.id);
    if (it != peers_.end()) {
      for (uint64_t id : it->second.in_flight) transfer_peer_.erase(id);
      peers_.erase(it);
    }
  }
  return inner_->Disconnect(peer);
}

Status FaultInjectingTransport::PeerStatus(PeerHandle peer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer.id);
    if (it != peers_.end() && it->second.vanished) {
      return Status::Unavailable("injected fault: peer " + std::to_string(peer.id) + " vanished");
    }
  }
  return inner_->PeerStatus(peer);
}

Status FaultInjectingTransport::VanishPeer(PeerHandle peer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer.id);
  if (it == peers_.end()) return Status::NotFound("unknown peer " + std::to_string(peer.id));
  VanishLocked(peer, it->second);
  return Status::Ok();
}

void FaultInjectingTransport::VanishLocked(PeerHandle peer, PeerFaultState& state) {
  state.vanished = true;
  for (uint64_t id : state.in_flight) {
    vanished_transfers_.insert(id);
    inner_->Cancel(TransferHandle{id}).IgnoreError();
  }
  state.in_flight.clear();
}

TransferHandle FaultInjectingTransport::InjectLocked(Status status) {
  uint64_t id = kInjectedBit | next_injected_++;
  injected_[id] = std::move(status);
  return TransferHandle{id};
}

StatusOr<RemoteRegionHandle> FaultInjectingTransport::ImportRegion(PeerHandle peer,
                                                                   std::string_view exported) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer.id);
    if (it != peers_.end() && it->second.vanished) {
      return Status::Unavailable("injected fault: peer " + std::to_string(peer.id) + " vanished");
    }
  }
  return inner_->ImportRegion(peer, exported);
}

StatusOr<TransferHandle> FaultInjectingTransport::Post(const TransferRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
  ++posts_;
  if (plan_.fail_post_number > 0 && posts_ == plan_.fail_post_number) return plan_.post_failure;
  PeerFaultState* state = nullptr;
  if (request.peer.valid()) {
    auto it = peers_.find(request.peer.id);
    if (it != peers_.end()) state = &it->second;
  }
  if (state != nullptr) {
    const Status vanished =
        Status::Unavailable("injected fault: peer " + std::to_string(request.peer.id) +
                            " vanished after " + std::to_string(state->bytes_posted) + " bytes");
    if (state->vanished) return vanished;
    if (plan_.vanish_after_bytes >= 0 &&
        state->bytes_posted + static_cast<int64_t>(request.length) > plan_.vanish_after_bytes) {
      VanishLocked(request.peer, *state);
      return InjectLocked(vanished);
    }
  }
  KVD_ASSIGN_OR_RETURN(TransferHandle h, inner_->Post(request));
  if (request.op == TransferOp::kRecv && ++recvs_ == plan_.corrupt_recv_number) {
    to_corrupt_[h.id] = request.buffer;
  }
  if (state != nullptr) {
    state->bytes_posted += static_cast<int64_t>(request.length);
    state->in_flight.insert(h.id);
    transfer_peer_[h.id] = request.peer.id;
  }
  return h;
}

TransferStatus FaultInjectingTransport::Check(TransferHandle transfer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto inj = injected_.find(transfer.id);
    if (inj != injected_.end()) return {TransferState::kError, inj->second, 0};
  }
  TransferStatus s = inner_->Check(transfer);
  std::lock_guard<std::mutex> lock(mu_);
  CorruptLocked(transfer.id, s);
  if (vanished_transfers_.count(transfer.id) != 0 && s.state != TransferState::kInProgress) {
    auto p = transfer_peer_.find(transfer.id);
    uint64_t peer = p == transfer_peer_.end() ? 0 : p->second;
    return {TransferState::kError,
            Status::Unavailable("injected fault: peer " + std::to_string(peer) +
                                " vanished during the transfer"),
            0};
  }
  if (s.state != TransferState::kInProgress) {
    auto p = transfer_peer_.find(transfer.id);
    if (p != transfer_peer_.end()) {
      auto st = peers_.find(p->second);
      if (st != peers_.end()) st->second.in_flight.erase(transfer.id);
    }
  }
  return s;
}

void FaultInjectingTransport::CorruptLocked(uint64_t transfer_id, TransferStatus& status) {
  if (status.state != TransferState::kDone || status.bytes == 0) return;
  auto it = to_corrupt_.find(transfer_id);
  if (it == to_corrupt_.end()) return;
  static_cast<uint8_t*>(it->second)[status.bytes / 2] ^= 0x5a;
  status.checksum_valid = false;
  to_corrupt_.erase(it);
}

Status FaultInjectingTransport::Wait(TransferHandle transfer, std::chrono::milliseconds timeout) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto inj = injected_.find(transfer.id);
    if (inj != injected_.end()) return inj->second;
  }
  Status s = inner_->Wait(transfer, timeout);
  if (s.code() == StatusCode::kDeadlineExceeded || s.code() == StatusCode::kNotFound) return s;
  TransferStatus c = Check(transfer);  // applies the vanish rewrite
  return c.state == TransferState::kDone ? Status::Ok() : c.status;
}

Status FaultInjectingTransport::Cancel(TransferHandle transfer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (injected_.count(transfer.id) != 0) return Status::Ok();
  }
  return inner_->Cancel(transfer);
}

Status FaultInjectingTransport::Release(TransferHandle transfer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (injected_.erase(transfer.id) != 0) return Status::Ok();
  }
  KVD_RETURN_IF_ERROR(inner_->Release(transfer));
  std::lock_guard<std::mutex> lock(mu_);
  to_corrupt_.erase(transfer.id);
  vanished_transfers_.erase(transfer.id);
  auto p = transfer_peer_.find(transfer.id);
  if (p != transfer_peer_.end()) {
    auto st = peers_.find(p->second);
    if (st != peers_.end()) st->second.in_flight.erase(transfer.id);
    transfer_peer_.erase(p);
  }
  return Status::Ok();
}

}  // namespace kvd::transport
