#include "ucx/ucx_transport.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <utility>

#include "kvd/common/logging.h"

namespace kvd::transport::ucx {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

// Prefixed to the worker address so bytes of another backend (or garbage) are refused before
// UCX parses them.
constexpr std::string_view kAddressMagic = "KVDUCX1:";

// Idle progress passes Wait spins through before it sleeps on the event fd.
constexpr int kIdleSpinsBeforeSleep = 64;
// Longest single sleep inside Wait (bounds the cost of a wakeup UCX does not signal).
constexpr milliseconds kMaxWaitSlice(1);

}  // namespace

StatusOr<std::unique_ptr<Transport>> UcxTransport::Create(const TransportOptions& options) {
  std::unique_ptr<UcxTransport> t(new UcxTransport(options));
  KVD_RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<Transport>(std::move(t));
}

UcxTransport::UcxTransport(const TransportOptions& options)
    : close_timeout_ms_(options.close_timeout_ms), options_(BackendOptionsOf<UcxOptions>(options)) {
  env_.tls = options_.ucx_tls;
  env_.net_devices = options_.net_devices;
}

Status UcxTransport::Init() {
  KVD_RETURN_IF_ERROR(CreateContext());
  KVD_RETURN_IF_ERROR(CreateWorker());
  if (options_.enable_wakeup) KVD_RETURN_IF_ERROR(SetUpWakeup());
  FillCapabilities();
  return Status::Ok();
}

Status UcxTransport::CreateContext() {
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return Err(s, "ucp_config_read");
  if (Status st = ApplyOptions(config); !st.ok()) {
    ucp_config_release(config);
    return st;
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_REQUEST_SIZE |
                      UCP_PARAM_FIELD_REQUEST_INIT | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.request_init = [](void* request) { RequestId(request) = 0; };
  params.features = UCP_FEATURE_TAG;
  if (options_.enable_rma) params.features |= UCP_FEATURE_RMA;
  if (options_.enable_wakeup) params.features |= UCP_FEATURE_WAKEUP;
  params.request_size = sizeof(uint64_t);  // the transfer id lives in the request
  params.mt_workers_shared = 0;
  s = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (s != UCS_OK) return Err(s, "ucp_init");
  return Status::Ok();
}

Status UcxTransport::ApplyOptions(ucp_config_t* config) const {
  auto modify = [&](const char* name, const std::string& value) -> Status {
    if (value.empty()) return Status::Ok();
    ucs_status_t ms = ucp_config_modify(config, name, value.c_str());
    if (ms != UCS_OK) {
      return Status::InvalidArgument("UCX refused UCX_" + std::string(name) + "=" + value + ": " +
                                     ucs_status_string(ms));
    }
    return Status::Ok();
  };
  KVD_RETURN_IF_ERROR(modify("TLS", options_.ucx_tls));
  KVD_RETURN_IF_ERROR(modify("NET_DEVICES", options_.net_devices));
  if (options_.keepalive_interval_ms > 0) {
    KVD_RETURN_IF_ERROR(
        modify("KEEPALIVE_INTERVAL", std::to_string(options_.keepalive_interval_ms) + "ms"));
  }
  return Status::Ok();
}

Status UcxTransport::CreateWorker() {
  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // we serialize on mu_
  ucs_status_t s = ucp_worker_create(context_, &wparams, &worker_);
  if (s != UCS_OK) return Err(s, "ucp_worker_create");

  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  s = ucp_worker_get_address(worker_, &addr, &addr_len);
  if (s != UCS_OK) return Err(s, "ucp_worker_get_address");
  std::random_device rd;
  uuid_ = (uint64_t{rd()} << 32 | rd()) ^ static_cast<uint64_t>(getpid()) ^
          static_cast<uint64_t>(steady_clock::now().time_since_epoch().count());
  probe_word_ = uuid_;
  nonce_[0] = uint64_t{rd()} << 32 | rd();
  nonce_[1] = uint64_t{rd()} << 32 | rd();
  host_id_ = HostId();
  address_.assign(kAddressMagic);
  address_.append(AddressHeader());
  address_.append(reinterpret_cast<const char*>(addr), addr_len);
  ucp_worker_release_address(worker_, addr);
  return Status::Ok();
}

Status UcxTransport::SetUpWakeup() {
  int fd = -1;
  ucs_status_t s = ucp_worker_get_efd(worker_, &fd);
  if (s != UCS_OK) {
    KVD_LOG(WARNING) << "UCX worker has no event fd; WaitForEvents will poll"
                     << Kv("ucx_status", ucs_status_string(s));
    return Status::Ok();
  }
  event_fd_ = fd;
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  if (wake_fd_ < 0 || epoll_fd_ < 0 || epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, event_fd_, &ev) != 0 ||
      epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev) != 0) {
    return Status::Internal(std::string("cannot set up the wake-up epoll set: ") +
                            std::strerror(errno));
  }
  return Status::Ok();
}

void UcxTransport::FillCapabilities() {
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  caps_.backend = "ucx";
  caps_.host_memory = true;
  if (ucp_context_query(context_, &attr) == UCS_OK) {
    caps_.cuda_memory = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  caps_.tag_messages = true;
  caps_.rma = options_.enable_rma;
  caps_.cancel_recv = true;
  caps_.peer_failure_detection = options_.peer_failure_detection;
  caps_.max_message_bytes = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  caps_.transports = options_.ucx_tls.empty() ? "ucx default" : options_.ucx_tls;
  caps_.library = std::string("UCX ") + ucp_get_version_string();
}

UcxTransport::~UcxTransport() {
  std::unique_lock<std::mutex> lock(mu_);
  if (worker_ != nullptr) {
    // Stop receives that are still waiting, then force-close every endpoint (that completes
    // their sends with an error), and let UCX run the callbacks.
    for (auto& [id, t] : transfers_) {
      if (t.request != nullptr && t.recv_request) ucp_request_cancel(worker_, t.request);
    }
    for (auto& [id, r] : remotes_) ucp_rkey_destroy(r.rkey);
    remotes_.clear();
    for (auto& [id, p] : peers_) {
      if (p.proof) p.proof[0] = p.proof[1] = 0;
      if (p.ep != nullptr) CloseEndpointLocked(p.ep, /*force=*/true, lock).IgnoreError();
    }
    auto deadline = steady_clock::now() + milliseconds(close_timeout_ms_);
    auto pending = [&] {
      closing_.erase(std::remove_if(closing_.begin(), closing_.end(),
                                    [](void* r) {
                                      if (ucp_request_check_status(r) == UCS_INPROGRESS) {
                                        return false;
                                      }
                                      ucp_request_free(r);
                                      return true;
                                    }),
                     closing_.end());
      if (!closing_.empty() || !acking_.empty()) return true;
      for (auto& [id, t] : transfers_) {
        if (t.request != nullptr) return true;
      }
      return false;
    };
    while (pending() && steady_clock::now() < deadline) ucp_worker_progress(worker_);
    if (pending()) {
      KVD_LOG(WARNING) << "UCX transport closed with requests still in flight"
                       << Kv("close_timeout_ms", close_timeout_ms_);
    }
    for (auto& [id, r] : regions_) ucp_mem_unmap(context_, r.memh);
    regions_.clear();
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
  }
  if (context_ != nullptr) ucp_cleanup(context_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

StatusOr<std::string> UcxTransport::LocalAddress() { return address_; }

StatusOr<PeerHandle> UcxTransport::Connect(std::string_view peer_address) {
  const size_t prefix = kAddressMagic.size() + kAddressHeaderSize;
  if (peer_address.size() <= prefix ||
      peer_address.substr(0, kAddressMagic.size()) != kAddressMagic) {
    return Status::InvalidArgument("not a UCX transport address (" +
                                   std::to_string(peer_address.size()) +
                                   " bytes without the KVDUCX1 prefix)");
  }
  std::string_view header = peer_address.substr(kAddressMagic.size(), kAddressHeaderSize);
  std::string worker_address(peer_address.substr(prefix));
  std::lock_guard<std::mutex> lock(mu_);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
  params.address = reinterpret_cast<const ucp_address_t*>(worker_address.data());
  if (options_.peer_failure_detection) {
    params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &UcxTransport::ErrorHandler;
    params.err_handler.arg = this;
  }
  ucp_ep_h ep = nullptr;
  ucs_status_t s = ucp_ep_create(worker_, &params, &ep);
  if (s != UCS_OK) {
    Status st = Err(s, "ucp_ep_create (Connect)");
    if (options_.peer_failure_detection && st.code() == StatusCode::kUnavailable) {
      st = Status::Unavailable(st.message() +
                               ". Note: peer failure detection is on, and UCX 1.13's shared-memory "
                               "transports cannot detect peer failure: include tcp in UCX_TLS "
                               "(e.g. sm,tcp)");
    }
    return st;
  }
  if (const char* dump = std::getenv("KVD_UCX_PRINT_EP"); dump != nullptr && dump[0] == '1') {
    ucp_ep_print_info(ep, stderr);  // which UCX transport carries which lane, for diagnosis
  }
  uint64_t id = next_id_++;
  Peer& peer = peers_[id];
  peer.ep = ep;
  ProbeCmaLocked(peer, header);
  peer_by_ep_[ep] = id;
  ++peer_totals_.connects;
  return PeerHandle{id};
}

Status UcxTransport::CloseEndpointLocked(ucp_ep_h ep, bool force,
                                         std::unique_lock<std::mutex>& lock) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // UCX allows a forced close only on endpoints with peer error handling.
  param.flags = force && options_.peer_failure_detection ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &param);
  peer_by_ep_.erase(ep);
  if (req == nullptr) return Status::Ok();
  if (UCS_PTR_IS_ERR(req)) return Err(UCS_PTR_STATUS(req), "ucp_ep_close_nbx");
  closing_.push_back(req);
  return Status::Ok();
}

Status UcxTransport::Disconnect(PeerHandle peer) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = peers_.find(peer.id);
  if (it == peers_.end()) return Status::NotFound("unknown peer " + std::to_string(peer.id));
  // Fail its transfers as CANCELLED (their buffers are released to the caller once the forced
  // close below has completed the UCX requests), drop its remote keys, then force-close.
  Peer& p = it->second;
  std::set<uint64_t> ids;
  ids.swap(p.transfers);
  for (uint64_t tid : ids) {
    auto t = transfers_.find(tid);
    if (t == transfers_.end() || t->second.status.state != TransferState::kInProgress) continue;
    if (t->second.copying) continue;  // the copy into the caller's buffer ends by itself
    t->second.status = {TransferState::kError,
                        Status::Cancelled("peer " + std::to_string(peer.id) + " disconnected"), 0};
    if (t->second.request != nullptr && t->second.recv_request) {
      ucp_request_cancel(worker_, t->second.request);
    }
  }
  for (auto r = remotes_.begin(); r != remotes_.end();) {
    if (r->second.peer == peer.id) {
      ucp_rkey_destroy(r->second.rkey);
      r = remotes_.erase(r);
    } else {
      ++r;
    }
  }
  ucp_ep_h ep = p.ep;
  if (p.proof) p.proof[0] = p.proof[1] = 0;  // a descriptor still queued at the peer now fails
  peers_.erase(it);
  ++peer_totals_.disconnects;
  Status st = CloseEndpointLocked(ep, /*force=*/true, lock);
  auto deadline = steady_clock::now() + milliseconds(close_timeout_ms_);
  while (!closing_.empty() && steady_clock::now() < deadline) {
    ucp_worker_progress(worker_);
    closing_.erase(std::remove_if(closing_.begin(), closing_.end(),
                                  [](void* r) {
                                    if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
                                    ucp_request_free(r);
                                    return true;
                                  }),
                   closing_.end());
  }
  return st;
}

Status UcxTransport::PeerStatus(PeerHandle peer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer.id);
  if (it == peers_.end()) return Status::NotFound("unknown peer " + std::to_string(peer.id));
  return it->second.failure;
}

PeerCounts UcxTransport::peer_counts() {
  std::lock_guard<std::mutex> lock(mu_);
  PeerCounts c = peer_totals_;
  c.open = peers_.size();
  return c;
}

void UcxTransport::ErrorHandler(void* arg, ucp_ep_h ep, ucs_status_t status) {
  // Runs inside ucp_worker_progress (or another UCX call), i.e. with mu_ held.
  auto* self = static_cast<UcxTransport*>(arg);
  auto it = self->peer_by_ep_.find(ep);
  if (it == self->peer_by_ep_.end()) return;
  Status why = self->Err(status, "peer " + std::to_string(it->second) + " endpoint");
  if (why.code() != StatusCode::kUnavailable) why = Status::Unavailable(why.message());
  self->FailPeerLocked(it->second, why);
}

void UcxTransport::FailPeerLocked(uint64_t peer_id, const Status& why) {
  auto it = peers_.find(peer_id);
  if (it == peers_.end()) return;
  Peer& p = it->second;
  if (p.failure.ok()) {
    p.failure = why;
    ++peer_totals_.vanished;
    KVD_LOG(WARNING) << "UCX peer vanished" << Kv("peer", peer_id) << Kv("why", why.message());
  }
  std::set<uint64_t> ids;
  ids.swap(p.transfers);  // the cancel below may call back into FinishLocked
  for (uint64_t tid : ids) {
    auto t = transfers_.find(tid);
    if (t == transfers_.end() || t->second.status.state != TransferState::kInProgress) continue;
    if (t->second.copying) continue;  // the copy reads the (dead) sender; it ends by itself
    // From here the transfer is failed for the caller. A receive waiting in UCX is cancelled;
    // a send or a matched receive stays a UCX request until UCX completes it (it moves no more
    // bytes of a dead peer), and its callback then only frees the request.
    t->second.status = {TransferState::kError, why, 0};
    if (t->second.request != nullptr && t->second.recv_request) {
      ucp_request_cancel(worker_, t->second.request);
    }
  }
}

void UcxTransport::FinishLocked(uint64_t id, ucs_status_t status, size_t bytes) {
  auto it = transfers_.find(id);
  if (it == transfers_.end()) return;
  Status st;
  if (status != UCS_OK) {
    st =
        Err(status, std::string(TransferOpName(it->second.op)) + " transfer " + std::to_string(id));
  }
  CompleteLocked(id, std::move(st), bytes);
}

void UcxTransport::CompleteLocked(uint64_t id, Status status, size_t bytes) {
  auto it = transfers_.find(id);
  if (it == transfers_.end()) return;  // released after a peer failure: nothing to report
  Transfer& t = it->second;
  t.request = nullptr;
  if (t.status.state != TransferState::kInProgress) return;
  if (t.peer != 0) {
    auto p = peers_.find(t.peer);
    if (p != peers_.end()) {
      p->second.transfers.erase(id);
      if (!status.ok() && !p->second.failure.ok()) {
        t.status = {TransferState::kError, p->second.failure, 0};
        return;
      }
    }
  }
  if (status.ok()) {
    t.status = {TransferState::kDone, Status::Ok(), bytes};
  } else {
    t.status = {TransferState::kError, std::move(status), 0};
  }
}

uint64_t UcxTransport::TakeRequestId(void* request) {
  uint64_t id = RequestId(request);
  if (id == 0) id = posting_id_;
  RequestId(request) = 0;
  auto it = transfers_.find(id);
  if (it != transfers_.end()) it->second.callback_ran = true;
  return id;
}

void UcxTransport::SendCallback(void* request, ucs_status_t status, void* user_data) {
  auto* self = static_cast<UcxTransport*>(user_data);
  uint64_t id = self->TakeRequestId(request);
  auto it = self->transfers_.find(id);
  size_t bytes = it == self->transfers_.end() ? 0 : it->second.status.bytes;
  self->FinishLocked(id, status, bytes);
  ucp_request_free(request);
}

void UcxTransport::RecvCallback(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                                void* user_data) {
  auto* self = static_cast<UcxTransport*>(user_data);
  ucp_tag_recv_info_t none{};
  self->OnRecvDoneLocked(self->TakeRequestId(request), status, info != nullptr ? *info : none);
  ucp_request_free(request);
}

StatusOr<TransferHandle> UcxTransport::Post(const TransferRequest& r) {
  if (r.buffer == nullptr && r.length > 0) {
    return Status::InvalidArgument("TransferRequest.buffer is null but length is " +
                                   std::to_string(r.length));
  }
  if (r.memory_type == MemoryType::kCuda && !caps_.cuda_memory) {
    return Status::Unimplemented(
        "this UCX was built without CUDA support: stage CUDA buffers through host memory");
  }
  const bool rma = r.op == TransferOp::kRead || r.op == TransferOp::kWrite;
  if (rma && !caps_.rma) {
    return Status::Unimplemented("RMA is disabled (TransportOptions.enable_rma=false)");
  }
  if (rma && r.length == 0) return Status::InvalidArgument("RMA transfer of 0 bytes");
  if (r.op != TransferOp::kRecv && !r.peer.valid()) {
    return Status::InvalidArgument(std::string(TransferOpName(r.op)) + " needs a peer");
  }
  if (!rma && r.tag > kMaxTag) {
    return Status::InvalidArgument("tag " + std::to_string(r.tag) + " is above kMaxTag (2^62-1)");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (r.peer.valid()) {
    auto p = peers_.find(r.peer.id);
    if (p == peers_.end()) return Status::NotFound("unknown peer " + std::to_string(r.peer.id));
    if (!p->second.failure.ok()) return p->second.failure;
  }
  uint64_t id = next_id_++;
  posting_id_ = id;
  Transfer& t = transfers_[id];
  t.op = r.op;
  t.peer = r.peer.id;
  t.status.bytes = r.length;  // sends report this; receives overwrite it with the message length
  t.buffer = r.buffer;
  t.capacity = r.length;
  t.want_checksum =
      r.want_checksum && r.op == TransferOp::kRecv && r.memory_type == MemoryType::kHost;
  Status st;
  if (rma) {
    st = PostRmaLocked(id, t, r);
  } else if (r.op == TransferOp::kSend && options_.cma_threshold_bytes > 0 &&
             r.length >= static_cast<uint64_t>(options_.cma_threshold_bytes) &&
             r.memory_type == MemoryType::kHost && peers_[r.peer.id].cma) {
    st = PostCmaSendLocked(id, t, r);
  } else {
    st = PostTagLocked(id, t, r);
  }
  if (!st.ok()) {
    transfers_.erase(id);
    return st;
  }
  if (t.status.state == TransferState::kInProgress && t.peer != 0) {
    peers_[t.peer].transfers.insert(id);
  }
  work_posted_ = true;
  if (sleepers_.load(std::memory_order_relaxed) > 0) Wakeup();
  return TransferHandle{id};
}

Status UcxTransport::PostTagLocked(uint64_t id, Transfer& t, const TransferRequest& r) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.user_data = this;
  const bool device = r.memory_type == MemoryType::kCuda;
  if (device) {  // spares UCX its memory-type detection of the pointer
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  ucs_status_ptr_t req;
  ucp_tag_recv_info_t info{};
  if (r.op == TransferOp::kSend) {
    param.cb.send = &UcxTransport::SendCallback;
    req = ucp_tag_send_nbx(peers_[r.peer.id].ep, r.buffer, r.length, r.tag, &param);
  } else {
    // Small host receives land in a bounce buffer with room for a cma descriptor. A CUDA
    // receive matches only UCX-carried messages (the exact tag): this process cannot read a
    // descriptor out of device memory, so the same-host descriptor form never matches it.
    void* dest = r.buffer;
    size_t room = r.length;
    if (!device && r.length < kDescriptorSize) {
      t.bounce.reset(new uint8_t[kDescriptorSize]);
      dest = t.bounce.get();
      room = kDescriptorSize;
    }
    // UCX 1.13 leaves recv_info zeroed when a receive completes in place on an unexpected
    // message, and the sender tag tells a descriptor from inline bytes: always complete
    // through the callback.
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    param.cb.recv = &UcxTransport::RecvCallback;
    param.recv_info.tag_info = &info;
    req = ucp_tag_recv_nbx(worker_, dest, room, r.tag, device ? ~uint64_t{0} : ~kInternalTagBit,
                           &param);
  }
  if (UCS_PTR_IS_ERR(req)) {
    return Err(UCS_PTR_STATUS(req), std::string(TransferOpName(r.op)) + " post");
  }
  if (req == nullptr) {  // completed in place
    if (r.op == TransferOp::kSend) {
      t.status = {TransferState::kDone, Status::Ok(), r.length};
    } else {
      OnRecvDoneLocked(id, UCS_OK, info);
    }
    return Status::Ok();
  }
  if (t.callback_ran) return Status::Ok();  // completed (and freed) inside the call
  RequestId(req) = id;
  t.request = req;
  t.recv_request = r.op == TransferOp::kRecv;
  return Status::Ok();
}

TransferStatus UcxTransport::Check(TransferHandle transfer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = transfers_.find(transfer.id);
  if (it == transfers_.end()) {
    return {TransferState::kError,
            Status::NotFound("unknown transfer " + std::to_string(transfer.id)), 0};
  }
  return it->second.status;
}

Status UcxTransport::Wait(TransferHandle transfer, milliseconds timeout) {
  const auto deadline = steady_clock::now() + timeout;
  int idle = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      unsigned n = ucp_worker_progress(worker_);
      n += static_cast<unsigned>(RunCopies(lock));
      auto it = transfers_.find(transfer.id);
      if (it == transfers_.end()) {
        return Status::NotFound("unknown transfer " + std::to_string(transfer.id));
      }
      const TransferStatus& s = it->second.status;
      if (s.state == TransferState::kDone) return Status::Ok();
      if (s.state == TransferState::kError) return s.status;
      idle = n > 0 ? 0 : idle + 1;
    }
    auto now = steady_clock::now();
    if (now >= deadline) {
      return Status::DeadlineExceeded("transfer " + std::to_string(transfer.id) +
                                      " did not finish within " + std::to_string(timeout.count()) +
                                      " ms (still in flight: Wait again or Cancel)");
    }
    if (idle < kIdleSpinsBeforeSleep) {
      std::this_thread::yield();
    } else {
      auto left = std::chrono::duration_cast<milliseconds>(deadline - now) + milliseconds(1);
      WaitForEvents(std::min(left, kMaxWaitSlice)).IgnoreError();
    }
  }
}

Status UcxTransport::Cancel(TransferHandle transfer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = transfers_.find(transfer.id);
  if (it == transfers_.end()) {
    return Status::NotFound("unknown transfer " + std::to_string(transfer.id));
  }
  Transfer& t = it->second;
  if (t.status.state != TransferState::kInProgress || t.request == nullptr ||
      t.op != TransferOp::kRecv) {
    return Status::Ok();
  }
  // UCX 1.13 cancels only receives that no message has matched yet (the callback then runs here
  // with UCS_ERR_CANCELED). Sends and matched receives finish on their own.
  ucp_request_cancel(worker_, t.request);
  return Status::Ok();
}

Status UcxTransport::Release(TransferHandle transfer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = transfers_.find(transfer.id);
  if (it == transfers_.end()) {
    return Status::NotFound("unknown transfer " + std::to_string(transfer.id));
  }
  if (it->second.status.state == TransferState::kInProgress) {
    return Status::FailedPrecondition("transfer " + std::to_string(transfer.id) +
                                      " is still in progress: Cancel and Wait before Release");
  }
  transfers_.erase(it);
  return Status::Ok();
}

int UcxTransport::Progress() {
  std::unique_lock<std::mutex> lock(mu_);
  int n = static_cast<int>(ucp_worker_progress(worker_));
  return n + RunCopies(lock);
}

Status UcxTransport::WaitForEvents(milliseconds timeout) {
  if (timeout.count() <= 0) return Status::Ok();
  std::unique_lock<std::mutex> lock(mu_);
  if (work_posted_) {  // a post since the caller's last Progress may need progress: no sleep
    work_posted_ = false;
    return Status::Ok();
  }
  if (event_fd_ < 0) {
    lock.unlock();
    std::this_thread::sleep_for(std::min(timeout, kMaxWaitSlice));
    return Status::Ok();
  }
  sleepers_.fetch_add(1, std::memory_order_relaxed);  // before arming: a Post now signals
  ucs_status_t s = ucp_worker_arm(worker_);
  if (s != UCS_OK) {
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    if (s == UCS_ERR_BUSY) return Status::Ok();  // events are pending: go progress
    return Err(s, "ucp_worker_arm");
  }
  lock.unlock();
  epoll_event events[2];
  int rc = epoll_wait(epoll_fd_, events, 2,
                      static_cast<int>(std::min<int64_t>(timeout.count(), INT32_MAX)));
  sleepers_.fetch_sub(1, std::memory_order_relaxed);
  if (rc < 0 && errno != EINTR) {
    return Status::Internal(std::string("epoll_wait on the UCX event fd: ") + std::strerror(errno));
  }
  uint64_t drained = 0;
  if (rc > 0 && read(wake_fd_, &drained, sizeof(drained)) < 0 && errno != EAGAIN) {
    return Status::Internal(std::string("read of the wake-up eventfd: ") + std::strerror(errno));
  }
  return Status::Ok();
}

void UcxTransport::Wakeup() {
  if (wake_fd_ < 0) return;
  uint64_t one = 1;
  // Nonblocking: EAGAIN means the counter is saturated, i.e. a wake-up is already pending.
  ssize_t n = write(wake_fd_, &one, sizeof(one));
  (void)n;
}

}  // namespace kvd::transport::ucx
