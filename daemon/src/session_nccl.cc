// Session requests of the NCCL link: NcclConnect, and Gets over the link. Puts over the link are
// Reserve/Commit with Reserve.overNccl (session_put.cc, session_commit.cc): only where their bytes land differs.
#include "kvd/common/logging.h"
#include "responses.h"
#include "session.h"

namespace kvd::daemon {

using transport::TransferHandle;

void Session::FreeStaging(void* staging) { server_->nccl().ReleaseStaging(staging); }

void Session::HandleNcclConnect(uint64_t seq, uint64_t rid, proto::NcclConnect::Reader connect) {
  auto bytes = connect.getAddress();
  const std::string address(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
  if (Status s = RequireEngine("NcclConnect"); !s.ok()) return CompleteError(seq, rid, s);
  if (Link(BulkLink::kNccl).peer.valid()) {
    return CompleteError(
        seq, rid,
        Status::FailedPrecondition("NcclConnect: this session already has an NCCL link (one per "
                                   "session; it ends with the session)"));
  }
  if (address.empty()) {
    return CompleteError(seq, rid,
                         Status::InvalidArgument("NcclConnect.address is empty: send the client's "
                                                 "NCCL transport LocalAddress"));
  }
  NcclLink& link = server_->nccl();
  if (Status s = link.Ensure(); !s.ok()) {
    ++server_->counters().nccl_refused;
    KVD_LOG(INFO) << "NCCL link refused" << Kv("session", id_) << Kv("client", client_id_)
                  << Kv("status", s);
    return CompleteError(seq, rid, s);  // the session keeps serving over its transport
  }
  transport::Transport* t = link.transport();
  // NCCL: makes the communicators' unique ids and starts joining them in the background (a
  // client that never Connects with the bootstrap bytes fails the peer after the init timeout).
  auto peer = t->Connect(address);
  if (!peer.ok()) {
    return CompleteError(
        seq, rid,
        peer.status().WithContext("NcclConnect: cannot join the client's NCCL transport"));
  }
  auto bootstrap = t->PeerBootstrap(*peer);
  auto local = t->LocalAddress();
  if (!bootstrap.ok() || !local.ok()) {
    t->Disconnect(*peer).IgnoreError();
    return CompleteError(seq, rid,
                         (bootstrap.ok() ? local.status() : bootstrap.status())
                             .WithContext("NcclConnect: the link's bootstrap bytes"));
  }
  Link(BulkLink::kNccl).peer = *peer;
  ++server_->counters().nccl_links;
  KVD_LOG(INFO) << "NCCL link joined" << Kv("session", id_) << Kv("client", client_id_)
                << Kv("library", t->capabilities().library) << Kv("device", link.device());
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initNcclConnected();
             reply.setBootstrap(kj::arrayPtr(
                 reinterpret_cast<const capnp::byte*>(bootstrap->data()), bootstrap->size()));
             reply.setAddress(
                 kj::arrayPtr(reinterpret_cast<const capnp::byte*>(local->data()), local->size()));
             reply.setLibrary(t->capabilities().library);
             reply.setDevice(link.device());
           }));
}

asio::awaitable<void> Session::FinishNcclGet(uint64_t seq, uint64_t rid, storage::ReadView view,
                                             uint64_t tag) {
  auto self = shared_from_this();
  NcclLink& link = server_->nccl();
  storage::DeviceMemory* memory = link.memory();
  const uint64_t bytes = view.meta.size_bytes;
  auto fail = [&](const Status& status, void* staging) {
    FreeStaging(staging);
    server_->host_tier()->ReleaseRead(view.read_id).IgnoreError();
    CompleteError(seq, rid, status);
  };
  auto staging = link.AcquireStaging(bytes);
  if (!staging.ok()) {
    fail(staging.status().WithContext("cannot stage the chunk for the NCCL link"), nullptr);
    co_return;
  }
  void* dst = *staging;
  const std::byte* src = view.data;
  storage::GpuTier* gpu = server_->tier_manager()->gpu();
  const storage::ChunkKey* key = &view.meta.key;  // in this coroutine's frame
  // From the GPU tier's copy when it holds one (device to device; verified when it was stored),
  // else from the leased host bytes.
  Status copied = co_await OffloadTo<Status>(server_->pool(), server_->io(),
                                             [memory, gpu, key, dst, src, bytes] {
                                               if (gpu != nullptr && gpu->Contains(*key)) {
                                                 auto read = gpu->ReadIntoDevice(*key, dst, bytes);
                                                 if (read.ok() && read->size_bytes == bytes)
                                                   return Status::Ok();
                                               }
                                               return memory->CopyToDevice(dst, src, bytes);
                                             });
  if (!copied.ok()) {
    fail(copied.WithContext("copying the chunk into device staging"), dst);
    co_return;
  }
  if (read_closed_ || closed_ || !Link(BulkLink::kNccl).peer.valid()) {
    // The teardown already cancelled this session's sends: post nothing more.
    fail(Status::Cancelled("the session is closing"), dst);
    co_return;
  }
  transport::TransferRequest request;
  request.op = transport::TransferOp::kSend;
  request.peer = Link(BulkLink::kNccl).peer;
  request.tag = tag;
  request.buffer = dst;
  request.length = bytes;
  request.memory_type = link.memory_type();
  auto send = link.transport()->Post(request);
  if (!send.ok()) {
    fail(send.status().WithContext("cannot send the chunk over the NCCL link"), dst);
    co_return;
  }
  Link(BulkLink::kNccl).active_sends.insert(send->id);
  co_await FinishGet(seq, rid, view, *send, BulkLink::kNccl, dst);
}

}  // namespace kvd::daemon
