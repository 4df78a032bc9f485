#include "kvd/transport/transport.h"

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

Status TransportOptions::Validate() const {
  if (backend.empty()) return Status::InvalidArgument("TransportOptions.backend is empty");
  if (close_timeout_ms < 0) {
    return Status::InvalidArgument("TransportOptions.close_timeout_ms is negative: " +
                                   std::to_string(close_timeout_ms));
  }
  for (const auto& o : backend_options) KVD_RETURN_IF_ERROR(o->Validate());
  return Status::Ok();
}

namespace options_internal {

int SlotOf(const TransportOptions& options, const std::type_info& type) {
  for (size_t i = 0; i < options.backend_options.size(); ++i) {
    if (typeid(*options.backend_options[i]) == type) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace options_internal

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

}  // namespace kvd::transport
