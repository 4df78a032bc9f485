// Session requests of the get path: Get over the transport or from shared memory, and its send.
#include <string>

#include "get_request.h"
#include "kvd/common/logging.h"
#include "kvd/storage/host_tier.h"
#include "kvd/storage/tier_manager.h"
#include "responses.h"
#include "session.h"

namespace kvd::daemon {

using transport::TransferHandle;
using transport::TransferState;
using transport::TransferStatus;

void Session::HandleGet(uint64_t seq, uint64_t rid, proto::Get::Reader get) {
  const GetAsk ask{.lease = get.getLeaseId(),
                   .index = get.getChunkIndex(),
                   .form = get.getForm(),
                   .buffer_bytes = get.getBufferBytes()};
  const uint64_t tag = get.getTag();
  const BulkLink link = get.getOverNccl() ? BulkLink::kNccl : BulkLink::kTransport;
  auto view = OpenGet(ask, link);
  if (!view.ok()) return CompleteError(seq, rid, view.status());
  if (link == BulkLink::kNccl) return SpawnHandler(FinishNcclGet(seq, rid, *view, tag));
  if (shm_) return ServeShmGet(seq, rid, *view);
  SendGet(seq, rid, *view, tag);
}

StatusOr<storage::ReadView> Session::OpenGet(const GetAsk& ask, BulkLink link) {
  KVD_RETURN_IF_ERROR(RequireEngine("Get"));
  if (link == BulkLink::kNccl && !Link(BulkLink::kNccl).peer.valid()) {
    return Status::FailedPrecondition(
        "Get.overNccl: this session has no NCCL link; send NcclConnect first "
        "(or get over the transport)");
  }
  if (ask.lease == 0) {
    return Status::NotFound("lease 0: the lookup matched nothing, nothing to get");
  }
  storage::HostTier* tier = get_services_->host_tier();
  // A lease serves only the connection that took it.
  KVD_ASSIGN_OR_RETURN(storage::ReadView view, tier->Get(ask.lease, ask.index, id_));
  if (Status s = CheckGetOf(ask, view.meta); !s.ok()) {
    tier->ReleaseRead(view.read_id).IgnoreError();
    return s;
  }
  // Bytes about to leave host memory (transport or NCCL send) must still be the committed ones;
  // a changed chunk is dropped (on the shared-memory path the client verifies what it reads).
  if (!shm_ &&
      !get_services_->tier_manager()->VerifyLeavingHost(view, link == BulkLink::kNccl ? "nccl" : "transport")) {
    return Status::DataLoss("get: checksum mismatch on " + ChunkName(ask) +
                            ": its bytes changed in kvd's memory after the commit; chunk dropped");
  }
  return view;
}

void Session::ServeShmGet(uint64_t seq, uint64_t rid, const storage::ReadView& view) {
  // The client copies from (or reads in place) the pinned slot, then sends ReleaseRead.
  auto ref = PrepareShm(view.offset);
  if (!ref.ok()) {
    get_services_->host_tier()->ReleaseRead(view.read_id).IgnoreError();
    return CompleteError(seq, rid, ref.status());
  }
  shm_reads_.insert(view.read_id);
  CountGet(view.meta.size_bytes);
  const auto read_ttl = static_cast<uint32_t>(get_services_->config().host_tier.read_ttl.count());
  CompleteShm(seq,
              MakeResponse(rid,
                           [&](proto::Response::Builder r) {
                             auto reply = r.initGet();
                             SetChunkOf(view.meta, reply);
                             reply.setReadId(view.read_id);
                             reply.setReadTtlMs(read_ttl);
                             SetShmSlot(*ref, reply.initShm());
                           }),
              *ref);
}

void Session::SendGet(uint64_t seq, uint64_t rid, const storage::ReadView& view, uint64_t tag) {
  auto peer = TransportPeer();
  auto send =
      peer.ok() ? get_services_->transport()->PostSend(*peer, tag, view.data, view.meta.size_bytes)
                : StatusOr<TransferHandle>(peer.status());
  if (!send.ok()) {
    get_services_->host_tier()->ReleaseRead(view.read_id).IgnoreError();
    return CompleteError(seq, rid, send.status().WithContext("cannot send the chunk"));
  }
  Link(BulkLink::kTransport).active_sends.insert(send->id);
  SpawnHandler(FinishGet(seq, rid, view, *send, BulkLink::kTransport));
}

void Session::CountGet(uint64_t bytes) {
  ++get_services_->counters().gets;
  get_services_->counters().get_bytes += bytes;
}

asio::awaitable<void> Session::FinishGet(uint64_t seq, uint64_t rid, storage::ReadView view,
                                         TransferHandle send, BulkLink link, void* staging) {
  auto self = shared_from_this();
  const int64_t timeout_ms = get_services_->config().limits.transfer_timeout_ms;
  TransferStatus st = co_await AwaitTransfer(send, timeout_ms, link);
  Status status;
  bool ended = true;
  if (st.state == TransferState::kInProgress) {
    ++get_services_->counters().transfer_timeouts;
    status = Status::DeadlineExceeded(
        "the client did not take the chunk (" + std::to_string(view.meta.size_bytes) +
        " bytes) within limits.transfer_timeout_ms=" + std::to_string(timeout_ms) +
        "; did it post a receive with the Get's tag?");
    ended = co_await CancelAndRelease(send, link);
  } else {
    if (st.state == TransferState::kError) {
      status = st.status.WithContext(link == BulkLink::kNccl ? "send of the chunk over the NCCL link"
                                                             : "send of the chunk");
    }
    Bulk(link)->Release(send).IgnoreError();
  }
  Link(link).active_sends.erase(send.id);
  if (ended) FreeStaging(staging);
  // The pin goes only once the transport no longer reads the chunk's bytes.
  if (ended) get_services_->host_tier()->ReleaseRead(view.read_id).IgnoreError();
  if (!status.ok()) {
    CompleteError(seq, rid, status);
    co_return;
  }
  CountGet(view.meta.size_bytes);
  Complete(seq, MakeResponse(
                    rid, [&](proto::Response::Builder r) { SetChunkOf(view.meta, r.initGet()); }));
}

}  // namespace kvd::daemon
