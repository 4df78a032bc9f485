#include "loopback/loopback_transport.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>

namespace kvd::transport::loopback {

struct Domain {
  std::string name;
  std::mutex mu;
  std::condition_variable cv;                        // notified on every completion and post
  uint64_t next_endpoint = 1;                        // GUARDED_BY(mu)
  std::map<uint64_t, LoopbackTransport*> endpoints;  // GUARDED_BY(mu)
};

namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

constexpr std::string_view kAddressMagic = "KVDLOOP1:";
constexpr std::string_view kRegionMagic = "KVDLOOPR:";

std::shared_ptr<Domain> GetDomain(const std::string& name) {
  static std::mutex mu;
  static auto* domains = new std::map<std::string, std::weak_ptr<Domain>>();
  std::lock_guard<std::mutex> lock(mu);
  std::shared_ptr<Domain> d = (*domains)[name].lock();
  if (d == nullptr) {
    d = std::make_shared<Domain>();
    d->name = name;
    (*domains)[name] = d;
  }
  return d;
}

// Parses "<a>:<b>" of decimal numbers after a magic prefix; false if malformed.
bool ParseTwo(std::string_view s, uint64_t* a, uint64_t* b) {
  size_t colon = s.find(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 >= s.size()) return false;
  auto parse = [](std::string_view d, uint64_t* out) {
    if (d.empty() || d.size() > 19) return false;
    uint64_t v = 0;
    for (char c : d) {
      if (c < '0' || c > '9') return false;
      v = v * 10 + static_cast<uint64_t>(c - '0');
    }
    *out = v;
    return true;
  };
  return parse(s.substr(0, colon), a) && parse(s.substr(colon + 1), b);
}

std::string Unknown(std::string_view what, uint64_t id) {
  return "unknown " + std::string(what) + " " + std::to_string(id);
}

}  // namespace

StatusOr<std::unique_ptr<Transport>> LoopbackTransport::Create(const TransportOptions& options) {
  std::shared_ptr<Domain> domain =
      GetDomain(BackendOptionsOf<LoopbackOptions>(options).loopback_domain);
  std::lock_guard<std::mutex> lock(domain->mu);
  uint64_t endpoint = domain->next_endpoint++;
  std::unique_ptr<LoopbackTransport> t(new LoopbackTransport(domain, endpoint));
  domain->endpoints[endpoint] = t.get();
  return std::unique_ptr<Transport>(std::move(t));
}

StatusOr<std::unique_ptr<Transport>> LoopbackTransport::CreateNone(
    const TransportOptions& options) {
  // A domain of its own that no other Transport can name: Connect reaches nothing, and no
  // socket or file is opened.
  static std::atomic<uint64_t> instances{0};
  TransportOptions own = options;
  MutableBackendOptions<LoopbackOptions>(&own).loopback_domain =
      "backend none #" + std::to_string(instances.fetch_add(1));
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, Create(own));
  auto* loopback = static_cast<LoopbackTransport*>(t.get());
  loopback->caps_.backend = "none";
  loopback->caps_.rma = false;
  loopback->caps_.transports = "none";
  return t;
}

LoopbackTransport::LoopbackTransport(std::shared_ptr<Domain> domain, uint64_t endpoint)
    : domain_(std::move(domain)), endpoint_(endpoint) {
  caps_.backend = "loopback";
  caps_.host_memory = true;
  caps_.cuda_memory = false;
  caps_.tag_messages = true;
  caps_.rma = true;
  caps_.cancel_recv = true;
  caps_.peer_failure_detection = true;
  caps_.max_message_bytes = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  caps_.transports = "memcpy";
}

LoopbackTransport::~LoopbackTransport() {
  std::lock_guard<std::mutex> lock(domain_->mu);
  domain_->endpoints.erase(endpoint_);
  // Our unmatched sends wait in partners' queues: drop them. Partners that connected to us see
  // us vanish.
  for (auto& [id, other] : domain_->endpoints) {
    auto& q = other->unexpected_;
    q.erase(std::remove_if(q.begin(), q.end(),
                           [&](const Unexpected& u) { return u.src_endpoint == endpoint_; }),
            q.end());
    other->PartnerGoneLocked(endpoint_);
  }
  domain_->cv.notify_all();
}

LoopbackTransport* LoopbackTransport::EndpointLocked(uint64_t endpoint) const {
  auto it = domain_->endpoints.find(endpoint);
  return it == domain_->endpoints.end() ? nullptr : it->second;
}

void LoopbackTransport::PartnerGoneLocked(uint64_t endpoint) {
  for (auto& [peer_id, p] : peers_) {
    if (p.endpoint != endpoint || !p.failure.ok()) continue;
    p.failure = Status::Unavailable("loopback peer " + std::to_string(peer_id) +
                                    " vanished (its transport was destroyed)");
    ++peer_totals_.vanished;
    for (auto& [tid, t] : transfers_) {
      if (t.peer == peer_id && t.status.state == TransferState::kInProgress) {
        CancelLocked(tid, p.failure);
      }
    }
  }
  // Sends of the vanished endpoint waiting here are gone with it.
  unexpected_.erase(std::remove_if(unexpected_.begin(), unexpected_.end(),
                                   [&](const Unexpected& u) { return u.src_endpoint == endpoint; }),
                    unexpected_.end());
}

StatusOr<std::string> LoopbackTransport::LocalAddress() {
  return std::string(kAddressMagic) + domain_->name + ":" + std::to_string(endpoint_);
}

StatusOr<PeerHandle> LoopbackTransport::Connect(std::string_view address) {
  if (address.substr(0, kAddressMagic.size()) != kAddressMagic) {
    return Status::InvalidArgument("not a loopback transport address (" +
                                   std::to_string(address.size()) + " bytes)");
  }
  std::string_view rest = address.substr(kAddressMagic.size());
  size_t colon = rest.rfind(':');
  uint64_t endpoint = 0, unused = 0;
  if (colon == std::string_view::npos ||
      !ParseTwo("0:" + std::string(rest.substr(colon + 1)), &unused, &endpoint)) {
    return Status::InvalidArgument("malformed loopback address '" + std::string(address) + "'");
  }
  std::string_view domain = rest.substr(0, colon);
  if (domain != domain_->name) {
    return Status::InvalidArgument("loopback address of domain '" + std::string(domain) +
                                   "' but this transport is in domain '" + domain_->name + "'");
  }
  std::lock_guard<std::mutex> lock(domain_->mu);
  if (EndpointLocked(endpoint) == nullptr) {
    return Status::Unavailable("loopback endpoint " + std::to_string(endpoint) +
                               " does not exist (destroyed?)");
  }
  uint64_t id = next_id_++;
  peers_[id].endpoint = endpoint;
  ++peer_totals_.connects;
  return PeerHandle{id};
}

Status LoopbackTransport::Disconnect(PeerHandle peer) {
  std::lock_guard<std::mutex> lock(domain_->mu);
  auto it = peers_.find(peer.id);
  if (it == peers_.end()) return Status::NotFound(Unknown("peer", peer.id));
  for (auto& [tid, t] : transfers_) {
    if (t.peer == peer.id && t.status.state == TransferState::kInProgress) {
      CancelLocked(tid, Status::Cancelled("peer " + std::to_string(peer.id) + " disconnected"));
    }
  }
  for (auto r = remotes_.begin(); r != remotes_.end();) {
    r = r->second.peer == peer.id ? remotes_.erase(r) : std::next(r);
  }
  peers_.erase(it);
  ++peer_totals_.disconnects;
  domain_->cv.notify_all();
  return Status::Ok();
}

PeerCounts LoopbackTransport::peer_counts() {
  std::lock_guard<std::mutex> lock(domain_->mu);
  PeerCounts c = peer_totals_;
  c.open = peers_.size();
  return c;
}

Status LoopbackTransport::PeerStatus(PeerHandle peer) {
  std::lock_guard<std::mutex> lock(domain_->mu);
  auto it = peers_.find(peer.id);
  if (it == peers_.end()) return Status::NotFound(Unknown("peer", peer.id));
  return it->second.failure;
}

StatusOr<Region> LoopbackTransport::AllocateRegistered(size_t bytes, MemoryType type) {
  if (bytes == 0) return Status::InvalidArgument("AllocateRegistered of 0 bytes");
  if (type != MemoryType::kHost) {
    return Status::Unimplemented("loopback backend moves host memory only, not " +
                                 std::string(MemoryTypeName(type)));
  }
  // aligned_alloc needs a size that is a multiple of the alignment.
  const size_t rounded = (bytes + kRegisteredAlignment - 1) & ~(kRegisteredAlignment - 1);
  std::unique_ptr<char, FreeDeleter> mem(
      static_cast<char*>(std::aligned_alloc(kRegisteredAlignment, rounded)));
  if (mem == nullptr) {
    return Status::ResourceExhausted("cannot allocate " + std::to_string(bytes) + " bytes");
  }
  std::lock_guard<std::mutex> lock(domain_->mu);
  uint64_t id = next_id_++;
  RegionState& r = regions_[id];
  r.data = mem.get();
  r.size = bytes;
  r.owned = std::move(mem);
  return Region{RegionHandle{id}, r.data, bytes, type};
}

StatusOr<Region> LoopbackTransport::RegisterMemory(void* data, size_t bytes, MemoryType type) {
  if (data == nullptr) return Status::InvalidArgument("RegisterMemory of a null pointer");
  if (bytes == 0) return Status::InvalidArgument("RegisterMemory of 0 bytes");
  if (type != MemoryType::kHost) {
    return Status::Unimplemented("loopback backend moves host memory only, not " +
                                 std::string(MemoryTypeName(type)));
  }
  std::lock_guard<std::mutex> lock(domain_->mu);
  uint64_t id = next_id_++;
  regions_[id].data = data;
  regions_[id].size = bytes;
  return Region{RegionHandle{id}, data, bytes, type};
}

Status LoopbackTransport::DeregisterMemory(RegionHandle region) {
  std::lock_guard<std::mutex> lock(domain_->mu);
  if (regions_.erase(region.id) == 0) return Status::NotFound(Unknown("region", region.id));
  return Status::Ok();
}

StatusOr<std::string> LoopbackTransport::ExportRegion(RegionHandle region) {
  std::lock_guard<std::mutex> lock(domain_->mu);
  if (regions_.count(region.id) == 0) return Status::NotFound(Unknown("region", region.id));
  return std::string(kRegionMagic) + std::to_string(endpoint_) + ":" + std::to_string(region.id);
}

StatusOr<RemoteRegionHandle> LoopbackTransport::ImportRegion(PeerHandle peer,
                                                             std::string_view exported) {
  uint64_t endpoint = 0, region = 0;
  if (exported.substr(0, kRegionMagic.size()) != kRegionMagic ||
      !ParseTwo(exported.substr(kRegionMagic.size()), &endpoint, &region)) {
    return Status::InvalidArgument("not a loopback region export (" +
                                   std::to_string(exported.size()) + " bytes)");
  }
  std::lock_guard<std::mutex> lock(domain_->mu);
  auto p = peers_.find(peer.id);
  if (p == peers_.end()) return Status::NotFound(Unknown("peer", peer.id));
  if (!p->second.failure.ok()) return p->second.failure;
  if (p->second.endpoint != endpoint) {
    return Status::InvalidArgument("region was exported by endpoint " + std::to_string(endpoint) +
                                   ", not by peer " + std::to_string(peer.id));
  }
  uint64_t id = next_id_++;
  remotes_[id] = RemoteRegion{peer.id, endpoint, region};
  return RemoteRegionHandle{id};
}

Status LoopbackTransport::ReleaseRemoteRegion(RemoteRegionHandle remote) {
  std::lock_guard<std::mutex> lock(domain_->mu);
  if (remotes_.erase(remote.id) == 0) return Status::NotFound(Unknown("remote region", remote.id));
  return Status::Ok();
}

void LoopbackTransport::CompleteLocked(Transfer& t, TransferState state, Status status,
                                       size_t bytes) {
  t.status = {state, std::move(status), bytes};
}

void LoopbackTransport::MatchLocked(LoopbackTransport& src, uint64_t send_id, uint64_t recv_id) {
  Transfer& send = src.transfers_.at(send_id);
  Transfer& recv = transfers_.at(recv_id);
  if (send.length > recv.length) {
    CompleteLocked(recv, TransferState::kError,
                   Status::OutOfRange("recv transfer " + std::to_string(recv_id) + ": message of " +
                                      std::to_string(send.length) +
                                      " bytes is longer than the receive buffer of " +
                                      std::to_string(recv.length)),
                   0);
  } else {
    if (send.length > 0) std::memcpy(recv.buffer, send.buffer, send.length);
    CompleteLocked(recv, TransferState::kDone, Status::Ok(), send.length);
  }
  CompleteLocked(send, TransferState::kDone, Status::Ok(), send.length);
}

StatusOr<TransferHandle> LoopbackTransport::Post(const TransferRequest& r) {
  if (r.buffer == nullptr && r.length > 0) {
    return Status::InvalidArgument("TransferRequest.buffer is null but length is " +
                                   std::to_string(r.length));
  }
  if (r.memory_type != MemoryType::kHost) {
    return Status::Unimplemented("loopback backend moves host memory only");
  }
  const bool rma = r.op == TransferOp::kRead || r.op == TransferOp::kWrite;
  if (rma && r.length == 0) return Status::InvalidArgument("RMA transfer of 0 bytes");
  if (r.op != TransferOp::kRecv && !r.peer.valid()) {
    return Status::InvalidArgument(std::string(TransferOpName(r.op)) + " needs a peer");
  }
  if (!rma && r.tag > kMaxTag) {
    return Status::InvalidArgument("tag " + std::to_string(r.tag) + " is above kMaxTag (2^62-1)");
  }
  std::lock_guard<std::mutex> lock(domain_->mu);
  const Peer* peer = nullptr;
  if (r.peer.valid()) {
    auto p = peers_.find(r.peer.id);
    if (p == peers_.end()) return Status::NotFound(Unknown("peer", r.peer.id));
    if (!p->second.failure.ok()) return p->second.failure;
    peer = &p->second;
  }
  Transfer t;
  t.op = r.op;
  t.peer = r.peer.id;
  t.tag = r.tag;
  t.buffer = r.buffer;
  t.length = r.length;
  if (rma) KVD_RETURN_IF_ERROR(PostRmaLocked(t, r));
  const uint64_t id = next_id_++;
  auto& stored = transfers_[id] = std::move(t);
  if (r.op == TransferOp::kSend) {
    LoopbackTransport* dest = EndpointLocked(peer->endpoint);  // present: failure is OK
    stored.dest_endpoint = peer->endpoint;
    auto& q = dest->posted_recvs_;
    auto match = std::find_if(q.begin(), q.end(),
                              [&](uint64_t rid) { return dest->transfers_.at(rid).tag == r.tag; });
    if (match != q.end()) {
      uint64_t rid = *match;
      q.erase(match);
      dest->MatchLocked(*this, id, rid);
    } else {
      dest->unexpected_.push_back(Unexpected{endpoint_, id, r.tag});
    }
  } else if (r.op == TransferOp::kRecv) {
    auto match = std::find_if(unexpected_.begin(), unexpected_.end(),
                              [&](const Unexpected& u) { return u.tag == r.tag; });
    if (match != unexpected_.end()) {
      Unexpected u = *match;
      unexpected_.erase(match);
      MatchLocked(*EndpointLocked(u.src_endpoint), u.transfer, id);
    } else {
      posted_recvs_.push_back(id);
    }
  }
  domain_->cv.notify_all();
  return TransferHandle{id};
}

Status LoopbackTransport::PostRmaLocked(Transfer& t, const TransferRequest& r) {
  auto rit = remotes_.find(r.remote.id);
  if (rit == remotes_.end()) return Status::NotFound(Unknown("remote region", r.remote.id));
  if (rit->second.peer != r.peer.id) {
    return Status::InvalidArgument("remote region " + std::to_string(r.remote.id) +
                                   " was imported for another peer");
  }
  LoopbackTransport* owner = EndpointLocked(rit->second.endpoint);
  if (owner == nullptr) return Status::Unavailable("the region's owner vanished");
  auto reg = owner->regions_.find(rit->second.region);
  if (reg == owner->regions_.end()) {
    return Status::NotFound("remote region " + std::to_string(r.remote.id) +
                            " was deregistered by its owner");
  }
  const RegionState& rs = reg->second;
  if (r.remote_offset > rs.size || r.length > rs.size - r.remote_offset) {
    return Status::OutOfRange("RMA [" + std::to_string(r.remote_offset) + ", +" +
                              std::to_string(r.length) + ") beyond the remote region of " +
                              std::to_string(rs.size) + " bytes");
  }
  char* remote = static_cast<char*>(rs.data) + r.remote_offset;
  if (r.op == TransferOp::kRead) {
    std::memcpy(r.buffer, remote, r.length);
  } else {
    std::memcpy(remote, r.buffer, r.length);
  }
  CompleteLocked(t, TransferState::kDone, Status::Ok(), r.length);
  return Status::Ok();
}

void LoopbackTransport::CancelLocked(uint64_t id, Status why) {
  Transfer& t = transfers_.at(id);
  if (t.status.state != TransferState::kInProgress) return;
  if (t.op == TransferOp::kRecv) {
    posted_recvs_.erase(std::remove(posted_recvs_.begin(), posted_recvs_.end(), id),
                        posted_recvs_.end());
  } else if (t.op == TransferOp::kSend) {
    if (LoopbackTransport* dest = EndpointLocked(t.dest_endpoint)) {
      auto& q = dest->unexpected_;
      q.erase(std::remove_if(q.begin(), q.end(),
                             [&](const Unexpected& u) {
                               return u.src_endpoint == endpoint_ && u.transfer == id;
                             }),
              q.end());
    }
  }
  CompleteLocked(t, TransferState::kError, std::move(why), 0);
}

TransferStatus LoopbackTransport::Check(TransferHandle transfer) {
  std::lock_guard<std::mutex> lock(domain_->mu);
  auto it = transfers_.find(transfer.id);
  if (it == transfers_.end()) {
    return {TransferState::kError, Status::NotFound(Unknown("transfer", transfer.id)), 0};
  }
  return it->second.status;
}

Status LoopbackTransport::Wait(TransferHandle transfer, milliseconds timeout) {
  std::unique_lock<std::mutex> lock(domain_->mu);
  auto it = transfers_.find(transfer.id);
  if (it == transfers_.end()) return Status::NotFound(Unknown("transfer", transfer.id));
  const uint64_t id = transfer.id;
  auto finished = [&] {
    auto f = transfers_.find(id);
    return f == transfers_.end() || f->second.status.state != TransferState::kInProgress;
  };
  if (!domain_->cv.wait_for(lock, timeout, finished)) {
    return Status::DeadlineExceeded("transfer " + std::to_string(id) + " did not finish within " +
                                    std::to_string(timeout.count()) +
                                    " ms (still in flight: Wait again or Cancel)");
  }
  it = transfers_.find(id);
  if (it == transfers_.end()) return Status::NotFound(Unknown("transfer", id));  // released
  return it->second.status.state == TransferState::kDone ? Status::Ok() : it->second.status.status;
}

Status LoopbackTransport::Cancel(TransferHandle transfer) {
  std::lock_guard<std::mutex> lock(domain_->mu);
  if (transfers_.count(transfer.id) == 0) return Status::NotFound(Unknown("transfer", transfer.id));
  CancelLocked(transfer.id,
               Status::Cancelled("transfer " + std::to_string(transfer.id) + " was cancelled"));
  domain_->cv.notify_all();
  return Status::Ok();
}

Status LoopbackTransport::Release(TransferHandle transfer) {
  std::lock_guard<std::mutex> lock(domain_->mu);
  auto it = transfers_.find(transfer.id);
  if (it == transfers_.end()) return Status::NotFound(Unknown("transfer", transfer.id));
  if (it->second.status.state == TransferState::kInProgress) {
    return Status::FailedPrecondition("transfer " + std::to_string(transfer.id) +
                                      " is still in progress: Cancel and Wait before Release");
  }
  transfers_.erase(it);
  return Status::Ok();
}

Status LoopbackTransport::WaitForEvents(milliseconds timeout) {
  if (timeout.count() <= 0) return Status::Ok();
  std::unique_lock<std::mutex> lock(domain_->mu);
  if (!wake_pending_) domain_->cv.wait_for(lock, timeout);
  wake_pending_ = false;
  return Status::Ok();
}

void LoopbackTransport::Wakeup() {
  {
    std::lock_guard<std::mutex> lock(domain_->mu);
    wake_pending_ = true;
  }
  domain_->cv.notify_all();
}

}  // namespace kvd::transport::loopback
