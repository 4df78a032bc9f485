// Session requests of the put path before and around the commit: the checks and reservation of a
// put (Reserve, InlinePut), Commit and Abort, reserve-ahead slots, and expiry.
#include <chrono>
#include <cstring>
#include <optional>
#include <string>

#include "kvd/common/logging.h"
#include "kvd/proto/convert.h"
#include "kvd/storage/host_tier.h"
#include "responses.h"
#include "session.h"

namespace kvd::daemon {

using transport::TransferHandle;
using transport::TransferState;
using transport::TransferStatus;

std::chrono::milliseconds Session::TierReservationTtl() const {
  // The tier's own TTL is a backstop well after the daemon's: the daemon must cancel the
  // posted receive before the space can be reused.
  const DaemonConfig& config = put_services_->config();
  return std::chrono::milliseconds(config.limits.reservation_ttl_ms +
                                   2 * config.limits.transfer_timeout_ms +
                                   config.transport.close_timeout_ms + 60000);
}

Status Session::CheckPutShape(uint32_t tokens, uint64_t bytes, uint32_t window) const {
  const DaemonConfig& config = put_services_->config();
  if (tokens == 0 || tokens > static_cast<uint32_t>(config.chunk_tokens)) {
    return Status::OutOfRange("tokens " + std::to_string(tokens) + " is outside [1, chunk_tokens=" +
                              std::to_string(config.chunk_tokens) + "]");
  }
  if (codec_ == nullptr && window != 0) {
    return Status::FailedPrecondition("windowTokens " + std::to_string(window) + ": model " +
                                      model_->name +
                                      " has no compression policy (raw chunks), so it takes no "
                                      "window queries; put the raw chunk alone");
  }
  if (codec_ != nullptr) KVD_RETURN_IF_ERROR(codec_->CheckPut(tokens, window));
  const uint64_t raw_expected = model_->layout.ChunkBytes(static_cast<int>(tokens));
  const uint64_t query_bytes = codec_ != nullptr ? codec_->QueryBytes(window) : 0;
  const uint64_t expected = raw_expected + query_bytes;
  if (bytes != expected) {
    return Status::InvalidArgument(
        "bytes " + std::to_string(bytes) + " != " + std::to_string(expected) +
        " = layout.ChunkBytes(tokens=" + std::to_string(tokens) + ") of model " + model_->name +
        (codec_ == nullptr
             ? " (raw codec)"
             : " + " + std::to_string(query_bytes) + " bytes of " + std::to_string(window) +
                   " window-query tokens (float32, layers x q_heads x "
                   "head_dim each)"));
  }
  if (bytes > config.limits.max_chunk_bytes) {
    return Status::OutOfRange("chunk of " + std::to_string(bytes) +
                              " bytes is over limits.max_chunk_bytes " +
                              std::to_string(config.limits.max_chunk_bytes));
  }
  return Status::Ok();
}

Session::PutShape Session::ShapeOf(proto::Reserve::Reader chunk) {
  return {.hash = proto::FromProto(chunk.getChunkHash()),
          .tokens = chunk.getTokens(),
          .bytes = chunk.getBytes(),
          .first_position = chunk.getFirstPosition(),
          .window = chunk.getWindowTokens()};
}

StatusOr<Session::ReservedPut> Session::ReservePut(const char* op, const PutShape& shape) {
  const auto& [hash, tokens, bytes, first_position, window] = shape;
  KVD_RETURN_IF_ERROR(RequireEngine(op));
  if (read_only_) {
    return Status::PermissionDenied(std::string(op) +
                                    ": this session said Hello.readOnly (it reads, never puts)");
  }
  KVD_RETURN_IF_ERROR(CheckPutShape(tokens, bytes, window));
  const DaemonConfig& config = put_services_->config();
  std::shared_ptr<void> ticket;
  if (codec_ != nullptr) {
    auto admitted = codec_->Admit();
    if (!admitted.ok()) {
      ++put_services_->counters().ingest_rejected;
      return admitted.status();
    }
    ticket = std::move(*admitted);
  }
  storage::ChunkKey key{name_space_, model_->name, layout_digest_, ServedCodecId(), hash};
  const int64_t ttl_ms = config.limits.reservation_ttl_ms;
  ReservedPut out;
  auto reservation =
      put_services_->host_tier()->Reserve(key, bytes, tokens, id_, TierReservationTtl());
  if (!reservation.ok()) {
    if (!storage::IsDedup(reservation.status())) return reservation.status();
    ++put_services_->counters().puts_deduplicated;
    out.already_stored = true;
    return out;
  }
  out.reservation = *reservation;
  PendingPut& put = out.put;
  put.bytes = bytes;
  put.deadline_ns = put_services_->clock()->NowNanos() + ttl_ms * 1000000;
  put.ticket = std::move(ticket);
  put.data = reservation->data;
  put.key = key;
  put.tokens = tokens;
  put.first_position = first_position;
  put.window = window;
  return out;
}

void Session::HandleReserve(uint64_t seq, uint64_t rid, proto::Reserve::Reader reserve) {
  const PutShape shape = ShapeOf(reserve);
  const BulkLink link = reserve.getOverNccl() ? BulkLink::kNccl : BulkLink::kTransport;
  const uint64_t abort_first = reserve.getAbortFirst();
  if (Status s = RequireEngine("Reserve"); !s.ok()) return CompleteError(seq, rid, s);
  // A held slot this put does not fit goes first: its space may be what this put needs.
  if (abort_first != 0 && ReservesAhead()) AbortHeldSlot(abort_first);
  if (link == BulkLink::kNccl && !Link(BulkLink::kNccl).peer.valid()) {
    return CompleteError(seq, rid,
                         Status::FailedPrecondition(
                             "Reserve.overNccl: this session has no NCCL link; send NcclConnect "
                             "first (or put over the transport)"));
  }
  auto reserved = ReservePut("Reserve", shape);
  if (!reserved.ok()) return CompleteError(seq, rid, reserved.status());
  if (reserved->already_stored) {
    return Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
                      auto reply = r.initReserve();
                      reply.setAlreadyStored(true);
                    }));
  }
  const int64_t ttl_ms = put_services_->config().limits.reservation_ttl_ms;
  const storage::Reservation* reservation = &reserved->reservation;
  PendingPut put = std::move(reserved->put);
  if (shm_ && link == BulkLink::kTransport) {
    // The client writes the bytes into the slot itself; nothing to receive.
    auto ref = HoldShmSlot(reservation->id, reservation->offset, std::move(put));
    if (!ref.ok()) return CompleteError(seq, rid, ref.status());
    CompleteShm(seq,
                MakeResponse(rid,
                             [&](proto::Response::Builder r) {
                               auto reply = r.initReserve();
                               reply.setReservationId(reservation->id);
                               reply.setAlreadyStored(false);
                               reply.setTtlMs(static_cast<uint32_t>(ttl_ms));
                               SetShmSlot(*ref, reply.initShm());
                             }),
                *ref);
    return;
  }
  const uint64_t tag = (id_ << 40) | (next_tag_++ & ((uint64_t{1} << 40) - 1));
  auto recv = PostPutReceive(*reservation, tag, link, &put);
  if (!recv.ok()) {
    put_services_->host_tier()->Abort(reservation->id).IgnoreError();
    return CompleteError(seq, rid, recv.status());
  }
  put.recv = *recv;
  put.tag = tag;
  puts_.File(reservation->id, put);  // its bytes are due: the transport is polled for them
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initReserve();
             reply.setReservationId(reservation->id);
             reply.setTag(tag);
             reply.setAlreadyStored(false);
             reply.setTtlMs(static_cast<uint32_t>(ttl_ms));
           }));
}

StatusOr<TransferHandle> Session::PostPutReceive(const storage::Reservation& reservation,
                                                 uint64_t tag, BulkLink link, PendingPut* put) {
  const uint64_t bytes = put->bytes;
  StatusOr<TransferHandle> recv = Status::Internal("no receive");
  if (link == BulkLink::kNccl) {
    // The bytes land in device memory of the link, copied into the reservation on Commit.
    NcclLink& nccl = put_services_->nccl();
    auto staging = nccl.AcquireStaging(bytes);
    if (!staging.ok()) {
      return staging.status().WithContext("cannot stage the put over the NCCL link");
    }
    transport::TransferRequest request;
    request.op = transport::TransferOp::kRecv;
    request.peer = Link(BulkLink::kNccl).peer;
    request.tag = tag;
    request.buffer = *staging;
    request.length = bytes;
    request.memory_type = nccl.memory_type();
    recv = nccl.transport()->Post(request);
    if (!recv.ok()) FreeStaging(*staging);
    put->link = BulkLink::kNccl;
    put->staging = *staging;
  } else {
    // The transport hashes the bytes as they land where it copies them itself (same host):
    // the commit then compares checksums instead of reading the chunk again.
    auto peer = TransportPeer();
    if (peer.ok()) {
      recv = put_services_->transport()->PostRecv(*peer, tag, reservation.data, bytes,
                                                  {.want_checksum = true});
    } else {
      recv = peer.status();
    }
  }
  if (!recv.ok()) return recv.status().WithContext("cannot post the receive of the put");
  return recv;
}

void Session::HandleInlinePut(uint64_t seq, uint64_t rid, proto::InlinePut::Reader inline_put) {
  const uint64_t checksum = inline_put.getChecksum();
  const capnp::Data::Reader data = inline_put.getData();
  auto reserved = ReservePut("InlinePut", {.hash = proto::FromProto(inline_put.getChunkHash()),
                                           .tokens = inline_put.getTokens(),
                                           .bytes = data.size(),
                                           .first_position = inline_put.getFirstPosition(),
                                           .window = inline_put.getWindowTokens()});
  if (!reserved.ok()) return CompleteError(seq, rid, reserved.status());
  if (reserved->already_stored) {
    return AnswerCommit(
        seq, rid, {.bytes = data.size(), .codec_id = ServedCodecId(), .already_stored = true}, 0);
  }
  const storage::ReservationId id = reserved->reservation.id;
  PendingPut put = std::move(reserved->put);
  // The frame is gone once this returns: its bytes go into the reservation now (puts below the
  // client's threshold are small; the frame limit bounds the rest).
  std::memcpy(put.data, data.begin(), data.size());
  put.busy = true;  // committed at once: never expired, aborted or committed by a request
  puts_.File(id, std::move(put));
  ++put_services_->counters().puts_inline;
  SpawnHandler(FinishCommit(seq, rid, id, checksum));
}

void Session::HandleCommit(uint64_t seq, uint64_t rid, proto::Commit::Reader commit) {
  const uint64_t reservation = commit.getReservationId();
  const uint64_t checksum = commit.getChecksum();
  if (Status s = RequireEngine("Commit"); !s.ok()) return CompleteError(seq, rid, s);
  // Without reserve-ahead the fields are ignored, as by a kvd that predates them.
  const bool ahead_offered = ReservesAhead();
  const bool names_chunk = ahead_offered && commit.hasChunk();
  const uint64_t reserve_next = ahead_offered ? commit.getReserveNext() : 0;
  auto found = puts_.FindIdle(reservation);
  if (!found.ok()) return CompleteError(seq, rid, found.status());
  PendingPut* put = *found;
  const std::string name = "reservation " + std::to_string(reservation);
  if (names_chunk && !put->ahead) {
    return CompleteError(seq, rid,
                         Status::InvalidArgument(name + " was made by Reserve for its chunk: " +
                                                 "Commit.chunk names only a slot held ahead"));
  }
  if (put->ahead) {
    Status named =
        names_chunk
            ? NameHeldPut(reservation, commit.getChunk())
            : Status::InvalidArgument(name + " is a slot held ahead (CommitReply.next): its " +
                                      "Commit must name the chunk it holds (Commit.chunk)");
    if (!named.ok()) {
      // The bytes cannot be stored under any name: the slot goes, and says why.
      puts_.EndPut(reservation, {.end = PutEnd::kCommitRefused, .cause = named});
      return CompleteError(seq, rid, named);
    }
  }
  put->busy = true;
  SpawnHandler(FinishCommit(seq, rid, reservation, checksum, reserve_next));
}

bool Session::ReservesAhead() const {
  return put_services_->config().protocol.reserve_ahead && engine_ && shm_ && !read_only_ &&
         codec_ == nullptr;
}

std::optional<Session::HeldSlot> Session::ReserveAheadFor(uint64_t bytes) {
  const DaemonConfig& config = put_services_->config();
  DaemonCounters& counters = put_services_->counters();
  // Only a size some chunk of the model has (raw chunks: a whole number of tokens).
  const uint64_t per_token = model_->layout.ChunkBytes(1);
  if (read_closed_ || closed_ || per_token == 0 || bytes == 0 || bytes % per_token != 0 ||
      bytes / per_token > static_cast<uint64_t>(config.chunk_tokens) ||
      bytes > config.limits.max_chunk_bytes) {
    ++counters.reserve_ahead_declined;
    return std::nullopt;
  }
  storage::ChunkKey key{name_space_, model_->name, layout_digest_, ServedCodecId(), Hash128{}};
  auto reservation =
      put_services_->host_tier()->ReserveAhead(key, bytes, id_, TierReservationTtl());
  if (!reservation.ok()) {
    ++counters.reserve_ahead_declined;  // no headroom (or no room): the next put reserves
    return std::nullopt;
  }
  PendingPut put;
  put.bytes = bytes;
  put.deadline_ns = put_services_->clock()->NowNanos() + config.limits.reservation_ttl_ms * 1000000;
  put.data = reservation->data;
  put.key = key;
  put.ahead = true;
  auto ref = HoldShmSlot(reservation->id, reservation->offset, std::move(put));
  if (!ref.ok()) {
    ++counters.reserve_ahead_declined;
    return std::nullopt;
  }
  ++counters.reserve_ahead_granted;
  return HeldSlot{reservation->id, *ref};
}

Status Session::NameHeldPut(uint64_t reservation, proto::Reserve::Reader chunk) {
  PendingPut& put = *puts_.Find(reservation);
  const auto [hash, tokens, bytes, first_position, window] = ShapeOf(chunk);
  if (chunk.getOverNccl()) {
    return Status::InvalidArgument("Commit.chunk.overNccl: a slot held ahead is in shared memory");
  }
  KVD_RETURN_IF_ERROR(CheckPutShape(tokens, bytes, window));
  if (bytes != put.bytes) {
    return Status::InvalidArgument(
        "Commit.chunk.bytes " + std::to_string(bytes) + " != the " + std::to_string(put.bytes) +
        " bytes held ahead in reservation " + std::to_string(reservation) +
        ": a put that does not fit the held slot aborts it (Reserve.abortFirst) and reserves");
  }
  storage::ChunkKey key = put.key;
  key.chain_hash = hash;
  KVD_RETURN_IF_ERROR(put_services_->host_tier()->NameReservation(reservation, key, tokens));
  put.key = key;
  put.tokens = tokens;
  put.first_position = first_position;
  put.window = window;
  return Status::Ok();
}

void Session::AbortHeldSlot(uint64_t reservation) {
  const PendingPut* put = puts_.Find(reservation);
  if (put == nullptr || !put->ahead || put->busy) return;
  puts_.EndPut(reservation, {.end = PutEnd::kAbortFirst});
  ++put_services_->counters().reserve_ahead_aborted;
}

void Session::HandleAbort(uint64_t seq, uint64_t rid, proto::Abort::Reader abort) {
  const uint64_t reservation = abort.getReservationId();
  if (Status s = RequireEngine("Abort"); !s.ok()) return CompleteError(seq, rid, s);
  auto put = puts_.FindIdle(reservation);
  if (!put.ok()) return CompleteError(seq, rid, put.status());
  (*put)->busy = true;
  SpawnHandler(FinishAbort(seq, rid, reservation));
}

asio::awaitable<void> Session::FinishAbort(uint64_t seq, uint64_t rid, uint64_t reservation) {
  auto self = shared_from_this();
  const PendingPut put = *puts_.Find(reservation);
  bool ended = true;
  if (put.recv.valid()) ended = co_await CancelAndRelease(put.recv, put.link);
  puts_.EndPut(reservation, {.end = PutEnd::kAbortedByClient, .transfer_ended = ended});
  Complete(seq, MakeAck(rid));
}

void Session::ExpireReservations(int64_t now_ns) {
  if (read_closed_ || closed_) return;  // the teardown owns the ledger now
  for (uint64_t id : puts_.ClaimExpired(now_ns)) SpawnHandler(ExpirePut(id));
}

asio::awaitable<void> Session::ExpirePut(uint64_t reservation) {
  auto self = shared_from_this();
  const PendingPut put = *puts_.Find(reservation);
  bool ended = true;
  if (put.recv.valid()) ended = co_await CancelAndRelease(put.recv, put.link);
  puts_.EndPut(reservation, {.end = PutEnd::kExpired, .transfer_ended = ended});
  ++put_services_->counters().reservations_expired;
  KVD_LOG(INFO) << "reservation expired" << Kv("session", id_) << Kv("client", client_id_)
                << Kv("reservation", reservation) << Kv("bytes", put.bytes);
}

}  // namespace kvd::daemon
