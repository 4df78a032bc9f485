// The end of a put: its bytes land, one of the commit routes stores them, and Commit is answered.
#include <chrono>
#include <functional>
#include <optional>
#include <string>

#include "commit_route.h"
#include "kvd/common/hash.h"
#include "kvd/common/hex.h"
#include "kvd/common/logging.h"
#include "kvd/storage/host_tier.h"
#include "kvd/storage/tier_manager.h"
#include "responses.h"
#include "session.h"

namespace kvd::daemon {

using transport::TransferHandle;
using transport::TransferState;
using transport::TransferStatus;

namespace {

// What the ingest pool did with a compressing put.
struct Stored {
  Status status;
  uint64_t bytes = 0;        // compact bytes stored
  uint32_t codec_id = 0;     // the key's codec id
  uint64_t raw_bytes = 0;    // raw K/V bytes (without window queries)
  double compress_ms = 0.0;  // ChunkCodec::Encode time
};

// On an ingest pool thread: verifies the put's checksum in place, compresses it, returns the raw
// reservation's space, and stores the compact chunk through the tier manager. The raw bytes are
// never published.
Stored CompressAndStore(ChunkCodec* codec, storage::HostTier* host, storage::TierManager* tiers,
                        uint64_t reservation, const storage::ChunkKey& reserved_key,
                        const std::byte* data, uint64_t bytes, uint32_t tokens,
                        uint64_t first_position, uint32_t window, uint64_t checksum) {
  Stored out;
  const uint64_t actual = Checksum64(data, bytes);
  if (actual != checksum) {
    host->Abort(reservation).IgnoreError();
    out.status = Status::DataLoss("checksum mismatch for reservation " +
                                  std::to_string(reservation) + ": client said 0x" +
                                  Hex64(checksum) + ", bytes received hash to 0x" + Hex64(actual));
    return out;
  }
  auto encoded =
      codec->Encode(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(data), bytes), tokens,
                    first_position, window);
  host->Abort(reservation).IgnoreError();  // the raw bytes are no longer needed
  if (!encoded.ok()) {
    out.status =
        encoded.status().WithContext("compressing reservation " + std::to_string(reservation));
    return out;
  }
  storage::ChunkKey key = reserved_key;
  key.codec_id = encoded->codec_id;
  const auto* compact = reinterpret_cast<const std::byte*>(encoded->bytes.data());
  Status s = tiers->Insert(key, tokens, Checksum64(encoded->bytes.data(), encoded->bytes.size()),
                           std::span<const std::byte>(compact, encoded->bytes.size()));
  // A dedup (another put stored the same compact chunk first) stays a dedup: the commit
  // succeeds and is counted as deduplicated, not as a second compressed chunk.
  out.status = s;
  out.bytes = encoded->bytes.size();
  out.codec_id = encoded->codec_id;
  out.raw_bytes = bytes - codec->QueryBytes(window);
  out.compress_ms = encoded->compress_ms;
  return out;
}

// What a put's route reported once its bytes were whole (or not).
struct Landed {
  TransferStatus st;
  std::optional<Status> commit;  // set when the bytes arrived whole and the route ran
  Stored stored;                 // kIngest: what the ingest pool stored
};

// Runs the route of one put (commit_route.h) on the thread the route names, once its bytes are
// whole in the reserved slot, and hands the outcome to `complete` (from whichever thread ran it).
// Lives in FinishCommit's coroutine frame, which outlives every callback it starts.
class RouteRunner {
 public:
  struct Where {
    storage::HostTier* host;
    storage::TierManager* tiers;  // every store of a committed chunk goes through it
    asio::thread_pool* pool;
    ChunkCodec* codec;                      // kIngest only
    storage::DeviceMemory* staging_memory;  // NCCL puts: the link's device memory, else null
  };
  RouteRunner(Where where, const PendingPut* put, uint64_t reservation, uint64_t checksum,
              storage::CommitCheck check)
      : where_(where), put_(put), reservation_(reservation), checksum_(checksum), check_(check) {}

  void Land(const TransferStatus& st, const std::function<void(Landed)>& complete) const {
    switch (ChooseCommitRoute(Facts(st))) {
      case CommitRoute::kTrustLanded:
        return complete(Landed{st, Commit(storage::CommitCheck::kTrustWriter), {}});
      case CommitRoute::kHere:
        return complete(Landed{st, Commit(check_), {}});
      case CommitRoute::kIngest:
        return where_.codec->Submit(put_->ticket, [this, st, complete] { complete(Ingest(st)); });
      case CommitRoute::kPool:
        asio::post(*where_.pool, [this, st, complete] { complete(OnPool(st)); });
        return;
    }
  }

 private:
  CommitRouteFacts Facts(const TransferStatus& st) const {
    return {.compressing = where_.codec != nullptr,
            .device_staging = where_.staging_memory != nullptr,
            .disk_tier = where_.tiers->disk() != nullptr,
            .check = check_,
            .landed_sum_matches = st.checksum_valid && st.checksum == checksum_};
  }
  Status Commit(storage::CommitCheck check) const {
    return where_.tiers->Commit(reservation_, checksum_, check);
  }
  // Over the NCCL link the bytes are in device staging: one copy into the reservation first, so
  // the checksum and everything after it read host bytes as on every other path.
  Status CopyIn() const {
    if (where_.staging_memory == nullptr) return Status::Ok();
    Status s = where_.staging_memory->CopyToHost(put_->data, put_->staging, put_->bytes);
    if (!s.ok()) {
      where_.host->Abort(reservation_).IgnoreError();
      return s.WithContext("copying reservation " + std::to_string(reservation_) +
                           " out of device staging");
    }
    return s;
  }
  Landed Ingest(const TransferStatus& st) const {
    if (Status c = CopyIn(); !c.ok()) return Landed{st, c, {}};
    const PendingPut& p = *put_;
    Stored stored =
        CompressAndStore(where_.codec, where_.host, where_.tiers, reservation_, p.key, p.data,
                         p.bytes, p.tokens, p.first_position, p.window, checksum_);
    Status status = stored.status;
    return Landed{st, status, std::move(stored)};
  }
  Landed OnPool(const TransferStatus& st) const {
    if (Status c = CopyIn(); !c.ok()) return Landed{st, c, {}};
    Status committed = Commit(check_);
    if (committed.ok() && where_.staging_memory != nullptr && where_.tiers->gpu() != nullptr) {
      // The bytes are still in device staging (the GPU tier's device): copied up into the GPU
      // tier device to device when it has room, the host copy staying (best effort).
      Status up = where_.tiers->PromoteFromDevice(put_->key, put_->tokens, checksum_, put_->staging,
                                                  put_->bytes);
      if (!up.ok() && up.code() != StatusCode::kResourceExhausted) {
        KVD_LOG(WARNING) << "NCCL put not copied into the gpu tier"
                         << Kv("key", put_->key.ToString()) << Kv("status", up);
      }
    }
    return Landed{st, committed, {}};
  }

  const Where where_;
  const PendingPut* const put_;
  const uint64_t reservation_;
  const uint64_t checksum_;
  const storage::CommitCheck check_;
};

// Waits until the put's bytes are whole in its slot and its route ran: at once for shared memory
// (`recv` invalid: the client wrote them in place before Commit), else when the receive ends or
// `deadline` passes (Landed::commit unset unless all `expected_bytes` arrived). The route starts
// from the receive's completion (progress thread -> route's thread -> io_context), not via the
// io_context thread first: one thread hand-off less on every put.
asio::awaitable<Landed> AwaitLanded(asio::io_context& io, ProgressLoop* progress,
                                    const RouteRunner* runner, TransferHandle recv,
                                    uint64_t expected_bytes,
                                    std::chrono::steady_clock::time_point deadline) {
  // Only trivially destructible captures in a co_await expression (see Session::FinishLookup).
  if (!recv.valid()) {
    co_return co_await AwaitCallback<Landed>(io, [=](std::function<void(Landed)> complete) {
      TransferStatus done;
      done.state = TransferState::kDone;
      done.bytes = expected_bytes;
      runner->Land(done, complete);
    });
  }
  co_return co_await AwaitCallback<Landed>(io, [=](std::function<void(Landed)> complete) {
    progress->Watch(recv, deadline, [=](const TransferStatus& st) {
      if (st.state == TransferState::kDone && st.bytes == expected_bytes) {
        runner->Land(st, complete);
      } else {
        complete(Landed{st, std::nullopt, {}});
      }
    });
  });
}

}  // namespace

asio::awaitable<void> Session::FinishCommit(uint64_t seq, uint64_t rid, uint64_t reservation,
                                            uint64_t checksum, uint64_t reserve_next) {
  auto self = shared_from_this();  // keep alive across suspension
  const PendingPut put = *puts_.Find(reservation);
  const int64_t timeout_ms = put_services_->config().limits.transfer_timeout_ms;
  ChunkCodec* codec = put.ticket ? codec_ : nullptr;  // a model with a compression policy
  const RouteRunner runner(
      {.host = put_services_->host_tier(),
       .tiers = put_services_->tier_manager(),
       .pool = &put_services_->pool(),
       .codec = codec,
       .staging_memory = put.link == BulkLink::kNccl ? put_services_->nccl().memory() : nullptr},
      &put, reservation, checksum,
      CommitCheckFor(put.written_in_place, put_services_->config().host_verify_shm_commits));
  const Landed landed = co_await AwaitLanded(
      put_services_->io(), &BulkProgress(put.link), &runner, put.recv, put.bytes,
      std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms));
  const TransferStatus& st = landed.st;
  Status status = ReceiveOutcome(st, {reservation, put.bytes, put.tag, put.link, timeout_ms});
  if (st.state == TransferState::kInProgress) ++put_services_->counters().transfer_timeouts;
  bool ended = true;
  if (st.state == TransferState::kInProgress) {
    ended = co_await CancelAndRelease(put.recv, put.link);
  } else if (put.recv.valid()) {
    Bulk(put.link)->Release(put.recv).IgnoreError();
  }
  if (!status.ok()) {
    puts_.EndPut(reservation,
                 {.end = PutEnd::kTransferFailed, .cause = status, .transfer_ended = ended});
    CompleteError(seq, rid, status);
    co_return;
  }
  status = *landed.commit;  // set: the transfer ended whole (else status was not OK above)
  if (!status.ok() && !storage::IsDedup(status)) {
    puts_.EndPut(reservation, {.end = PutEnd::kCommitFailed, .cause = status});
    CompleteError(seq, rid, status);
    co_return;
  }
  const bool dedup = !status.ok();
  CountStoredPut({.bytes = put.bytes,
                  .dedup = dedup,
                  .ahead = put.ahead,
                  .compressed = codec != nullptr,
                  .raw_bytes = landed.stored.raw_bytes,
                  .stored_bytes = landed.stored.bytes,
                  .compress_ms = landed.stored.compress_ms},
                 &put_services_->counters());
  puts_.EndPut(reservation, {.end = PutEnd::kCommitted});
  AnswerCommit(seq, rid,
               {.bytes = put.bytes,
                .stored_bytes = codec != nullptr ? landed.stored.bytes : put.bytes,
                .codec_id = codec != nullptr ? landed.stored.codec_id : put.key.codec_id,
                .already_stored = put.ahead && dedup},
               reserve_next);
  put_services_->MaybeDemote();
}

void Session::AnswerCommit(uint64_t seq, uint64_t rid, const CommitAnswer& answer,
                           uint64_t reserve_next) {
  const std::optional<HeldSlot> next =
      reserve_next > 0 ? ReserveAheadFor(reserve_next) : std::nullopt;
  Frame reply_frame = MakeResponse(rid, [&](proto::Response::Builder r) {
    auto reply = r.initCommit();
    reply.setBytes(answer.bytes);
    reply.setStoredBytes(answer.stored_bytes);
    reply.setCodecId(answer.codec_id);
    reply.setAlreadyStored(answer.already_stored);
    if (next) {
      auto held = reply.initNext();
      held.setReservationId(next->reservation);
      held.setTtlMs(static_cast<uint32_t>(put_services_->config().limits.reservation_ttl_ms));
      SetShmSlot(next->ref, held.initShm());
    }
  });
  if (next) return CompleteShm(seq, std::move(reply_frame), next->ref);
  Complete(seq, std::move(reply_frame));
}

}  // namespace kvd::daemon
