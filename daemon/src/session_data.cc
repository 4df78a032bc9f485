// Session requests of the engine role: handshake, lookup, two-phase put, get.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <optional>

#include "kvd/common/hash.h"
#include "kvd/common/logging.h"
#include "kvd/common/version.h"
#include "kvd/proto/convert.h"
#include "hello_check.h"
#include "kvd/storage/host_tier.h"
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

const char* kDaemonVersion = "kvd " KVD_VERSION_STRING;

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

Status Session::RequireEngine(const char* op) const {
  if (!hello_done_) {
    return Status::FailedPrecondition(std::string(op) +
                                      " before Hello: the first request must be Hello");
  }
  if (!engine_) {
    return Status::FailedPrecondition(std::string(op) +
                                      " needs the engine role (this connection said admin)");
  }
  return Status::Ok();
}

Status Session::RequireAdmin(const char* op) const {
  if (engine_) {
    return Status::PermissionDenied(std::string(op) +
                                    " is an admin request; this connection has the engine role");
  }
  return Status::Ok();
}

Status Session::Dispatch(uint64_t seq, proto::Request::Reader request) {
  uint64_t rid = request.getRequestId();
  auto which = request.which();
  if (which != proto::Request::HELLO && !hello_done_) {
    CompleteError(seq, rid,
                  Status::FailedPrecondition("the first request on a connection must be Hello"));
    CloseAfter(seq);
    return Status::Ok();
  }
  const ProtocolOptions& protocol = server_->config().protocol;
  // Without protocol.releases_on_requests kvd ignores the field, as kvd before it did.
  if (request.hasReleaseReads() && protocol.releases_on_requests) {
    ReleaseReadsOf(request.getReleaseReads());
  }
  // The same for protocol.lease_releases_on_requests and Request.releaseLeases.
  if (request.hasReleaseLeases() && protocol.lease_releases_on_requests) {
    ReleaseLeasesOf(request.getReleaseLeases());
  }
  auto refuse_unknown_kind = [&] {
    CompleteError(
        seq, rid,
        Status::InvalidArgument("unknown request kind " + std::to_string(static_cast<int>(which)) +
                                " (newer client?)"));
  };
  // Without protocol.inline_put an InlinePut is a kind kvd does not know, as before it existed.
  if (which == proto::Request::INLINE_PUT && !protocol.inline_put) {
    refuse_unknown_kind();
    return Status::Ok();
  }
  if (which == proto::Request::LOOKUP || which == proto::Request::COMMIT ||
      which == proto::Request::INLINE_PUT || which == proto::Request::GET) {
    const LatencyOp op = which == proto::Request::LOOKUP ? LatencyOp::kLookup
                         : which == proto::Request::GET  ? LatencyOp::kGet
                                                         : LatencyOp::kPut;
    timed_[seq] = {static_cast<int>(op), std::chrono::duration_cast<std::chrono::nanoseconds>(
                                             std::chrono::steady_clock::now().time_since_epoch())
                                             .count()};
  }
  switch (which) {
    case proto::Request::HELLO:
      HandleHello(seq, rid, request.getHello());
      break;
    case proto::Request::LOOKUP:
      HandleLookup(seq, rid, request.getLookup());
      break;
    case proto::Request::RESERVE:
      HandleReserve(seq, rid, request.getReserve());
      break;
    case proto::Request::COMMIT:
      HandleCommit(seq, rid, request.getCommit());
      break;
    case proto::Request::INLINE_PUT:
      HandleInlinePut(seq, rid, request.getInlinePut());
      break;
    case proto::Request::ABORT:
      HandleAbort(seq, rid, request.getAbort());
      break;
    case proto::Request::GET:
      HandleGet(seq, rid, request.getGet());
      break;
    case proto::Request::RELEASE_LEASE:
      HandleReleaseLease(seq, rid, request.getReleaseLease());
      break;
    case proto::Request::STATS:
      HandleStats(seq, rid);
      break;
    case proto::Request::LIST:
      HandleList(seq, rid, request.getList());
      break;
    case proto::Request::EVICT:
      HandleEvict(seq, rid, request.getEvict());
      break;
    case proto::Request::HEALTH:
      HandleHealth(seq, rid);
      break;
    case proto::Request::RELEASE_READ:
      HandleReleaseRead(seq, rid, request.getReleaseRead());
      break;
    case proto::Request::CALIBRATION:
      HandleCalibration(seq, rid, request.getCalibration());
      break;
    case proto::Request::WEIGHTS:
      HandleWeights(seq, rid, request.getWeights());
      break;
    case proto::Request::SUBSCRIBE:
      HandleSubscribe(seq, rid, request.getSubscribe());
      break;
    case proto::Request::NCCL_CONNECT:
      HandleNcclConnect(seq, rid, request.getNcclConnect());
      break;
    case proto::Request::BYE:
      Complete(seq, MakeAck(rid));
      CloseAfter(seq);
      break;
    default:
      refuse_unknown_kind();
      break;
  }
  return Status::Ok();
}

void Session::HandleHello(uint64_t seq, uint64_t rid, proto::Hello::Reader hello) {
  const HelloFields fields = ReadHello(hello);
  auto refuse = [&](Status status) {
    KVD_LOG(WARNING) << "handshake refused" << Kv("session", id_)
                     << Kv("client", fields.client_id) << Kv("peer", peer_)
                     << Kv("model", fields.model) << Kv("status", status);
    CompleteError(seq, rid, status);
    CloseAfter(seq);
  };
  if (hello_done_) {
    return refuse(Status::FailedPrecondition("Hello sent twice on one connection"));
  }
  const HelloTerms terms{
      .config = &server_->config(),
      .auth = &server_->auth(),
      .codec = [server = server_](const std::string& model) { return server->codec(model); },
      .shared_memory_arena = server_->shm() != nullptr};
  boost::system::error_code ec;
  const HelloPeer peer{.info = peer_info_,
                       .on_unix = socket_.local_endpoint(ec).protocol().family() == AF_UNIX && !ec};
  StatusOr<Grant> grant = CheckHello(terms, fields, peer);
  if (!grant.ok()) return refuse(grant.status());
  AnswerHello(seq, rid, std::move(*grant));
}

void Session::AnswerHello(uint64_t seq, uint64_t rid, Grant grant) {
  const DaemonConfig& config = server_->config();
  if (grant.engine) {
    shm_ = grant.shared_memory;
    // The endpoint to the client waits for the first transfer (TransportPeer): a session that
    // moves no bytes over the transport (shared memory, lookups only) never has one. An idle
    // endpoint is not free: UCX's tcp lane of one that never carried a message tries to reach
    // the client again when the client goes (refused connect()s, at times a read spin).
    client_transport_address_ = grant.worker_address;
    model_ = grant.model;
    codec_ = grant.codec;
    layout_digest_ = grant.layout_digest;
    engine_ = true;
  }
  hello_done_ = true;
  server_->SessionAuthenticated(id_);
  keep_idle_ = grant.keep_idle;
  StartIdleWatch();
  client_id_ = grant.client_id;
  name_space_ = grant.name_space;
  read_only_ = grant.read_only;
  KVD_LOG(INFO) << "session ready" << Kv("session", id_) << Kv("client", client_id_)
                << Kv("peer", peer_) << Kv("role", engine_ ? "engine" : "admin")
                << Kv("model", engine_ ? model_->name : "") << Kv("namespace", name_space_)
                << Kv("shared_memory", shm_) << Kv("read_only", read_only_);
  const uint64_t max_chunk = config.limits.max_chunk_bytes;
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initHello();
             reply.setSessionId(id_);
             reply.setDaemonVersion(kDaemonVersion);
             reply.setNodeName(config.node_name);
             reply.setChunkTokens(static_cast<uint32_t>(config.chunk_tokens));
             if (engine_) {
               const std::string& addr = server_->local_address();
               reply.setWorkerAddress(
                   kj::arrayPtr(reinterpret_cast<const capnp::byte*>(addr.data()), addr.size()));
             }
             reply.setMaxFrameBytes(config.limits.max_frame_bytes);
             reply.setMaxChunkBytes(max_chunk);
             reply.setTransport(server_->transport_description());
             reply.setSharedMemory(shm_);
             reply.setReadOnly(read_only_);
             reply.setReleasesOnRequests(config.protocol.releases_on_requests);
             reply.setLeaseReleasesOnRequests(config.protocol.lease_releases_on_requests);
             reply.setReserveAhead(ReservesAhead());
             reply.setInlinePut(config.protocol.inline_put);
             reply.setKeepsPositions(codec_ == nullptr || codec_->policy().KeepsPositions());
             if (codec_ != nullptr) {
               const CompressionPolicy& p = codec_->policy();
               reply.setCodecId(codec_->codec_id());
               reply.setPolicyDigest(p.Digest());
               reply.setPolicy(p.CanonicalForm());
               reply.setWindowTokens(static_cast<uint32_t>(p.window));
               reply.setNeedsQueries(p.NeedsQueries());
               reply.setCalibrationVersion(codec_->calibration_version());
             }
           }));
}

StatusOr<transport::PeerHandle> Session::TransportPeer() {
  if (transport_peer_.valid()) return transport_peer_;
  auto peer = server_->transport()->Connect(client_transport_address_);
  if (!peer.ok()) return peer.status().WithContext("cannot reach the client's transport address");
  transport_peer_ = *peer;
  return transport_peer_;
}

StatusOr<Session::ShmRef> Session::PrepareShm(uint64_t offset) {
  storage::HostTier* tier = server_->tier();
  ShmRef ref;
  ref.segment = tier->SegmentOf(offset);
  ref.offset = offset - tier->SegmentStart(ref.segment);
  // Defence in depth: the tier never puts another namespace's block in a segment it assigned to
  // ours (and the block held by the caller keeps the assignment), but a memfd is a capability.
  if (std::string owner = tier->SegmentOwner(ref.segment); owner != name_space_) {
    return Status::Internal("arena segment " + std::to_string(ref.segment) +
                            " belongs to namespace \"" + owner + "\", not \"" + name_space_ + "\"");
  }
  // The block the caller holds keeps the segment assigned, so its generation cannot change
  // under us. A client that maps it already gets no descriptor: no dup (or, for a reading
  // session, no re-open through /proc) and close on every get and reserve.
  KVD_ASSIGN_OR_RETURN(ref.generation, server_->shm()->Generation(ref.segment));
  auto sent = shm_sent_.find(ref.segment);
  if (sent != shm_sent_.end() && sent->second == ref.generation) return ref;
  KVD_ASSIGN_OR_RETURN(ShmArena::SegmentFd seg,
                       server_->shm()->DupSegment(ref.segment, read_only_));
  ref.generation = seg.generation;
  ref.fd = seg.fd;
  return ref;
}

void Session::CompleteShm(uint64_t seq, Frame frame, const ShmRef& ref) {
  if (ref.fd < 0) return Complete(seq, std::move(frame));
  shm_sent_[ref.segment] = ref.generation;
  CompleteWithFd(seq, std::move(frame), ref.fd);
}

void Session::HandleReleaseRead(uint64_t seq, uint64_t rid, proto::ReleaseRead::Reader release) {
  const uint64_t read = release.getReadId();
  if (Status s = RequireEngine("ReleaseRead"); !s.ok()) return CompleteError(seq, rid, s);
  if (shm_reads_.erase(read) == 0) {
    return CompleteError(seq, rid,
                         Status::NotFound("read " + std::to_string(read) +
                                          " is not an open shared-memory read of this connection"));
  }
  Status s = server_->tier()->ReleaseRead(read);
  if (!s.ok()) return CompleteError(seq, rid, s);
  Complete(seq, MakeAck(rid));
}

void Session::ReleaseReadsOf(capnp::List<uint64_t>::Reader reads) {
  // Only this connection's open shared-memory reads; an id already ended (read TTL) or never
  // ours is skipped: this carries no reply to say so, and ending it again cannot matter.
  for (uint64_t read : reads) {
    if (shm_reads_.erase(read) == 0) continue;
    server_->tier()->ReleaseRead(read).IgnoreError();
  }
}

void Session::ReleaseLeasesOf(capnp::List<uint64_t>::Reader leases) {
  // Only this connection's live leases (HostTier checks the owner); an id already ended (lease
  // TTL), another connection's or never issued is skipped: this carries no reply to say so.
  for (uint64_t lease : leases) server_->tier()->ReleaseLease(lease, id_).IgnoreError();
}

uint32_t Session::ServedCodecId() const {
  return codec_ != nullptr ? codec_->codec_id() : storage::kRawCodecId;
}

void Session::HandleLookup(uint64_t seq, uint64_t rid, proto::Lookup::Reader lookup) {
  storage::LookupRequest request;
  auto chain = lookup.getChain();
  request.chunk_hashes.reserve(chain.size());
  for (auto h : chain) request.chunk_hashes.push_back(proto::FromProto(h));
  const uint32_t ttl_ms = lookup.getLeaseTtlMs();
  if (Status s = RequireEngine("Lookup"); !s.ok()) return CompleteError(seq, rid, s);

  const auto& limits = server_->config().limits;
  if (request.chunk_hashes.size() > static_cast<size_t>(limits.max_chain_chunks)) {
    return CompleteError(
        seq, rid,
        Status::OutOfRange("lookup chain of " + std::to_string(request.chunk_hashes.size()) +
                           " chunks is over limits.max_chain_chunks " +
                           std::to_string(limits.max_chain_chunks)));
  }
  // A longer lease than max_lease_ttl_ms is cut to it (the reply carries the TTL granted).
  int64_t ttl =
      ttl_ms == 0 ? limits.lease_ttl_ms : std::min<int64_t>(ttl_ms, limits.max_lease_ttl_ms);
  request.name_space = name_space_;
  request.model = model_->name;
  request.layout_digest = layout_digest_;
  request.codec_id = ServedCodecId();
  request.owner = id_;
  request.lease_ttl = std::chrono::milliseconds(ttl);
  storage::TierManager* tiers = server_->tiers();
  if (server_->disk() == nullptr) {
    // Host only: an in-memory index walk, answered inline.
    CompleteLookup(seq, rid, tiers->Lookup(request), ttl);
    return;
  }
  // A lookup may promote chunks from disk (RocksDB reads): off the io_context thread.
  SpawnHandler(
      FinishLookup(seq, rid, std::make_shared<storage::LookupRequest>(std::move(request)), ttl));
}

asio::awaitable<void> Session::FinishLookup(uint64_t seq, uint64_t rid,
                                            std::shared_ptr<const storage::LookupRequest> request,
                                            int64_t ttl) {
  auto self = shared_from_this();
  storage::TierManager* tiers = server_->tiers();
  // Only trivially destructible captures in a co_await expression: GCC 12 may destroy a
  // temporary of such an expression twice.
  const storage::LookupRequest* req = request.get();
  auto result = co_await OffloadTo<StatusOr<storage::LookupResult>>(
      server_->pool(), server_->io(), [tiers, req] { return tiers->Lookup(*req); });
  CompleteLookup(seq, rid, result, ttl);
}

void Session::CompleteLookup(uint64_t seq, uint64_t rid,
                             const StatusOr<storage::LookupResult>& result, int64_t ttl) {
  if (!result.ok()) return CompleteError(seq, rid, result.status());
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initLookup();
             reply.setMatchedChunks(static_cast<uint32_t>(result->matched_chunks));
             reply.setMatchedTokens(result->matched_tokens);
             reply.setLeaseId(result->lease_id);
             reply.setLeaseTtlMs(result->lease_id == 0 ? 0 : static_cast<uint32_t>(ttl));
           }));
}

std::chrono::milliseconds Session::TierReservationTtl() const {
  // The tier's own TTL is a backstop well after the daemon's: the daemon must cancel the
  // posted receive before the space can be reused.
  const DaemonConfig& config = server_->config();
  return std::chrono::milliseconds(config.limits.reservation_ttl_ms +
                                   2 * config.limits.transfer_timeout_ms +
                                   config.transport.close_timeout_ms + 60000);
}

Status Session::CheckPutShape(uint32_t tokens, uint64_t bytes, uint32_t window) const {
  const DaemonConfig& config = server_->config();
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

StatusOr<Session::ReservedPut> Session::ReservePut(const char* op, const Hash128& hash,
                                                   uint32_t tokens, uint64_t bytes,
                                                   uint64_t first_position, uint32_t window) {
  KVD_RETURN_IF_ERROR(RequireEngine(op));
  if (read_only_) {
    return Status::PermissionDenied(std::string(op) +
                                    ": this session said Hello.readOnly (it reads, never puts)");
  }
  KVD_RETURN_IF_ERROR(CheckPutShape(tokens, bytes, window));
  const DaemonConfig& config = server_->config();
  std::shared_ptr<void> ticket;
  if (codec_ != nullptr) {
    auto admitted = codec_->Admit();
    if (!admitted.ok()) {
      ++server_->counters().ingest_rejected;
      return admitted.status();
    }
    ticket = std::move(*admitted);
  }
  storage::ChunkKey key{name_space_, model_->name, layout_digest_, ServedCodecId(), hash};
  const int64_t ttl_ms = config.limits.reservation_ttl_ms;
  ReservedPut out;
  auto reservation = server_->tier()->Reserve(key, bytes, tokens, id_, TierReservationTtl());
  if (!reservation.ok()) {
    if (!storage::IsDedup(reservation.status())) return reservation.status();
    ++server_->counters().puts_deduplicated;
    out.already_stored = true;
    return out;
  }
  out.reservation = *reservation;
  PendingPut& put = out.put;
  put.bytes = bytes;
  put.deadline_ns = server_->clock()->NowNanos() + ttl_ms * 1000000;
  put.ticket = std::move(ticket);
  put.data = reservation->data;
  put.key = key;
  put.tokens = tokens;
  put.first_position = first_position;
  put.window = window;
  return out;
}

void Session::HandleReserve(uint64_t seq, uint64_t rid, proto::Reserve::Reader reserve) {
  const Hash128 hash = proto::FromProto(reserve.getChunkHash());
  const uint32_t tokens = reserve.getTokens();
  const uint64_t bytes = reserve.getBytes();
  const uint64_t first_position = reserve.getFirstPosition();
  const uint32_t window = reserve.getWindowTokens();
  const bool over_nccl = reserve.getOverNccl();
  const uint64_t abort_first = reserve.getAbortFirst();
  if (Status s = RequireEngine("Reserve"); !s.ok()) return CompleteError(seq, rid, s);
  // A held slot this put does not fit goes first: its space may be what this put needs.
  if (abort_first != 0 && ReservesAhead()) AbortHeldSlot(abort_first);
  if (over_nccl && !nccl_peer_.valid()) {
    return CompleteError(seq, rid,
                         Status::FailedPrecondition(
                             "Reserve.overNccl: this session has no NCCL link; send NcclConnect "
                             "first (or put over the transport)"));
  }
  auto reserved = ReservePut("Reserve", hash, tokens, bytes, first_position, window);
  if (!reserved.ok()) return CompleteError(seq, rid, reserved.status());
  if (reserved->already_stored) {
    return Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
                      auto reply = r.initReserve();
                      reply.setAlreadyStored(true);
                    }));
  }
  const int64_t ttl_ms = server_->config().limits.reservation_ttl_ms;
  const storage::Reservation* reservation = &reserved->reservation;
  PendingPut put = std::move(reserved->put);
  if (shm_ && !over_nccl) {
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
                               auto slot = reply.initShm();
                               slot.setSegment(ref->segment);
                               slot.setOffset(ref->offset);
                               slot.setGeneration(ref->generation);
                               slot.setFdAttached(ref->fd >= 0);
                             }),
                *ref);
    return;
  }
  const uint64_t tag = (id_ << 40) | (next_tag_++ & ((uint64_t{1} << 40) - 1));
  StatusOr<TransferHandle> recv = Status::Internal("no receive");
  if (over_nccl) {
    // The bytes land in device memory of the link, copied into the reservation on Commit.
    NcclLink& link = server_->nccl();
    auto staging = link.AcquireStaging(bytes);
    if (!staging.ok()) {
      server_->tier()->Abort(reservation->id).IgnoreError();
      return CompleteError(seq, rid,
                           staging.status().WithContext("cannot stage the put over the NCCL link"));
    }
    transport::TransferRequest request;
    request.op = transport::TransferOp::kRecv;
    request.peer = nccl_peer_;
    request.tag = tag;
    request.buffer = *staging;
    request.length = bytes;
    request.memory_type = link.memory_type();
    recv = link.transport()->Post(request);
    if (!recv.ok()) FreeStaging(*staging);
    put.nccl = true;
    put.staging = *staging;
  } else {
    // The transport hashes the bytes as they land where it copies them itself (same host):
    // the commit then compares checksums instead of reading the chunk again.
    auto peer = TransportPeer();
    if (peer.ok()) {
      recv = server_->transport()->PostRecv(*peer, tag, reservation->data, bytes,
                                            {.want_checksum = true});
    } else {
      recv = peer.status();
    }
  }
  if (!recv.ok()) {
    server_->tier()->Abort(reservation->id).IgnoreError();
    return CompleteError(seq, rid, recv.status().WithContext("cannot post the receive of the put"));
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

void Session::HandleInlinePut(uint64_t seq, uint64_t rid, proto::InlinePut::Reader inline_put) {
  const Hash128 hash = proto::FromProto(inline_put.getChunkHash());
  const uint32_t tokens = inline_put.getTokens();
  const uint64_t first_position = inline_put.getFirstPosition();
  const uint32_t window = inline_put.getWindowTokens();
  const uint64_t checksum = inline_put.getChecksum();
  const capnp::Data::Reader data = inline_put.getData();
  auto reserved = ReservePut("InlinePut", hash, tokens, data.size(), first_position, window);
  if (!reserved.ok()) return CompleteError(seq, rid, reserved.status());
  if (reserved->already_stored) {
    return Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
                      auto reply = r.initCommit();
                      reply.setAlreadyStored(true);
                      reply.setBytes(data.size());
                      reply.setCodecId(ServedCodecId());
                    }));
  }
  const storage::ReservationId id = reserved->reservation.id;
  PendingPut put = std::move(reserved->put);
  // The frame is gone once this returns: its bytes go into the reservation now (puts below the
  // client's threshold are small; the frame limit bounds the rest).
  std::memcpy(put.data, data.begin(), data.size());
  put.busy = true;  // committed at once: never expired, aborted or committed by a request
  puts_.File(id, std::move(put));
  ++server_->counters().puts_inline;
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
  return server_->config().protocol.reserve_ahead && engine_ && shm_ && !read_only_ &&
         codec_ == nullptr;
}

StatusOr<Session::ShmRef> Session::HoldShmSlot(uint64_t id, uint64_t offset, PendingPut put) {
  auto ref = PrepareShm(offset);
  if (!ref.ok()) {
    server_->tier()->Abort(id).IgnoreError();
    return ref.status();
  }
  put.written_in_place = true;
  puts_.File(id, std::move(put));
  return ref;
}

std::optional<Session::HeldSlot> Session::ReserveAheadFor(uint64_t bytes) {
  const DaemonConfig& config = server_->config();
  DaemonCounters& counters = server_->counters();
  // Only a size some chunk of the model has (raw chunks: a whole number of tokens).
  const uint64_t per_token = model_->layout.ChunkBytes(1);
  if (read_closed_ || closed_ || per_token == 0 || bytes == 0 || bytes % per_token != 0 ||
      bytes / per_token > static_cast<uint64_t>(config.chunk_tokens) ||
      bytes > config.limits.max_chunk_bytes) {
    ++counters.reserve_ahead_declined;
    return std::nullopt;
  }
  storage::ChunkKey key{name_space_, model_->name, layout_digest_, ServedCodecId(), Hash128{}};
  auto reservation = server_->tier()->ReserveAhead(key, bytes, id_, TierReservationTtl());
  if (!reservation.ok()) {
    ++counters.reserve_ahead_declined;  // no headroom (or no room): the next put reserves
    return std::nullopt;
  }
  PendingPut put;
  put.bytes = bytes;
  put.deadline_ns = server_->clock()->NowNanos() + config.limits.reservation_ttl_ms * 1000000;
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
  const Hash128 hash = proto::FromProto(chunk.getChunkHash());
  const uint32_t tokens = chunk.getTokens();
  const uint64_t bytes = chunk.getBytes();
  const uint64_t first_position = chunk.getFirstPosition();
  const uint32_t window = chunk.getWindowTokens();
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
  KVD_RETURN_IF_ERROR(server_->tier()->NameReservation(reservation, key, tokens));
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
  ++server_->counters().reserve_ahead_aborted;
}

asio::awaitable<void> Session::FinishCommit(uint64_t seq, uint64_t rid, uint64_t reservation,
                                            uint64_t checksum, uint64_t reserve_next) {
  auto self = shared_from_this();  // keep alive across suspension
  const PendingPut put = *puts_.Find(reservation);
  const int64_t timeout_ms = server_->config().limits.transfer_timeout_ms;
  storage::HostTier* tier = server_->tier();
  // Every store of a committed chunk goes through the tier manager (durable with a disk tier).
  storage::TierManager* tiers = server_->tiers();
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
  if (put.recv.valid()) ended = co_await CancelAndRelease(put.recv, put.nccl);
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
  if (put.recv.valid()) ended = co_await CancelAndRelease(put.recv, put.nccl);
  puts_.EndPut(reservation, {.end = PutEnd::kExpired, .transfer_ended = ended});
  ++server_->counters().reservations_expired;
  KVD_LOG(INFO) << "reservation expired" << Kv("session", id_) << Kv("client", client_id_)
                << Kv("reservation", reservation) << Kv("bytes", put.bytes);
}

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
  storage::HostTier* tier = server_->tier();
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
  if (!shm_ && !server_->tiers()->VerifyLeavingHost(*view, over_nccl ? "nccl" : "transport")) {
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
  if (ended) server_->tier()->ReleaseRead(view.read_id).IgnoreError();
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

void Session::HandleReleaseLease(uint64_t seq, uint64_t rid, proto::ReleaseLease::Reader release) {
  const uint64_t lease = release.getLeaseId();
  if (Status s = RequireEngine("ReleaseLease"); !s.ok()) return CompleteError(seq, rid, s);
  Status s = server_->tier()->ReleaseLease(lease, id_);
  if (!s.ok()) return CompleteError(seq, rid, s);
  Complete(seq, MakeAck(rid));
}

}  // namespace kvd::daemon
