#include "kvd/transport/transport.h"

#include <algorithm>
#include <map>
#include <mutex>

#include "loopback/loopback_transport.h"
#include "nccl/nccl_transport.h"
#include "ucx/ucx_transport.h"

namespace kvd::transport {

std::string_view MemoryTypeName(MemoryType type) {
  switch (type) {
    case MemoryType::kHost:
      return "host";
    case MemoryType::kCuda:
      return "cuda";
  }
  return "unknown";
}

std::string_view TransferOpName(TransferOp op) {
  switch (op) {
    case TransferOp::kSend:
      return "send";
    case TransferOp::kRecv:
      return "recv";
    case TransferOp::kRead:
      return "read";
    case TransferOp::kWrite:
      return "write";
  }
  return "unknown";
}

namespace {

bool ValidUcxList(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == ',' || c == ':' ||
           c == '.' || c == '-' || c == '^';
  });
}

}  // namespace

Status TransportOptions::Validate() const {
  if (backend.empty()) return Status::InvalidArgument("TransportOptions.backend is empty");
  if (!ValidUcxList(ucx_tls)) {
    return Status::InvalidArgument("TransportOptions.ucx_tls has an invalid character: '" +
                                   ucx_tls + "' (expected e.g. \"tcp\" or \"sm,tcp\")");
  }
  if (!ValidUcxList(net_devices)) {
    return Status::InvalidArgument("TransportOptions.net_devices has an invalid character: '" +
                                   net_devices + "' (expected e.g. \"lo\" or \"eth0,lo\")");
  }
  if (keepalive_interval_ms < 0) {
    return Status::InvalidArgument("TransportOptions.keepalive_interval_ms is negative: " +
                                   std::to_string(keepalive_interval_ms));
  }
  if (cma_threshold_bytes < 0) {
    return Status::InvalidArgument("TransportOptions.cma_threshold_bytes is negative: " +
                                   std::to_string(cma_threshold_bytes));
  }
  if (close_timeout_ms < 0) {
    return Status::InvalidArgument("TransportOptions.close_timeout_ms is negative: " +
                                   std::to_string(close_timeout_ms));
  }
  if (nccl_device < 0) {
    return Status::InvalidArgument("TransportOptions.nccl_device is negative: " +
                                   std::to_string(nccl_device));
  }
  if (nccl_init_timeout_ms <= 0) {
    return Status::InvalidArgument("TransportOptions.nccl_init_timeout_ms must be > 0, got " +
                                   std::to_string(nccl_init_timeout_ms));
  }
  if (loopback_domain.empty()) {
    return Status::InvalidArgument("TransportOptions.loopback_domain is empty");
  }
  return Status::Ok();
}

// ---- optional operations: absent means UNIMPLEMENTED ----

StatusOr<std::string> Transport::ExportRegion(RegionHandle) {
  return Status::Unimplemented(capabilities().backend + " backend has no RMA (ExportRegion)");
}
StatusOr<RemoteRegionHandle> Transport::ImportRegion(PeerHandle, std::string_view) {
  return Status::Unimplemented(capabilities().backend + " backend has no RMA (ImportRegion)");
}
Status Transport::ReleaseRemoteRegion(RemoteRegionHandle) {
  return Status::Unimplemented(capabilities().backend + " backend has no RMA");
}
StatusOr<std::string> Transport::PeerBootstrap(PeerHandle) { return std::string(); }

// ---- conveniences ----

StatusOr<TransferHandle> Transport::PostSend(PeerHandle peer, uint64_t tag, const void* data,
                                             size_t length) {
  TransferRequest r;
  r.op = TransferOp::kSend;
  r.peer = peer;
  r.tag = tag;
  r.buffer = const_cast<void*>(data);  // a send only reads it
  r.length = length;
  return Post(r);
}

StatusOr<TransferHandle> Transport::PostRecv(PeerHandle peer, uint64_t tag, void* data,
                                             size_t length, RecvOptions options) {
  TransferRequest r;
  r.op = TransferOp::kRecv;
  r.peer = peer;
  r.tag = tag;
  r.buffer = data;
  r.length = length;
  r.want_checksum = options.want_checksum;
  return Post(r);
}

namespace {

// Waits; on timeout cancels and waits a little more so the buffer is free before returning.
Status FinishBlocking(Transport& t, TransferHandle h, std::chrono::milliseconds timeout,
                      size_t* bytes) {
  Status s = t.Wait(h, timeout);
  if (s.code() == StatusCode::kDeadlineExceeded) {
    t.Cancel(h).IgnoreError();
    Status after = t.Wait(h, std::chrono::milliseconds(1000));
    if (after.code() == StatusCode::kDeadlineExceeded) return s;  // leak the handle: still busy
  }
  if (bytes != nullptr) *bytes = t.Check(h).bytes;
  t.Release(h).IgnoreError();
  return s;
}

}  // namespace

Status Transport::SendBlocking(PeerHandle peer, uint64_t tag, const void* data, size_t length,
                               std::chrono::milliseconds timeout) {
  KVD_ASSIGN_OR_RETURN(TransferHandle h, PostSend(peer, tag, data, length));
  return FinishBlocking(*this, h, timeout, nullptr);
}

Status Transport::RecvBlocking(PeerHandle peer, uint64_t tag, void* data, size_t length,
                               std::chrono::milliseconds timeout, size_t* received) {
  KVD_ASSIGN_OR_RETURN(TransferHandle h, PostRecv(peer, tag, data, length));
  return FinishBlocking(*this, h, timeout, received);
}

// ---- registry ----

namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, TransportFactory> factories;
};

Registry& GetRegistry() {
  static Registry* registry = [] {
    auto* r = new Registry();
    r->factories["ucx"] = &ucx::UcxTransport::Create;
    r->factories["loopback"] = &loopback::LoopbackTransport::Create;
    r->factories["none"] = &loopback::LoopbackTransport::CreateNone;  // no bulk transport
    r->factories["nccl"] = &nccl::CreateNcclTransport;  // UNAVAILABLE without NCCL or a GPU
    return r;
  }();
  return *registry;
}

}  // namespace

StatusOr<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options) {
  KVD_RETURN_IF_ERROR(options.Validate());
  TransportFactory factory;
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.factories.find(options.backend);
    if (it == r.factories.end()) {
      std::string names;
      for (const auto& [name, f] : r.factories) names += (names.empty() ? "" : ", ") + name;
      return Status::NotFound("unknown transport backend '" + options.backend +
                              "' (registered: " + names + ")");
    }
    factory = it->second;
  }
  return factory(options);
}

Status RegisterTransportBackend(const std::string& name, TransportFactory factory) {
  if (name.empty() || !factory) {
    return Status::InvalidArgument("RegisterTransportBackend needs a name and a factory");
  }
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.factories.emplace(name, std::move(factory)).second) {
    return Status::AlreadyExists("transport backend '" + name + "' is already registered");
  }
  return Status::Ok();
}

std::vector<std::string> RegisteredTransportBackends() {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> names;
  for (const auto& [name, f] : r.factories) names.push_back(name);
  return names;
}

}  // namespace kvd::transport
