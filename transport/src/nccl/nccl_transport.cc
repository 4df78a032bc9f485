// NcclTransport (see nccl_transport.h). Compiled in full only with KVD_HAVE_NCCL.
#include "nccl/nccl_transport.h"

#include <string>

#include "nccl/nccl_bootstrap.h"

#if KVD_HAVE_NCCL
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>

#include "kvd/common/cuda_runtime.h"
#include "nccl/nccl_api.h"
#endif

namespace kvd::transport::nccl {

#if !KVD_HAVE_NCCL

std::string NcclUnavailableReason(int) {
  return "built without NCCL (needs CUDA and libnccl next to it, e.g. /usr/local/cuda)";
}
StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const TransportOptions& options) {
  return Status::Unavailable(
      NcclUnavailableReason(BackendOptionsOf<NcclOptions>(options).nccl_device));
}

#else

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kHeaderBytes = 16;  // {tag, length}

// NCCL's table: only after CreateNcclTransport loaded it.
const NcclApi& Nccl() { return **LoadNccl(); }

Status CudaErr(cudaError_t e, const std::string& what) { return CudaErrorStatus(e, what); }
Status NcclErr(ncclResult_t r, const std::string& what) {
  std::string msg = what + ": " + Nccl().GetErrorString(r);
  if (const char* last = Nccl().GetLastError(nullptr); last != nullptr && *last != '\0') {
    msg += " (" + std::string(last) + ")";
  }
  if (r == ncclRemoteError || r == ncclSystemError) return Status::Unavailable(msg);
  if (r == ncclInvalidUsage || r == ncclInvalidArgument) return Status::InvalidArgument(msg);
  return Status::Internal(msg);
}

uint64_t BootHostId() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(f, id);
  return id.empty() ? 0 : std::hash<std::string>{}(id);
}

class NcclTransport final : public Transport {
 public:
  explicit NcclTransport(const NcclOptions& o) : options_(o) {}
  ~NcclTransport() override {
    std::lock_guard<std::mutex> lock(mu_);
    Cudart().SetDevice(options_.nccl_device);
    for (auto& [id, p] : peers_) ClosePeerLocked(*p);
    for (auto& [id, r] : regions_) {
      if (r.owned) Cudart().Free(r.data);
    }
  }

  Status Init() {
    cudaError_t e = Cudart().SetDevice(options_.nccl_device);
    if (e != cudaSuccess)
      return CudaErr(e, "cudaSetDevice(" + std::to_string(options_.nccl_device) + ")");
    int version = 0;
    Nccl().GetVersion(&version);
    std::random_device rd;
    uuid_ = (uint64_t{rd()} << 32 | rd()) | 1;
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    address_ = EncodeAddress({uuid_, BootHostId(), options_.nccl_device, host});
    caps_.backend = "nccl";
    caps_.host_memory = false;
    caps_.cuda_memory = true;
    caps_.tag_messages = true;
    caps_.rma = false;
    caps_.cancel_recv = true;
    caps_.peer_failure_detection = true;
    caps_.max_message_bytes = uint64_t{1} << 40;
    caps_.transports = "nccl p2p";
    caps_.library = "NCCL " + std::to_string(version / 10000) + "." +
                    std::to_string(version / 100 % 100) + "." + std::to_string(version % 100);
    return Status::Ok();
  }

  const Capabilities& capabilities() const override { return caps_; }
  StatusOr<std::string> LocalAddress() override { return address_; }

  StatusOr<PeerHandle> Connect(std::string_view bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    Cudart().SetDevice(options_.nccl_device);
    auto peer = std::make_unique<Peer>();
    ncclUniqueId ids[2];
    if (bytes.substr(0, kAddressMagic.size()) == kAddressMagic) {
      KVD_ASSIGN_OR_RETURN(NcclAddress a, DecodeAddress(bytes));
      if (a.uuid == uuid_) return Status::InvalidArgument("nccl: Connect to this transport itself");
      peer->connector = true;
      NcclBootstrap b;
      b.from_uuid = uuid_;
      b.to_uuid = a.uuid;
      for (int d = 0; d < 2; ++d) {
        ncclResult_t r = Nccl().GetUniqueId(&ids[d]);
        if (r != ncclSuccess) return NcclErr(r, "ncclGetUniqueId");
      }
      std::memcpy(b.forward.data(), ids[0].internal, kUniqueIdBytes);
      std::memcpy(b.backward.data(), ids[1].internal, kUniqueIdBytes);
      peer->bootstrap = EncodeBootstrap(b);
    } else if (bytes.substr(0, kBootstrapMagic.size()) == kBootstrapMagic) {
      KVD_ASSIGN_OR_RETURN(NcclBootstrap b, DecodeBootstrap(bytes));
      if (b.to_uuid != uuid_) {
        return Status::InvalidArgument("nccl bootstrap bytes are meant for another transport");
      }
      std::memcpy(ids[0].internal, b.forward.data(), kUniqueIdBytes);
      std::memcpy(ids[1].internal, b.backward.data(), kUniqueIdBytes);
    } else {
      return Status::InvalidArgument(
          "nccl Connect needs a peer's LocalAddress (KVDNCCL1...) or its PeerBootstrap bytes "
          "(KVDNCCLB...), got " +
          std::to_string(bytes.size()) + " other bytes");
    }
    // comms[0]: connector sends, acceptor receives; comms[1]: the other way. Rank 0 = connector.
    const int rank = peer->connector ? 0 : 1;
    for (int d = 0; d < 2; ++d) {
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;  // join in the background; Progress polls ncclCommGetAsyncError
      ncclResult_t r = Nccl().CommInitRankConfig(&peer->comms[d], 2, ids[d], rank, &config);
      if (r != ncclSuccess && r != ncclInProgress) {
        ClosePeerLocked(*peer);
        return NcclErr(r, "ncclCommInitRankConfig");
      }
    }
    for (cudaStream_t* s : {&peer->send_stream, &peer->recv_stream}) {
      cudaError_t e = Cudart().StreamCreateWithFlags(s, cudaStreamNonBlocking);
      if (e != cudaSuccess) {
        ClosePeerLocked(*peer);
        return CudaErr(e, "cudaStreamCreate");
      }
    }
    Cudart().EventCreateWithFlags(&peer->send_event, cudaEventDisableTiming);
    Cudart().EventCreateWithFlags(&peer->recv_event, cudaEventDisableTiming);
    Cudart().Malloc(reinterpret_cast<void**>(&peer->d_headers), 2 * kHeaderBytes);
    Cudart().MallocHost(reinterpret_cast<void**>(&peer->h_headers), 2 * kHeaderBytes);
    peer->deadline = Clock::now() + std::chrono::milliseconds(options_.nccl_init_timeout_ms);
    const uint64_t id = next_id_++;
    peers_[id] = std::move(peer);
    ++peer_totals_.connects;
    WakeLocked();  // a pair to form: the progress thread polls again
    return PeerHandle{id};
  }

  StatusOr<std::string> PeerBootstrap(PeerHandle peer) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer.id);
    if (it == peers_.end()) return Status::NotFound("unknown peer " + std::to_string(peer.id));
    return it->second->bootstrap;
  }

  Status Disconnect(PeerHandle peer) override {
    std::lock_guard<std::mutex> lock(mu_);
    Cudart().SetDevice(options_.nccl_device);
    auto it = peers_.find(peer.id);
    if (it == peers_.end()) return Status::NotFound("unknown peer " + std::to_string(peer.id));
    it->second->disconnecting = true;  // not counted as vanished
    FailPeerLocked(peer.id, Status::Cancelled("peer disconnected"));
    ClosePeerLocked(*it->second);
    peers_.erase(it);
    ++peer_totals_.disconnects;
    return Status::Ok();
  }

  PeerCounts peer_counts() override {
    std::lock_guard<std::mutex> lock(mu_);
    PeerCounts c = peer_totals_;
    c.open = peers_.size();
    return c;
  }

  Status PeerStatus(PeerHandle peer) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer.id);
    if (it == peers_.end()) return Status::NotFound("unknown peer " + std::to_string(peer.id));
    return it->second->failure;
  }

  StatusOr<Region> AllocateRegistered(size_t bytes, MemoryType type) override {
    if (bytes == 0) return Status::InvalidArgument("AllocateRegistered of 0 bytes");
    if (type != MemoryType::kCuda) return HostRefused("allocate");
    std::lock_guard<std::mutex> lock(mu_);
    Cudart().SetDevice(options_.nccl_device);
    void* p = nullptr;
    cudaError_t e = Cudart().Malloc(&p, bytes);
    if (e != cudaSuccess) {
      Cudart().GetLastError();
      return Status::ResourceExhausted("cudaMalloc(" + std::to_string(bytes) +
                                       "): " + Cudart().GetErrorString(e));
    }
    const uint64_t id = next_id_++;
    regions_[id] = {p, bytes, true};
    return Region{RegionHandle{id}, p, bytes, MemoryType::kCuda};
  }
  StatusOr<Region> RegisterMemory(void* data, size_t bytes, MemoryType type) override {
    if (data == nullptr) return Status::InvalidArgument("RegisterMemory of a null pointer");
    if (bytes == 0) return Status::InvalidArgument("RegisterMemory of 0 bytes");
    if (type != MemoryType::kCuda) return HostRefused("register");
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = next_id_++;
    regions_[id] = {data, bytes, false};
    return Region{RegionHandle{id}, data, bytes, MemoryType::kCuda};
  }
  Status DeregisterMemory(RegionHandle region) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(region.id);
    if (it == regions_.end())
      return Status::NotFound("unknown region " + std::to_string(region.id));
    if (it->second.owned) {
      Cudart().SetDevice(options_.nccl_device);
      Cudart().Free(it->second.data);
    }
    regions_.erase(it);
    return Status::Ok();
  }

  StatusOr<TransferHandle> Post(const TransferRequest& r) override {
    if (r.op == TransferOp::kRead || r.op == TransferOp::kWrite) {
      return Status::Unimplemented("nccl backend has no RMA (kRead/kWrite): use tag messages");
    }
    if (r.memory_type != MemoryType::kCuda) return HostRefused(std::string(TransferOpName(r.op)));
    if (r.buffer == nullptr && r.length > 0) {
      return Status::InvalidArgument("TransferRequest.buffer is null but length is " +
                                     std::to_string(r.length));
    }
    if (r.tag > kMaxTag) {
      return Status::InvalidArgument("tag " + std::to_string(r.tag) + " is above kMaxTag (2^62-1)");
    }
    if (r.op == TransferOp::kSend && !r.peer.valid()) {
      return Status::InvalidArgument("send needs a peer");
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (r.peer.valid()) {
      auto p = peers_.find(r.peer.id);
      if (p == peers_.end()) return Status::NotFound("unknown peer " + std::to_string(r.peer.id));
      if (!p->second->failure.ok()) return p->second->failure;
    }
    const uint64_t id = next_id_++;
    Transfer& t = transfers_[id];
    t.op = r.op;
    t.peer = r.peer.id;
    t.tag = r.tag;
    t.buffer = r.buffer;
    t.length = r.length;
    if (r.op == TransferOp::kSend) {
      peers_[r.peer.id]->send_queue.push_back(id);
    } else {
      recv_order_.push_back(id);
    }
    WakeLocked();
    return TransferHandle{id};
  }

  TransferStatus Check(TransferHandle h) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = transfers_.find(h.id);
    if (it == transfers_.end()) {
      return {TransferState::kError, Status::NotFound("unknown transfer " + std::to_string(h.id)),
              0};
    }
    return it->second.status;
  }

  Status Wait(TransferHandle h, std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      Progress();
      TransferStatus s = Check(h);
      if (s.state != TransferState::kInProgress) return s.status;
      if (Clock::now() >= deadline) {
        return Status::DeadlineExceeded("nccl transfer " + std::to_string(h.id) +
                                        " not done after " + std::to_string(timeout.count()) +
                                        " ms");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  Status Cancel(TransferHandle h) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = transfers_.find(h.id);
    if (it == transfers_.end()) return Status::NotFound("unknown transfer " + std::to_string(h.id));
    Transfer& t = it->second;
    if (t.status.state != TransferState::kInProgress || t.started) return Status::Ok();
    if (t.op == TransferOp::kSend) {
      auto& q = peers_[t.peer]->send_queue;
      q.erase(std::remove(q.begin(), q.end(), h.id), q.end());
    } else {
      recv_order_.erase(std::remove(recv_order_.begin(), recv_order_.end(), h.id),
                        recv_order_.end());
    }
    t.status = {TransferState::kError, Status::Cancelled("transfer cancelled"), 0};
    return Status::Ok();
  }

  Status Release(TransferHandle h) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = transfers_.find(h.id);
    if (it == transfers_.end()) return Status::NotFound("unknown transfer " + std::to_string(h.id));
    if (it->second.status.state == TransferState::kInProgress) {
      return Status::FailedPrecondition("transfer " + std::to_string(h.id) +
                                        " is in progress: Cancel and Wait first");
    }
    transfers_.erase(it);
    return Status::Ok();
  }

  int Progress() override {
    std::lock_guard<std::mutex> lock(mu_);
    Cudart().SetDevice(options_.nccl_device);
    int events = 0;
    for (auto& [id, p] : peers_) events += ProgressPeerLocked(id, *p);
    return events;
  }

  Status WaitForEvents(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (BusyLocked()) {
      // CUDA events have no fd to sleep on: a short nap, bounded by the timeout.
      lock.unlock();
      std::this_thread::sleep_for(
          std::min<std::chrono::microseconds>(timeout, std::chrono::microseconds(50)));
      return Status::Ok();
    }
    // Nothing in flight and every pair formed (or failed): nothing to poll until a Post, a
    // Connect or a Wakeup, so an idle daemon's link thread sleeps instead of waking every 50 us.
    // A communicator's async error is then seen at the latest after `timeout`.
    wake_cv_.wait_for(lock, timeout, [this] { return wake_; });
    wake_ = false;
    return Status::Ok();
  }

  void Wakeup() override {
    std::lock_guard<std::mutex> lock(mu_);
    WakeLocked();
  }

 private:
  struct Transfer {
    TransferOp op = TransferOp::kSend;
    uint64_t peer = 0;
    uint64_t tag = 0;
    void* buffer = nullptr;
    size_t length = 0;
    bool started = false;  // handed to NCCL: no longer cancellable
    TransferStatus status;
  };
  enum class RecvStage { kIdle, kHeader, kUnmatched, kPayload };
  struct Peer {
    bool connector = false;
    std::string bootstrap;  // connector: the bytes for the other side
    ncclComm_t comms[2] = {nullptr, nullptr};
    bool ready = false;
    bool disconnecting = false;  // Disconnect is failing it: not a vanished peer
    Status failure;
    Clock::time_point deadline;
    cudaStream_t send_stream = nullptr, recv_stream = nullptr;
    cudaEvent_t send_event = nullptr, recv_event = nullptr;
    void* d_headers = nullptr;      // [send header | recv header] on the device
    uint64_t* h_headers = nullptr;  // pinned: [send tag, len | recv tag, len]
    std::deque<uint64_t> send_queue;
    uint64_t active_send = 0;
    RecvStage stage = RecvStage::kIdle;
    uint64_t active_recv = 0;  // the kRecv taking the payload (0: draining into `drain`)
    void* drain = nullptr;     // scratch for a payload no receive can hold
    ncclComm_t send_comm() const { return comms[connector ? 0 : 1]; }
    ncclComm_t recv_comm() const { return comms[connector ? 1 : 0]; }
    int other_rank() const { return connector ? 1 : 0; }
  };
  struct RegionState {
    void* data = nullptr;
    size_t size = 0;
    bool owned = false;
  };

  Status HostRefused(const std::string& what) const {
    return Status::Unimplemented("nccl moves CUDA device memory only: cannot " + what +
                                 " host memory (use the ucx backend for host buffers)");
  }

  void Complete(uint64_t id, Status s, size_t bytes) {
    auto it = transfers_.find(id);
    if (it == transfers_.end()) return;
    it->second.status = s.ok() ? TransferStatus{TransferState::kDone, Status::Ok(), bytes}
                               : TransferStatus{TransferState::kError, std::move(s), 0};
  }

  void FailPeerLocked(uint64_t peer_id, const Status& why) {
    Peer& p = *peers_[peer_id];
    if (p.failure.ok()) {
      p.failure = why;
      if (!p.disconnecting) ++peer_totals_.vanished;
    }
    for (auto& [id, t] : transfers_) {
      if (t.status.state == TransferState::kInProgress && t.peer == peer_id) Complete(id, why, 0);
    }
    p.send_queue.clear();
    if (p.active_recv != 0) Complete(p.active_recv, why, 0);
    p.active_send = p.active_recv = 0;
  }

  void ClosePeerLocked(Peer& p) {
    for (ncclComm_t& c : p.comms) {
      if (c != nullptr) Nccl().CommAbort(c);  // never blocks on the other side
      c = nullptr;
    }
    if (p.send_stream) Cudart().StreamDestroy(p.send_stream);
    if (p.recv_stream) Cudart().StreamDestroy(p.recv_stream);
    if (p.send_event) Cudart().EventDestroy(p.send_event);
    if (p.recv_event) Cudart().EventDestroy(p.recv_event);
    if (p.d_headers) Cudart().Free(p.d_headers);
    if (p.h_headers) Cudart().FreeHost(p.h_headers);
    if (p.drain) Cudart().Free(p.drain);
    p = Peer{};
  }

  // The first posted receive that wants `tag` from `peer_id`, or 0.
  // Receives that finished meanwhile (their peer failed) or were released are dropped.
  uint64_t MatchRecvLocked(uint64_t peer_id, uint64_t tag) {
    for (auto it = recv_order_.begin(); it != recv_order_.end();) {
      auto t = transfers_.find(*it);
      if (t == transfers_.end() || t->second.status.state != TransferState::kInProgress) {
        it = recv_order_.erase(it);
        continue;
      }
      if (t->second.tag == tag && (t->second.peer == 0 || t->second.peer == peer_id)) {
        const uint64_t id = *it;
        recv_order_.erase(it);
        return id;
      }
      ++it;
    }
    return 0;
  }

  int ProgressPeerLocked(uint64_t peer_id, Peer& p) {
    if (!p.failure.ok()) return 0;
    int events = 0;
    if (!p.ready) {
      ncclResult_t a = ncclSuccess, b = ncclSuccess;
      Nccl().CommGetAsyncError(p.comms[0], &a);
      Nccl().CommGetAsyncError(p.comms[1], &b);
      if (a == ncclSuccess && b == ncclSuccess) {
        p.ready = true;
        events++;
      } else if (a != ncclInProgress && a != ncclSuccess) {
        FailPeerLocked(peer_id,
                       NcclErr(a, "nccl communicator with peer " + std::to_string(peer_id)));
        return 1;
      } else if (b != ncclInProgress && b != ncclSuccess) {
        FailPeerLocked(peer_id,
                       NcclErr(b, "nccl communicator with peer " + std::to_string(peer_id)));
        return 1;
      } else if (Clock::now() > p.deadline) {
        FailPeerLocked(peer_id,
                       Status::Unavailable(
                           "nccl communicators with peer " + std::to_string(peer_id) +
                           " not formed after " + std::to_string(options_.nccl_init_timeout_ms) +
                           " ms: did the peer Connect with this side's PeerBootstrap bytes?"));
        return 1;
      }
      if (!p.ready) return events;
    }
    for (ncclComm_t c : p.comms) {
      ncclResult_t e = ncclSuccess;
      Nccl().CommGetAsyncError(c, &e);
      if (e != ncclSuccess && e != ncclInProgress) {
        FailPeerLocked(peer_id, NcclErr(e, "peer " + std::to_string(peer_id) + " vanished"));
        return events + 1;
      }
    }
    // ---- sends: header then payload on the send stream, one message at a time ----
    if (p.active_send != 0 && Cudart().EventQuery(p.send_event) == cudaSuccess) {
      Complete(p.active_send, Status::Ok(), transfers_[p.active_send].length);
      p.active_send = 0;
      events++;
    }
    if (p.active_send == 0 && !p.send_queue.empty()) {
      const uint64_t id = p.send_queue.front();
      p.send_queue.pop_front();
      Transfer& t = transfers_[id];
      t.started = true;
      p.h_headers[0] = t.tag;
      p.h_headers[1] = t.length;
      Cudart().MemcpyAsync(p.d_headers, p.h_headers, kHeaderBytes, cudaMemcpyHostToDevice,
                           p.send_stream);
      ncclResult_t r = Nccl().Send(p.d_headers, kHeaderBytes, ncclUint8, p.other_rank(),
                                   p.send_comm(), p.send_stream);
      if (r == ncclSuccess && t.length > 0) {
        r = Nccl().Send(t.buffer, t.length, ncclUint8, p.other_rank(), p.send_comm(),
                        p.send_stream);
      }
      if (r != ncclSuccess && r != ncclInProgress) {
        Complete(id, NcclErr(r, "ncclSend"), 0);
      } else {
        Cudart().EventRecord(p.send_event, p.send_stream);
        p.active_send = id;
      }
      events++;
    }
    // ---- receives: header, match, payload ----
    auto* recv_header = static_cast<char*>(p.d_headers) + kHeaderBytes;
    switch (p.stage) {
      case RecvStage::kIdle: {
        ncclResult_t r = Nccl().Recv(recv_header, kHeaderBytes, ncclUint8, p.other_rank(),
                                     p.recv_comm(), p.recv_stream);
        if (r != ncclSuccess && r != ncclInProgress) {
          FailPeerLocked(peer_id, NcclErr(r, "ncclRecv of a header"));
          return events + 1;
        }
        Cudart().MemcpyAsync(p.h_headers + 2, recv_header, kHeaderBytes, cudaMemcpyDeviceToHost,
                             p.recv_stream);
        Cudart().EventRecord(p.recv_event, p.recv_stream);
        p.stage = RecvStage::kHeader;
        break;
      }
      case RecvStage::kHeader:
        if (Cudart().EventQuery(p.recv_event) != cudaSuccess) break;
        p.stage = RecvStage::kUnmatched;
        events++;
        [[fallthrough]];
      case RecvStage::kUnmatched: {
        const uint64_t tag = p.h_headers[2], length = p.h_headers[3];
        const uint64_t id = MatchRecvLocked(peer_id, tag);
        if (id == 0) break;  // head-of-line until a receive for this tag is posted
        Transfer& t = transfers_[id];
        t.started = true;
        void* dst = t.buffer;
        if (length > t.length) {  // too long: fail it, drain the bytes
          Complete(id,
                   Status::OutOfRange("message of " + std::to_string(length) +
                                      " bytes is longer than the receive buffer (" +
                                      std::to_string(t.length) + ")"),
                   0);
          if (p.drain) Cudart().Free(p.drain);
          Cudart().Malloc(&p.drain, length);
          dst = p.drain;
          p.active_recv = 0;
        } else {
          p.active_recv = id;
        }
        if (length == 0) {
          if (p.active_recv != 0) Complete(id, Status::Ok(), 0);
          p.stage = RecvStage::kIdle;
          events++;
          break;
        }
        ncclResult_t r =
            Nccl().Recv(dst, length, ncclUint8, p.other_rank(), p.recv_comm(), p.recv_stream);
        if (r != ncclSuccess && r != ncclInProgress) {
          FailPeerLocked(peer_id, NcclErr(r, "ncclRecv"));
          return events + 1;
        }
        Cudart().EventRecord(p.recv_event, p.recv_stream);
        p.h_headers[3] = length;
        p.stage = RecvStage::kPayload;
        break;
      }
      case RecvStage::kPayload:
        if (Cudart().EventQuery(p.recv_event) != cudaSuccess) break;
        if (p.active_recv != 0) Complete(p.active_recv, Status::Ok(), p.h_headers[3]);
        p.active_recv = 0;
        p.stage = RecvStage::kIdle;
        events++;
        break;
    }
    return events;
  }

  const NcclOptions options_;
  Capabilities caps_;
  uint64_t uuid_ = 0;
  std::string address_;
  // True while a transfer is in progress or a pair is still forming: the progress thread polls.
  bool BusyLocked() const {
    for (const auto& [id, t] : transfers_) {
      if (t.status.state == TransferState::kInProgress) return true;
    }
    for (const auto& [id, p] : peers_) {
      if (!p->ready && p->failure.ok()) return true;
    }
    return false;
  }
  void WakeLocked() {
    wake_ = true;
    wake_cv_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable wake_cv_;  // WaitForEvents sleeps on it when nothing is in flight
  bool wake_ = false;                // GUARDED_BY(mu_)
  uint64_t next_id_ = 1;             // GUARDED_BY(mu_)
  PeerCounts peer_totals_;           // connects, disconnects, vanished; GUARDED_BY(mu_)
  std::unordered_map<uint64_t, std::unique_ptr<Peer>> peers_;  // GUARDED_BY(mu_)
  std::unordered_map<uint64_t, RegionState> regions_;          // GUARDED_BY(mu_)
  std::unordered_map<uint64_t, Transfer> transfers_;           // GUARDED_BY(mu_)
  std::deque<uint64_t> recv_order_;  // posted, unmatched receives in post order; GUARDED_BY(mu_)
};

}  // namespace

std::string NcclUnavailableReason(int device) {
  if (std::string why = CudaDeviceUnavailable(device); !why.empty()) return why;
  auto nccl = LoadNccl();
  return nccl.ok() ? "" : nccl.status().message();
}

StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const TransportOptions& options) {
  const NcclOptions& nccl = BackendOptionsOf<NcclOptions>(options);
  if (std::string why = NcclUnavailableReason(nccl.nccl_device); !why.empty()) {
    return Status::Unavailable("nccl backend: " + why);
  }
  auto t = std::make_unique<NcclTransport>(nccl);
  KVD_RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<Transport>(std::move(t));
}

#endif  // KVD_HAVE_NCCL

}  // namespace kvd::transport::nccl
