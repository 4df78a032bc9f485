// The end of a put: its bytes land, one of the commit routes stores them, and Commit is answered.
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>

#include "kvd/common/hash.h"
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

std::string Hex64(uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof(buf), "0x%016" PRIx64, v);
  return buf;
}

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
                                  std::to_string(reservation) + ": client said " + Hex64(checksum) +
                                  ", bytes received hash to " + Hex64(actual));
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

}  // namespace

asio::awaitable<void> Session::FinishCommit(uint64_t seq, uint64_t rid, uint64_t reservation,
                                            uint64_t checksum, uint64_t reserve_next) {
  auto self = shared_from_this();  // keep alive across suspension
  const PendingPut put = *puts_.Find(reservation);
  const int64_t timeout_ms = server_->config().limits.transfer_timeout_ms;
  storage::HostTier* tier = server_->host_tier();
  // Every store of a committed chunk goes through the tier manager (durable with a disk tier).
  storage::TierManager* tiers = server_->tier_manager();
  // The checksum is verified on the pool straight from the receive's completion (progress
  // thread -> pool -> io_context), not via the io_context thread first: one thread hand-off
  // less on every put (it reads the whole chunk, so it stays off the io_context thread).
  struct Landed {
    TransferStatus st;
    std::optional<Status> commit;  // set when the bytes arrived whole and Commit ran
    Stored stored;                 // compressing puts: what the ingest pool stored
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  ProgressLoop* progress = &BulkProgress(put.nccl);
  asio::thread_pool* pool = &server_->pool();
  // Over the NCCL link the bytes are in device staging: one copy into the reservation first, so
  // the checksum and everything after it read host bytes as on every other path.
  storage::DeviceMemory* staging_memory = put.nccl ? server_->nccl().memory() : nullptr;
  const TransferHandle recv = put.recv;
  const uint64_t expected_bytes = put.bytes;
  // A model with a compression policy: the ingest pool verifies, compresses and stores.
  ChunkCodec* codec = put.ticket ? codec_ : nullptr;
  // A shared-memory put carries the checksum its writer computed over the bytes it copied in:
  // recorded without reading them unless tiers.host.verify_shm_commits (config.h says why).
  const storage::CommitCheck check =
      put.written_in_place && !server_->config().host_verify_shm_commits
          ? storage::CommitCheck::kTrustWriter
          : storage::CommitCheck::kVerify;
  // Such a commit reads no bytes and, without a disk tier, writes none: it runs right here on
  // the io thread, sparing the two thread hand-offs (to the pool and back) of the others.
  const bool commit_here = check == storage::CommitCheck::kTrustWriter && codec == nullptr &&
                           staging_memory == nullptr && tiers->disk() == nullptr;
  // Only trivially destructible captures in a co_await expression (see FinishLookup): the
  // put is read through a pointer into this coroutine's frame, which outlives the callback.
  const PendingPut* pput = &put;
  // Runs once the bytes are complete in the reserved slot: compress and store (codec), or verify
  // and commit through the tier manager; either way on a worker thread, never the io thread
  // (but for `commit_here`, which reads no bytes).
  auto copy_in = [=]() -> Status {
    if (staging_memory == nullptr) return Status::Ok();
    Status s = staging_memory->CopyToHost(pput->data, pput->staging, pput->bytes);
    if (!s.ok()) {
      tier->Abort(reservation).IgnoreError();
      return s.WithContext("copying reservation " + std::to_string(reservation) +
                           " out of device staging");
    }
    return s;
  };
  // A transport put whose bytes the transport copied itself (same host) comes with their
  // checksum, computed block by block as they landed: when it equals the client's, the daemon
  // was the writer that hashed them, and the commit records it without reading the chunk again
  // (kTrustWriter), right in the transfer's completion, without the pool hand-off. A mismatch
  // takes the verifying commit below (DATA_LOSS, counted, nothing stored).
  const bool may_commit_landed =
      codec == nullptr && staging_memory == nullptr && tiers->disk() == nullptr;
  auto land = [=](const TransferStatus& st, std::function<void(Landed)> complete) {
    if (may_commit_landed && st.checksum_valid && st.checksum == checksum) {
      complete(
          Landed{st, tiers->Commit(reservation, checksum, storage::CommitCheck::kTrustWriter), {}});
      return;
    }
    if (codec != nullptr) {
      codec->Submit(pput->ticket, [=] {
        if (Status c = copy_in(); !c.ok()) return complete(Landed{st, c, {}});
        const PendingPut& p = *pput;
        Stored stored = CompressAndStore(codec, tier, tiers, reservation, p.key, p.data, p.bytes,
                                         p.tokens, p.first_position, p.window, checksum);
        Status status = stored.status;
        complete(Landed{st, status, std::move(stored)});
      });
    } else if (commit_here) {
      complete(Landed{st, tiers->Commit(reservation, checksum, check), {}});
    } else {
      asio::post(*pool, [=] {
        if (Status c = copy_in(); !c.ok()) return complete(Landed{st, c, {}});
        Status committed = tiers->Commit(reservation, checksum, check);
        if (committed.ok() && staging_memory != nullptr && tiers->gpu() != nullptr) {
          // The bytes are still in device staging (the GPU tier's device): copied up into the
          // GPU tier device to device when it has room, the host copy staying (best effort).
          Status up = tiers->PromoteFromDevice(pput->key, pput->tokens, checksum, pput->staging,
                                               pput->bytes);
          if (!up.ok() && up.code() != StatusCode::kResourceExhausted) {
            KVD_LOG(WARNING) << "NCCL put not copied into the gpu tier"
                             << Kv("key", pput->key.ToString()) << Kv("status", up);
          }
        }
        complete(Landed{st, committed, {}});
      });
    }
  };
  Landed landed;
  if (!recv.valid()) {
    // Shared memory: the client wrote the bytes in place before sending Commit.
    landed =
        co_await AwaitCallback<Landed>(server_->io(), [=](std::function<void(Landed)> complete) {
          TransferStatus done;
          done.state = TransferState::kDone;
          done.bytes = expected_bytes;
          land(done, std::move(complete));
        });
  } else {
    landed =
        co_await AwaitCallback<Landed>(server_->io(), [=](std::function<void(Landed)> complete) {
          progress->Watch(recv, deadline, [=](const TransferStatus& st) {
            if (st.state == TransferState::kDone && st.bytes == expected_bytes) {
              land(st, complete);
            } else {
              complete(Landed{st, std::nullopt, {}});
            }
          });
        });
  }
  const TransferStatus& st = landed.st;
  Status status;
  if (st.state == TransferState::kInProgress) {
    ++server_->counters().transfer_timeouts;
    status = Status::DeadlineExceeded(
        "the bytes of reservation " + std::to_string(reservation) + " (" +
        std::to_string(put.bytes) + " bytes, tag " + std::to_string(put.tag) +
        ") did not arrive within limits.transfer_timeout_ms=" + std::to_string(timeout_ms));
  } else if (st.state == TransferState::kError) {
    status = st.status.WithContext("receive of reservation " + std::to_string(reservation) +
                                   (put.nccl ? " over the NCCL link" : ""));
  } else if (st.bytes != put.bytes) {
    status = Status::DataLoss("reservation " + std::to_string(reservation) + ": received " +
                              std::to_string(st.bytes) + " bytes, expected " +
                              std::to_string(put.bytes));
  }
  bool ended = true;
  if (st.state == TransferState::kInProgress) {
    ended = co_await CancelAndRelease(put.recv, put.nccl);
  } else if (put.recv.valid()) {
    Bulk(put.nccl)->Release(put.recv).IgnoreError();
  }
  if (!status.ok()) {
    puts_.EndPut(reservation,
                 {.end = PutEnd::kTransferFailed, .cause = status, .transfer_ended = ended});
    CompleteError(seq, rid, status);
    co_return;
  }
  status = *landed.commit;  // set: the transfer ended whole (else status was not OK above)
  if (status.ok() || storage::IsDedup(status)) {
    if (status.ok()) {
      ++server_->counters().puts_committed;
      server_->counters().put_bytes += put.bytes;
      if (codec != nullptr) {
        ++server_->counters().chunks_compressed;
        server_->counters().compressed_raw_bytes += landed.stored.raw_bytes;
        server_->counters().compressed_bytes += landed.stored.bytes;
        server_->counters().compress_us +=
            static_cast<uint64_t>(landed.stored.compress_ms * 1000.0);
      }
    } else {
      ++server_->counters().puts_deduplicated;
      // Held ahead, the chunk was unknown until now: its bytes were copied for nothing.
      if (put.ahead) ++server_->counters().puts_copied_for_nothing;
    }
    if (put.ahead) ++server_->counters().puts_reserved_ahead;
    puts_.EndPut(reservation, {.end = PutEnd::kCommitted});
    const std::optional<HeldSlot> next =
        reserve_next > 0 ? ReserveAheadFor(reserve_next) : std::nullopt;
    const bool dedup_ahead = put.ahead && !status.ok();
    Frame reply_frame = MakeResponse(rid, [&](proto::Response::Builder r) {
      auto reply = r.initCommit();
      reply.setBytes(put.bytes);
      reply.setStoredBytes(codec != nullptr ? landed.stored.bytes : put.bytes);
      reply.setCodecId(codec != nullptr ? landed.stored.codec_id : put.key.codec_id);
      reply.setAlreadyStored(dedup_ahead);
      if (next) {
        auto held = reply.initNext();
        held.setReservationId(next->reservation);
        held.setTtlMs(static_cast<uint32_t>(server_->config().limits.reservation_ttl_ms));
        auto slot = held.initShm();
        slot.setSegment(next->ref.segment);
        slot.setOffset(next->ref.offset);
        slot.setGeneration(next->ref.generation);
        slot.setFdAttached(next->ref.fd >= 0);
      }
    });
    if (next) {
      CompleteShm(seq, std::move(reply_frame), next->ref);
    } else {
      Complete(seq, std::move(reply_frame));
    }
    server_->MaybeDemote();
    co_return;
  }
  puts_.EndPut(reservation, {.end = PutEnd::kCommitFailed, .cause = status});
  CompleteError(seq, rid, status);
}

}  // namespace kvd::daemon
