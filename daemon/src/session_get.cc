// Session requests of the get path: Get over the transport or from shared memory, and its send.
#include <string>

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
  const uint64_t lease = get.getLeaseId();
  const uint32_t index = get.getChunkIndex();
  const uint64_t tag = get.getTag();
  const uint64_t buffer_bytes = get.getBufferBytes();
  const proto::ChunkForm form = get.getForm();
  const bool over_nccl = get.getOverNccl();
  if (Status s = RequireEngine("Get"); !s.ok()) return CompleteError(seq, rid, s);
  if (over_nccl && !nccl_peer_.valid()) {
    return CompleteError(seq, rid,
                         Status::FailedPrecondition(
                             "Get.overNccl: this session has no NCCL link; send NcclConnect first "
                             "(or get over the transport)"));
  }
  if (lease == 0) {
    return CompleteError(seq, rid,
                         Status::NotFound("lease 0: the lookup matched nothing, nothing to get"));
  }
  storage::HostTier* tier = server_->host_tier();
  auto view = tier->Get(lease, index, id_);  // a lease serves only the connection that took it
  if (!view.ok()) return CompleteError(seq, rid, view.status());
  const bool compact = view->meta.key.codec_id != storage::kRawCodecId;
  if ((form == proto::ChunkForm::RAW && compact) ||
      (form == proto::ChunkForm::COMPACT && !compact)) {
    tier->ReleaseRead(view->read_id).IgnoreError();
    return CompleteError(
        seq, rid,
        Status::FailedPrecondition(
            "chunk " + std::to_string(index) + " of lease " + std::to_string(lease) +
            " is stored " +
            (compact ? "compact (codec " + std::to_string(view->meta.key.codec_id) +
                           "); the daemon does not expand chunks: get it as stored and expand "
                           "it with the client library (kvd/client/expand.h)"
                     : std::string("raw (codec 0): it has no compact form"))));
  }
  if (form != proto::ChunkForm::AS_STORED && form != proto::ChunkForm::RAW &&
      form != proto::ChunkForm::COMPACT) {
    tier->ReleaseRead(view->read_id).IgnoreError();
    return CompleteError(
        seq, rid,
        Status::InvalidArgument("unknown chunk form " + std::to_string(static_cast<int>(form))));
  }
  if (buffer_bytes < view->meta.size_bytes) {
    tier->ReleaseRead(view->read_id).IgnoreError();
    return CompleteError(
        seq, rid,
        Status::OutOfRange("chunk " + std::to_string(index) + " of lease " + std::to_string(lease) +
                           " is " + std::to_string(view->meta.size_bytes) +
                           " bytes; the client's buffer holds " + std::to_string(buffer_bytes)));
  }
  // Bytes about to leave host memory (transport or NCCL send) must still be the committed ones;
  // a changed chunk is dropped (on the shared-memory path the client verifies what it reads).
  if (!shm_ && !server_->tier_manager()->VerifyLeavingHost(*view, over_nccl ? "nccl" : "transport")) {
    return CompleteError(
        seq, rid,
        Status::DataLoss("get: checksum mismatch on chunk " + std::to_string(index) + " of lease " +
                         std::to_string(lease) +
                         ": its bytes changed in kvd's memory after the commit; chunk dropped"));
  }
  if (over_nccl) {
    SpawnHandler(FinishNcclGet(seq, rid, *view, tag));
    return;
  }
  if (shm_) {
    // The client copies from (or reads in place) the pinned slot, then sends ReleaseRead.
    auto ref = PrepareShm(view->offset);
    if (!ref.ok()) {
      tier->ReleaseRead(view->read_id).IgnoreError();
      return CompleteError(seq, rid, ref.status());
    }
    shm_reads_.insert(view->read_id);
    ++server_->counters().gets;
    server_->counters().get_bytes += view->meta.size_bytes;
    CompleteShm(seq,
                MakeResponse(rid,
                             [&](proto::Response::Builder r) {
                               auto reply = r.initGet();
                               reply.setBytes(view->meta.size_bytes);
                               reply.setChecksum(view->meta.checksum);
                               reply.setTokens(view->meta.tokens);
                               reply.setReadId(view->read_id);
                               reply.setReadTtlMs(static_cast<uint32_t>(
                                   server_->config().host_tier.read_ttl.count()));
                               reply.setCodecId(view->meta.key.codec_id);
                               reply.setForm(view->meta.key.codec_id == storage::kRawCodecId
                                                 ? proto::ChunkForm::RAW
                                                 : proto::ChunkForm::COMPACT);
                               auto slot = reply.initShm();
                               slot.setSegment(ref->segment);
                               slot.setOffset(ref->offset);
                               slot.setGeneration(ref->generation);
                               slot.setFdAttached(ref->fd >= 0);
                             }),
                *ref);
    return;
  }
  auto peer = TransportPeer();
  auto send = peer.ok()
                  ? server_->transport()->PostSend(*peer, tag, view->data, view->meta.size_bytes)
                  : StatusOr<TransferHandle>(peer.status());
  if (!send.ok()) {
    tier->ReleaseRead(view->read_id).IgnoreError();
    return CompleteError(seq, rid, send.status().WithContext("cannot send the chunk"));
  }
  active_sends_.insert(send->id);
  SpawnHandler(FinishGet(seq, rid, *view, *send));
}

asio::awaitable<void> Session::FinishGet(uint64_t seq, uint64_t rid, storage::ReadView view,
                                         TransferHandle send, bool nccl, void* staging) {
  auto self = shared_from_this();
  const int64_t timeout_ms = server_->config().limits.transfer_timeout_ms;
  TransferStatus st = co_await AwaitTransfer(send, timeout_ms, nccl);
  Status status;
  bool ended = true;
  if (st.state == TransferState::kInProgress) {
    ++server_->counters().transfer_timeouts;
    status = Status::DeadlineExceeded(
        "the client did not take the chunk (" + std::to_string(view.meta.size_bytes) +
        " bytes) within limits.transfer_timeout_ms=" + std::to_string(timeout_ms) +
        "; did it post a receive with the Get's tag?");
    ended = co_await CancelAndRelease(send, nccl);
  } else {
    if (st.state == TransferState::kError) {
      status = st.status.WithContext(nccl ? "send of the chunk over the NCCL link"
                                          : "send of the chunk");
    }
    Bulk(nccl)->Release(send).IgnoreError();
  }
  (nccl ? active_nccl_sends_ : active_sends_).erase(send.id);
  if (ended) FreeStaging(staging);
  // The pin goes only once the transport no longer reads the chunk's bytes.
  if (ended) server_->host_tier()->ReleaseRead(view.read_id).IgnoreError();
  if (!status.ok()) {
    CompleteError(seq, rid, status);
    co_return;
  }
  ++server_->counters().gets;
  server_->counters().get_bytes += view.meta.size_bytes;
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initGet();
             reply.setBytes(view.meta.size_bytes);
             reply.setChecksum(view.meta.checksum);
             reply.setTokens(view.meta.tokens);
             reply.setCodecId(view.meta.key.codec_id);
             reply.setForm(view.meta.key.codec_id == storage::kRawCodecId
                               ? proto::ChunkForm::RAW
                               : proto::ChunkForm::COMPACT);
           }));
}

}  // namespace kvd::daemon
