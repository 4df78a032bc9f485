// Session requests: dispatch by kind, the role checks, and the handshake (Hello).
#include <sys/socket.h>

#include <chrono>
#include <optional>
#include <string>

#include "hello_check.h"
#include "kvd/common/logging.h"
#include "kvd/common/version.h"
#include "responses.h"
#include "session.h"

namespace kvd::daemon {

namespace {

const char* kDaemonVersion = "kvd " KVD_VERSION_STRING;

// A request of a kind this daemon does not serve (a newer client's, or one switched off).
Status UnknownKind(proto::Request::Which which) {
  return Status::InvalidArgument("unknown request kind " + std::to_string(static_cast<int>(which)) +
                                 " (newer client?)");
}

// The latency histogram a request kind is observed in, if any.
std::optional<LatencyOp> TimedOp(proto::Request::Which which) {
  switch (which) {
    case proto::Request::LOOKUP:
      return LatencyOp::kLookup;
    case proto::Request::GET:
      return LatencyOp::kGet;
    case proto::Request::COMMIT:
    case proto::Request::INLINE_PUT:
      return LatencyOp::kPut;
    default:
      return std::nullopt;
  }
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
  const uint64_t rid = request.getRequestId();
  const auto which = request.which();
  if (which != proto::Request::HELLO && !hello_done_) {
    CompleteError(seq, rid,
                  Status::FailedPrecondition("the first request on a connection must be Hello"));
    CloseAfter(seq);
    return Status::Ok();
  }
  ReleasePiggybacked(request);
  // Without protocol.inline_put an InlinePut is a kind kvd does not know, as before it existed.
  if (which == proto::Request::INLINE_PUT && !server_->config().protocol.inline_put) {
    CompleteError(seq, rid, UnknownKind(which));
    return Status::Ok();
  }
  if (const std::optional<LatencyOp> op = TimedOp(which)) {
    timed_[seq] = {static_cast<int>(*op), std::chrono::duration_cast<std::chrono::nanoseconds>(
                                              std::chrono::steady_clock::now().time_since_epoch())
                                              .count()};
  }
  HandleRequest(seq, rid, request);
  return Status::Ok();
}

void Session::ReleasePiggybacked(proto::Request::Reader request) {
  const ProtocolOptions& protocol = server_->config().protocol;
  // Without protocol.releases_on_requests kvd ignores the field, as kvd before it did.
  if (request.hasReleaseReads() && protocol.releases_on_requests) {
    ReleaseReadsOf(request.getReleaseReads());
  }
  // The same for protocol.lease_releases_on_requests and Request.releaseLeases.
  if (request.hasReleaseLeases() && protocol.lease_releases_on_requests) {
    ReleaseLeasesOf(request.getReleaseLeases());
  }
}

void Session::HandleRequest(uint64_t seq, uint64_t rid, proto::Request::Reader request) {
  const auto which = request.which();
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
    case proto::Request::PLACEMENT:
      HandlePlacement(seq, rid, request.getPlacement());
      break;
    case proto::Request::BYE:
      Complete(seq, MakeAck(rid));
      CloseAfter(seq);
      break;
    default:
      CompleteError(seq, rid, UnknownKind(which));
      break;
  }
}

void Session::HandleHello(uint64_t seq, uint64_t rid, proto::Hello::Reader hello) {
  const HelloFields fields = ReadHello(hello);
  auto refuse = [&](Status status) {
    KVD_LOG(WARNING) << "handshake refused" << Kv("session", id_) << Kv("client", fields.client_id)
                     << Kv("peer", peer_) << Kv("model", fields.model) << Kv("status", status);
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
             reply.setClusterLookup(engine_ && server_->peer_fetcher() != nullptr);
             reply.setClusterPlacement(engine_ && server_->peer_fetcher() != nullptr);
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

}  // namespace kvd::daemon
