// The client's side of kvd's NCCL link (nccl_path.h): the join at Connect and the bulk path.
#include <string>
#include <utility>

#include "kvd/common/hash.h"
#include "kvd/common/logging.h"
#include "nccl_path.h"
#include "path_context.h"

namespace kvd::client::internal {

StatusOr<std::unique_ptr<NcclPath>> NcclPath::Join(PathContext& client,
                                                   const transport::TransportOptions& options,
                                                   SessionInfo* session_out) {
  const int device = transport::BackendOptionsOf<transport::NcclOptions>(options).nccl_device;
  auto t = transport::CreateTransport(options);
  if (!t.ok()) {
    return t.status().WithContext(
        "ClientOptions::nccl: creating this client's NCCL transport on "
        "CUDA device " +
        std::to_string(device));
  }
  std::unique_ptr<NcclPath> path(
      new NcclPath(client, std::move(t).value(), "bulk transfer over NCCL", /*over_nccl=*/true));
  KVD_ASSIGN_OR_RETURN(std::string address, path->transport_->LocalAddress());
  Channel& channel = client.channel();
  auto id = channel.Send([&](proto::Request::Builder r) {
    r.initNcclConnect().setAddress(
        kj::arrayPtr(reinterpret_cast<const kj::byte*>(address.data()), address.size()));
  });
  if (!id.ok()) return id.status().WithContext("NcclConnect");
  auto reply = channel.Await(*id, DeadlineIn(client.options().connect_timeout_ms));
  if (!reply.ok()) return reply.status().WithContext("kvd did not join the NCCL link");
  SessionInfo& session = *session_out;
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
    session.nccl_library = c.getLibrary().cStr();
    session.nccl_daemon_device = c.getDevice();
    return Status::Ok();
  }));
  // NCCL: kvd connected to this transport and made the communicators' ids; joining with them
  // completes the pair (in the background, bounded by transport.nccl_init_timeout_ms). A backend
  // without bootstrap bytes connects to kvd's address instead.
  auto peer = path->transport_->Connect(bootstrap.empty() ? daemon_address : bootstrap);
  if (!peer.ok()) return peer.status().WithContext("joining kvd's NCCL link");
  path->peer_ = *peer;
  session.nccl = true;
  KVD_LOG(INFO) << "NCCL link joined" << Kv("library", session.nccl_library) << Kv("device", device)
                << Kv("kvd_device", session.nccl_daemon_device);
  return path;
}

StatusOr<std::vector<PutResult>> NcclPath::PutWindow(std::span<const PutItem> items) {
  put_checksums_.clear();
  for (const PutItem& item : items) {
    uint8_t* copy = host_copy_.Reserve(item.bytes, true);
    KVD_RETURN_IF_ERROR(CopyToHostFrom(copy, item.data, item.bytes, item.cuda_stream, "put data"));
    put_checksums_.push_back(Checksum64(copy, item.bytes));
  }
  return TransferPath::PutWindow(items);
}

StatusOr<transport::TransferHandle> NcclPath::Post(transport::TransferOp op, uint64_t tag,
                                                   void* buffer, size_t bytes) {
  transport::TransferRequest request;
  request.op = op;
  request.peer = peer_;
  request.tag = tag;
  request.buffer = buffer;
  request.length = bytes;
  // NCCL moves CUDA memory; the loopback test backend moves the same (readable) bytes as host.
  request.memory_type = transport_->capabilities().cuda_memory ? transport::MemoryType::kCuda
                                                               : transport::MemoryType::kHost;
  return transport_->Post(request);
}

StatusOr<uint64_t> NcclPath::SentChecksum(size_t i, const PutItem&) {
  if (i >= put_checksums_.size()) {
    return Status::Internal("NCCL put of an item whose checksum was not staged");
  }
  return put_checksums_[i];
}

StatusOr<uint64_t> NcclPath::ReceivedChecksum(const GetItem& item,
                                              const transport::TransferStatus& done) {
  uint8_t* copy = host_copy_.Reserve(done.bytes, true);
  KVD_RETURN_IF_ERROR(CopyToHostFrom(copy, item.out, done.bytes, item.cuda_stream, "get buffer"));
  return Checksum64(copy, done.bytes);
}

}  // namespace kvd::client::internal
