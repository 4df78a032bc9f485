// The client's side of kvd's NCCL link (ClientOptions::nccl): the join at Connect, and the posts
// of device buffers over it. The put and get windows that use it are in client.cc.
#include "client_impl.h"
#include "kvd/common/logging.h"

namespace kvd::client::internal {

Status ClientImpl::JoinNcclLocked() {
  transport::TransportOptions o = options_.transport;
  o.backend = hooks_.nccl_backend;
  auto t = transport::CreateTransport(o);
  if (!t.ok()) {
    return t.status().WithContext(
        "ClientOptions::nccl: creating this client's NCCL transport on "
        "CUDA device " +
        std::to_string(o.nccl_device));
  }
  nccl_ = std::move(t).value();
  KVD_ASSIGN_OR_RETURN(std::string address, nccl_->LocalAddress());
  auto id = channel_->Send([&](proto::Request::Builder r) {
    r.initNcclConnect().setAddress(
        kj::arrayPtr(reinterpret_cast<const kj::byte*>(address.data()), address.size()));
  });
  if (!id.ok()) return id.status().WithContext("NcclConnect");
  auto reply = channel_->Await(*id, DeadlineIn(options_.connect_timeout_ms));
  if (!reply.ok()) {
    nccl_.reset();
    return reply.status().WithContext("kvd did not join the NCCL link");
  }
  std::string bootstrap, daemon_address;
  KVD_RETURN_IF_ERROR(proto::TryDecode([&]() -> Status {
    auto r = (*reply)->Root<proto::Response>();
    if (!r.isNcclConnected()) {
      return Status::Internal("kvd answered NcclConnect with an unexpected message");
    }
    auto c = r.getNcclConnected();
    auto b = c.getBootstrap();
    bootstrap.assign(reinterpret_cast<const char*>(b.begin()), b.size());
    auto a = c.getAddress();
    daemon_address.assign(reinterpret_cast<const char*>(a.begin()), a.size());
    session_.nccl_library = c.getLibrary().cStr();
    session_.nccl_daemon_device = c.getDevice();
    return Status::Ok();
  }));
  // NCCL: kvd connected to this transport and made the communicators' ids; joining with them
  // completes the pair (in the background, bounded by transport.nccl_init_timeout_ms). A backend
  // without bootstrap bytes connects to kvd's address instead.
  auto peer = nccl_->Connect(bootstrap.empty() ? daemon_address : bootstrap);
  if (!peer.ok()) return peer.status().WithContext("joining kvd's NCCL link");
  nccl_peer_ = *peer;
  session_.nccl = true;
  KVD_LOG(INFO) << "NCCL link joined" << Kv("library", session_.nccl_library)
                << Kv("device", o.nccl_device) << Kv("kvd_device", session_.nccl_daemon_device);
  return Status::Ok();
}

StatusOr<transport::TransferHandle> ClientImpl::PostNcclLocked(transport::TransferOp op,
                                                               uint64_t tag,
                                                               const void* device_buffer,
                                                               size_t bytes) {
  transport::TransferRequest request;
  request.op = op;
  request.peer = nccl_peer_;
  request.tag = tag;
  request.buffer = const_cast<void*>(device_buffer);  // a send only reads it
  request.length = bytes;
  // NCCL moves CUDA memory; the loopback test backend moves the same (readable) bytes as host.
  request.memory_type = nccl_->capabilities().cuda_memory ? transport::MemoryType::kCuda
                                                          : transport::MemoryType::kHost;
  return nccl_->Post(request);
}

}  // namespace kvd::client::internal
